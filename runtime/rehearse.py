"""Rehearse a plan: one rank of each class runs the runtime's own step at full scale, on nothing.

`rehearse_plan` picks a rank of every class of ranks the memory estimate has (one per
pipeline stage class, at coordinate 0 on the other axes: they hold the same bytes), and
in this process, for each, joins torch's `fake` process group at the plan's world size
(collectives return at once and move nothing) and runs what `fivedc run` runs for that
rank: `setup_rank` and the `Trainer`'s forward, backward, gradient sums and optimizer
step, on the meta device (tensors with shapes and storages, no memory). `LiveBytes`
(`runtime/live_bytes.py`) counts every storage from its allocation to its free,
so the peak is what this rank's program holds at its busiest moment, by category.

What a rehearsal cannot do on meta: values. The loss is NaN; an op that needs values
(routing tokens to experts, `.item()`) raises `RehearsalError` naming it. On `cpu` and
`cuda` the tensors are real (random values); on `cuda` the CUDA caching allocator's own
peak over the step (allocated and reserved) stands beside `LiveBytes`' count, and the
estimate is held to the allocator's peak: what the GPU must really have.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fivedc.errors import FivedcError
from fivedc.estimates.memory import RankMemory
from fivedc.ir.mesh import MeshAxis
from fivedc.plan.execution_plan import ExecutionPlan
from fivedc.runtime.live_bytes import CATEGORIES, LiveBytes, Storage
from fivedc.runtime.pool_worker import RankInfo
from fivedc.runtime.saved import saving_scope
from fivedc.runtime.train import Trainer, TrainSettings
from fivedc.runtime.verify import setup_rank


class RehearsalError(FivedcError):
    """The plan's program cannot run on shapes alone."""

    exit_code = 2


@dataclass(frozen=True)
class ClassRehearsal:
    """One class of ranks: the estimate, and what the rank `rank` held at its peak."""

    ranks: str  # the class, as the estimate names it: all, pp=0, pp=1..6
    rank: int  # the rank rehearsed
    estimated: RankMemory
    peak: int  # the most bytes live at once over the step
    at_peak: dict[str, int]  # how the peak splits, by category
    largest: tuple[Storage, ...]  # the biggest storages live at the peak
    seconds: float  # wall time of this rank's rehearsal
    allocator: AllocatorPeak | None = None  # on cuda: the caching allocator's peak over the step

    @property
    def measured(self) -> int:
        """What the estimate is held to: the allocator's peak on a GPU, else the live storages'."""
        return self.allocator.allocated if self.allocator else self.peak

    @property
    def ratio(self) -> float:
        """Estimated total / rehearsed peak (1.0: the estimate is exact)."""
        return self.estimated.total / self.measured if self.measured else float("inf")


@dataclass(frozen=True)
class AllocatorPeak:
    """The CUDA caching allocator over one step: the most bytes its tensors held at once
    (`max_memory_allocated`) and the most it held from the driver (`max_memory_reserved`:
    those plus its cached free blocks and fragmentation)."""

    allocated: int
    reserved: int


@dataclass(frozen=True)
class Rehearsal:
    mesh: str
    dtype: str
    classes: tuple[ClassRehearsal, ...]
    device: str = "meta"

    def to_json(self) -> dict:
        def estimated(c: ClassRehearsal) -> dict:
            return {k: getattr(c.estimated, k) for k in (*CATEGORIES, "total")}

        return {"mesh": self.mesh, "dtype": self.dtype, "device": self.device,
                "classes": [{"ranks": c.ranks, "rank": c.rank, "estimated": estimated(c),
                             "rehearsed": {**c.at_peak, "total": c.peak}, "ratio": round(c.ratio, 4),
                             **({"allocator": dataclasses.asdict(c.allocator)} if c.allocator else {}),
                             "largest": [{"bytes": s.nbytes, "category": s.category, "made_by": s.made_by,
                                          "shape": list(s.shape), "dtype": s.dtype} for s in c.largest]}
                            for c in self.classes]}


def class_ranks(plan: ExecutionPlan) -> list[tuple[RankMemory, int]]:
    """Each class of ranks of the memory estimate and the rank that stands for it: the first
    pp rank of the class, at coordinate 0 on every other axis."""
    mesh, pp = plan.mesh, plan.mesh.size(MeshAxis.PP)
    out = []
    for entry in plan.memory.ranks:
        coords = dict.fromkeys(mesh.rank_order, 0) | {MeshAxis.PP: entry.pp_ranks(pp)[0]}
        out.append((entry, mesh.rank_of(coords)))
    return out


