"""`fivedc train --launcher ray`: one Ray actor per rank, the same training loop, rank 0's rows streamed.

`RayGroup` joins the Ray cluster at `--address` (or starts a local instance: as many
logical CPUs as ranks, no dashboard) and reserves a placement group of one bundle per
rank, packed (`PACK`: ranks fill a node before the next, so the innermost axes of the
rank order, tp first, stay inside a node), a GPU and a CPU each when the cluster has a
GPU per rank (NCCL), else a CPU each (gloo). Each attempt (`RayGroup.run`) starts one
`RankActor` per bundle; actor 0 names its node's address and a free port
(MASTER_ADDR/MASTER_PORT; 127.0.0.1 on a one-node cluster), every actor sets the
variables torchrun would (RANK, WORLD_SIZE, LOCAL_RANK 0: Ray gives each actor its own
GPU) and joins the process group with `init_from_env`, then runs the training loop of
the other launchers (`train_loop.setup`, `train_steps`). `train` is a streaming
generator: rank 0 yields each step's row as it ends, and the driver prints it at once.

The driver waits on every actor's stream together: an actor that dies (its process
gone: `os._exit`, OOM, a lost node) ends the attempt at once as a `WorkerError` (exit
3), the others are killed, and `fivedc/cli/train_launch.with_restarts` starts a new set
of actors in the same placement group from the last checkpoint. A rank's `FivedcError`
comes back as a `RankError` with its exit code, and is not retried. Ray Train's
`TorchTrainer` was not used: it sets up the process group and the checkpoints its own
way, where fivedc's ranks need their mesh's groups and their own sharded checkpoints.
Ray is an optional dependency (`pip install "fivedc[ray]"`), imported only here.
"""

from __future__ import annotations

import os
import socket
import time

from fivedc.errors import FivedcError
from fivedc.runtime.pool import RankError, WorkerError
from fivedc.runtime.pool_worker import Failure, failure_of

INSTALL = 'pip install "fivedc[ray]"'  # or pip install ray
GRACE_S = 2.0  # after a rank's failure, how long the others may take to report theirs