def rehearse_plan(plan: ExecutionPlan, *, device: str = "meta", workers: int = 1, on_progress=None) -> Rehearsal:
    """Rehearse one rank of each class of `plan` on `device`: meta (nothing allocated), cpu or
    cuda (real tensors, random values); one after the other in this process, or with `workers`
    > 1 that many at once, each in a fresh process of its own (not on cuda: one GPU)."""
    if dist.is_initialized():
        raise RehearsalError("a rehearsal joins a fake process group of its own; this process is in one already")
    jobs = [(plan, entry, rank, device) for entry, rank in class_ranks(plan)]
    if workers > 1 and len(jobs) > 1 and device != "cuda":
        classes = _in_processes(jobs, min(workers, len(jobs)), on_progress)
    else:
        classes = [_heard(rehearse_class(*job), on_progress) for job in jobs]
    return Rehearsal(str(plan.mesh), plan.dtype, tuple(classes), device)


def rehearse_class(plan: ExecutionPlan, entry: RankMemory, rank: int, device: str) -> ClassRehearsal:
    """One class: its rank's step, what it held at its peak."""
    start = time.perf_counter()
    peaks: list[AllocatorPeak] = []
    live = rehearse_rank(plan, rank, TrainSettings(steps=1, dtype=plan.dtype, keep_grads=False), device=device,
                         allocator=peaks)
    return ClassRehearsal(entry.ranks, rank, entry, live.peak, dict(live.at_peak), live.largest,
                          time.perf_counter() - start, peaks[0] if peaks else None)


def _heard(c: ClassRehearsal, on_progress) -> ClassRehearsal:
    if on_progress is not None:
        on_progress(f"ranks {c.ranks}: rank {c.rank} rehearsed in {c.seconds:.1f} s")
    return c


def _in_processes(jobs: list, workers: int, on_progress) -> list[ClassRehearsal]:
    """The classes rehearsed `workers` at a time in spawned processes (each joins its own fake
    group); in the estimate's order whatever order they finish in."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    done: dict[int, ClassRehearsal] = {}
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(rehearse_class, *job): k for k, job in enumerate(jobs)}
        for future in as_completed(futures):
            done[futures[future]] = _heard(future.result(), on_progress)
    return [done[k] for k in range(len(jobs))]


def rehearse_rank(plan: ExecutionPlan, rank: int, settings: TrainSettings, *, device: str = "meta",
                  allocator: list | None = None) -> LiveBytes:
    """One step of `rank`'s program on `device` (meta, cpu or cuda), in a fake process group of
    the plan's world; what it held, storage by storage. On cuda the allocator's peak over the
    step is appended to `allocator`."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    backends = "cpu:fake,cuda:fake" if device == "cuda" else "cpu:fake,meta:fake"
    dist.init_process_group(backends, store=FakeStore(), rank=rank, world_size=plan.mesh.world)
    live, threads = LiveBytes(), torch.get_num_threads()
    if device == "meta":  # the host's work is small index arithmetic (routing), slower split over threads
        torch.set_num_threads(1)
    try:
        with live:
            program, params, inputs, _ = setup_rank(plan, RankInfo(rank, plan.mesh.world, device), settings)
            trainer = Trainer(program, params, settings, zero=plan.zero, buckets=plan.buckets,
                              overlap=plan.overlap, pipeline=plan.pipeline)
            del params  # the optimizer holds them now (ZeRO-3: only the owned chunks)
            _mark_held(live, trainer, inputs)
            live.reset_peak()
            with _allocator_peak(device, allocator):
                with saving_scope(live):  # what autograd keeps for backward: activations
                    trainer.forward_backward(inputs)
                live.mark(trainer.optimizer.grads.values(), "grads")
                trainer.optimizer.step()
                trainer.end_step()
    except (RuntimeError, NotImplementedError) as error:
        raise RehearsalError(f"rank {rank}'s step failed on the {device} device: {str(error).splitlines()[0]}",
                             hint="an op that needs values (which a rehearsal has not) cannot be rehearsed; "
                             "anything else is a bug in fivedc to report") from error
    finally:
        torch.set_num_threads(threads)
        with quiet_stderr():  # c10d warns that the group's undefined device type has no hooks: it has none
            dist.destroy_process_group()
    return live


@contextlib.contextmanager
def _allocator_peak(device: str, out: list | None):
    """On cuda: the caching allocator's peak from here to the end of the block, into `out`."""
    if device != "cuda":
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    yield
    torch.cuda.synchronize()
    if out is not None:
        out.append(AllocatorPeak(torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()))


@contextlib.contextmanager
def quiet_stderr():
    """File descriptor 2 to /dev/null for a moment (C++ warnings bypass Python's)."""
    sys.stderr.flush()
    saved_fd, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved_fd, 2)
        os.close(saved_fd)
        os.close(null)


def _mark_held(live: LiveBytes, trainer: Trainer, inputs: dict) -> None:
    """The tensors a rank holds at rest, by category; a gradient is marked as it accumulates."""
    optimizer = trainer.optimizer
    live.mark(optimizer.params.values(), "params")
    live.mark([t for s in optimizer.state.values() for t in (s.exp_avg, s.exp_avg_sq, s.master)], "optimizer")
    live.mark(inputs.values(), "activations")
    for p in optimizer.params.values():
        p.register_post_accumulate_grad_hook(lambda p: live.mark([p.grad], "grads"))