def import_ray():
    """The `ray` module, or a FivedcError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise FivedcError("--launcher ray needs Ray, which is not installed here",
                          hint=f"install it: {INSTALL} (or pip install ray)") from None
    return ray


class RankActor:
    """One rank of the job, in its own Ray worker process (wrapped by `ray.remote` when used)."""

    def where(self) -> tuple[str, int]:
        """This node's address and a free port on it: the job's MASTER_ADDR and MASTER_PORT."""
        import ray

        with socket.socket() as probe:
            probe.bind(("", 0))
            return ray.util.get_node_ip_address(), probe.getsockname()[1]

    def train(self, job, *, rank: int, world: int, master: tuple[str, int], cwd: str, timeout_s: float):
        """Rank `rank`'s training: yields {"row": ...} per step (rank 0), then {"done": True},
        or {"failure": Failure} when it raised."""
        import torch.distributed as dist

        from fivedc.runtime.pool import init_from_env
        from fivedc.runtime.train_loop import setup, train_steps

        os.chdir(cwd)  # relative paths mean what they meant to the command (a file system all nodes see)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR=master[0],
                          MASTER_PORT=str(master[1]))
        try:
            info = init_from_env(timeout_s=timeout_s)
            run = setup(info, job)
            for row in train_steps(run, job, info):
                if rank == 0:
                    yield {"row": row}
            dist.barrier()  # gloo: a rank that tears down early breaks peers still in the last save
            yield {"done": True}
        except BaseException as error:  # noqa: BLE001 - everything goes back to the driver
            yield {"failure": failure_of(error)}
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


class RayGroup:
    """A Ray cluster joined (or started) and a placement group of `world` bundles, for a run's attempts."""

    def __init__(self, *, world: int, address: str | None, timeout_s: float, say=print) -> None:
        self.world, self.address, self.timeout_s, self.say = world, address, timeout_s, say
        self.started = False
        self.group = None
        self.gpus = False

    def __enter__(self) -> RayGroup:
        ray = import_ray()
        if not ray.is_initialized():
            ray.init(**_init_options(self.address, self.world))
            self.started = True
        try:
            self._reserve(ray)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        ray = import_ray()
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)
            self.group = None
        if self.started:
            ray.shutdown()
            self.started = False

    def _reserve(self, ray) -> None:
        from ray.util.placement_group import placement_group

        have = ray.cluster_resources()
        self.gpus = have.get("GPU", 0) >= self.world
        bundle = {"CPU": 1, "GPU": 1} if self.gpus else {"CPU": 1}
        self.group = placement_group([bundle] * self.world, strategy="PACK")
        ready, _ = ray.wait([self.group.ready()], timeout=self.timeout_s)
        if not ready:
            raise FivedcError(f"the Ray cluster did not place {self.world} ranks of {bundle} in {self.timeout_s:g} s "
                              f"(it has {have.get('CPU', 0):g} CPUs and {have.get('GPU', 0):g} GPUs)",
                              hint="give a mesh that fits the cluster, add nodes, or wait longer (--timeout)")
        nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
        where = "a local Ray instance" if self.started and self.address is None else f"the Ray cluster ({nodes} nodes)"
        self.say(f"Ray: {self.world} actors on {where}, one {'GPU (NCCL)' if self.gpus else 'CPU (gloo)'} each, "
                 "packed (placement group, PACK)", flush=True)

    def run(self, job, *, on_row) -> None:
        """One attempt: fresh actors, every rank trained to the job's stop; rank 0's rows to `on_row`."""
        ray = import_ray()
        actors = [self._actor(ray, rank) for rank in range(self.world)]
        try:
            master = self._master(ray, actors[0])
            streams = {rank: actor.train.remote(job, rank=rank, world=self.world, master=master, cwd=os.getcwd(),
                                                timeout_s=self.timeout_s)
                       for rank, actor in enumerate(actors)}
            _follow(ray, streams, on_row, world=self.world)
        finally:
            for actor in actors:
                ray.kill(actor)

    def _actor(self, ray, rank: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(placement_group=self.group, placement_group_bundle_index=rank)
        return ray.remote(RankActor).options(num_cpus=1, num_gpus=1 if self.gpus else 0,
                                             scheduling_strategy=strategy).remote()

    def _master(self, ray, actor) -> tuple[str, int]:
        try:
            host, port = ray.get(actor.where.remote(), timeout=self.timeout_s)
        except ray.exceptions.RayError as error:
            raise WorkerError(f"rank 0's Ray actor did not start: {type(error).__name__}: "
                              f"{str(error).splitlines()[0]}", rank=0) from None
        one_node = sum(1 for node in ray.nodes() if node.get("Alive")) == 1
        return ("127.0.0.1" if one_node else host), port


def _init_options(address: str | None, world: int) -> dict:
    """ray.init's options: light for a local instance (as many CPUs as ranks, no dashboard)."""
    quiet = {"log_to_driver": False, "logging_level": "WARNING"}
    if address is not None:
        return {"address": address, **quiet}
    return {"num_cpus": world, "include_dashboard": False, **quiet}


def _follow(ray, streams: dict, on_row, *, world: int) -> None:
    """Read every rank's stream until each is done. After the first failure the others get
    `GRACE_S` to report theirs, so that a dead rank is blamed rather than the peers it left
    waiting in a collective."""
    live, failures, deadline = dict(streams), {}, None
    while live and (deadline is None or time.monotonic() < deadline):
        wait_s = 1.0 if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _ = ray.wait(list(live.values()), num_returns=1, timeout=wait_s)
        for stream in ready:
            rank = next(r for r, s in live.items() if s is stream)
            kind, value = _next(ray, stream)
            if kind == "row":
                on_row(value)
                continue
            del live[rank]
            if kind == "failure":
                failures[rank] = value
                deadline = deadline or time.monotonic() + GRACE_S
    if failures:
        raise _blame(failures, world)


def _next(ray, stream) -> tuple[str, object]:
    """("row", row), ("done", None) or ("failure", Failure): the next item of a rank's stream."""
    try:
        item = ray.get(next(stream))
    except StopIteration:
        return "failure", Failure("raised", time.time(), "its stream ended without a result")
    except ray.exceptions.RayActorError as error:
        return "failure", Failure("died", time.time(), f"its Ray actor's process ended ({type(error).__name__})")
    except ray.exceptions.RayError as error:
        return "failure", Failure("raised", time.time(), f"{type(error).__name__}: {error}")
    if "row" in item:
        return "row", item["row"]
    return ("failure", item["failure"]) if "failure" in item else ("done", None)


def _blame(failures: dict[int, Failure], world: int) -> WorkerError:
    """A dead rank first, then a rank's own error (its FivedcError as it is), then the earliest."""
    order = {"died": 0, "user": 1}
    rank = min(failures, key=lambda r: (order.get(failures[r].kind, 2), failures[r].when))
    failure = failures[rank]
    others = sorted(set(failures) - {rank})
    hint = f"rank(s) {', '.join(map(str, others))} failed too (after it)" if others else ""
    if failure.kind == "user":
        return RankError(failure, rank=rank, where=f"on rank {rank} of {world}")
    if failure.kind == "died":
        return WorkerError(f"rank {rank} of {world} died: {failure.text}", rank=rank, hint=hint)
    last = failure.text.rstrip().splitlines()[-1] if failure.text.strip() else "no message"
    return WorkerError(f"rank {rank} of {world} failed: {last[:200]}\n{failure.text.rstrip()}", rank=rank, hint=hint)


__all__ = ["INSTALL", "RankActor", "RayGroup", "import_ray"]
