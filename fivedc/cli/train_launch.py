"""How `fivedc train` runs its ranks, and restarts them: local processes, one rank of torchrun, Ray actors.

`--launcher local` (the default) starts the mesh's world of processes on this machine
(`runtime/pool.py`); `--launcher ray` one Ray actor per rank
(`runtime/ray_launcher.py`); under torchrun (its `WORLD_SIZE` set) the process is
one rank whatever the flag says. With `--max-restarts N` (local and Ray) a job whose rank
died, crashed or timed out starts again from the latest committed checkpoint of its save
directory (afresh, or from its own `--resume`, when none was written yet), up to N
times, and says so; a rank's error about the input (exit 2) or a NaN (exit 1) would only
repeat, and ends the run. Under torchrun, torchrun's own `--max-restarts` restarts the
processes, and `--resume auto` (`fivedc/cli/train_resume.py`) takes them to the latest
checkpoint.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from fivedc.cli.screen import say
from fivedc.errors import FivedcError

SCRATCH_PREFIX = "fivedc-train-"  # + pid + "-" + random, in the temp directory
LAUNCHERS = ("local", "ray")
PEER_GONE = re.compile(r"/gloo/|NCCL|Connection (closed|reset) by peer", re.IGNORECASE)


def check_launch(args, *, launched: bool) -> None:
    """The launcher flags fit together (before any work)."""
    if args.max_restarts < 0:
        raise FivedcError(f"--max-restarts {args.max_restarts} must be 0 or more", hint="e.g. --max-restarts 3")
    if launched and args.launcher == "ray":
        raise FivedcError("--launcher ray starts its own ranks, and this process is already one rank of a launcher "
                          "(WORLD_SIZE is set)", hint="run fivedc train --launcher ray outside torchrun")
    if launched and args.max_restarts:
        raise FivedcError("under torchrun, torchrun restarts the ranks: --max-restarts is its flag",
                          hint="give it to torchrun (torchrun --max-restarts 3 ... -m fivedc -- train ...), which "
                          "resumes from the latest checkpoint by itself (--resume auto)")
    if args.address is not None and args.launcher != "ray":
        raise FivedcError(f"--address {args.address} names a Ray cluster, for --launcher ray",
                          hint="add --launcher ray, or drop --address")


def launch(job, progress, args, *, launched: bool) -> None:
    """Run the job's ranks to the end (with the restarts `--max-restarts` allows)."""
    if launched:
        _under_launcher(job, progress, timeout_s=args.timeout)
    elif args.launcher == "ray":
        _ray(job, progress, args)
    else:
        _local(job, progress, args)


def with_restarts(attempt_fn, job, *, restarts: int) -> None:
    """`attempt_fn(job)` until it succeeds, restarting from the latest checkpoint after a
    rank's death, crash or timeout, at most `restarts` times."""
    from fivedc.runtime.pool import RankError, WorkerError

    for attempt in range(restarts + 1):
        try:
            attempt_fn(dataclasses.replace(job, attempt=attempt))
            return
        except WorkerError as error:
            if isinstance(error, RankError) or attempt == restarts:
                raise
            job = restarted(job)
            where = f"from {job.resume}" if job.resume is not None else "from the start (nothing was saved)"
            say(f"restart {attempt + 1} of {restarts}: {_summary(error.message)}; continuing {where}", flush=True)


def _summary(message: str) -> str:
    """A failure in one line: its first, completed by its last when the first only leads in."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()] or ["a rank failed"]
    first = lines[0]
    if first.endswith(":") and len(lines) > 1:
        first = f"{first} {lines[-1]}"
    return first if len(first) <= 200 else first[:197] + "..."


def restarted(job):
    """The job continuing from the latest committed checkpoint of its save directory,
    checked as a resume is (the job itself when there is none)."""
    from fivedc.runtime.checkpoint import committed, read_index
    from fivedc.runtime.checkpoint_files import check_files
    from fivedc.runtime.resume import check_same_model

    found = committed(job.save_dir) if job.save_dir is not None else []
    if not found:
        return job
    folder = found[-1][1]
    index = read_index(folder)
    check_files(folder, index)
    check_same_model(index, job.plan, where=str(folder))
    return dataclasses.replace(job, resume=str(folder), init=None)


def _local(job, progress, args) -> None:
    """The mesh's world of local processes; a factory's weights go through a temporary file."""
    from fivedc.runtime.pool import run_once
    from fivedc.runtime.pool_cleanup import Scratch
    from fivedc.runtime.resources import check_local_resources
    from fivedc.runtime.train_loop import train_job

    plan = job.plan
    check_local_resources(world=plan.mesh.world, bytes_per_rank=plan.memory.total, force=args.force,
                          what=f"training {args.model} on mesh {plan.mesh}")
    with Scratch(SCRATCH_PREFIX) as scratch:  # removed on SIGTERM too; a killed run's by the next
        if isinstance(job.init, dict):
            job = dataclasses.replace(job, init=_write_init(job.init, Path(scratch) / "init.safetensors"))

        def attempt(each):
            run_once(train_job, world=plan.mesh.world, payload=each, timeout_s=args.timeout,
                     on_progress=progress.line)

        try:
            with_restarts(attempt, job, restarts=args.max_restarts)
        except FivedcError as error:
            raise with_resume_hint(error, job) from None


def _ray(job, progress, args) -> None:
    """One Ray actor per rank, on the cluster at `--address` or a local instance."""
    from fivedc.runtime.ray_launcher import RayGroup

    with RayGroup(world=job.plan.mesh.world, address=args.address, timeout_s=args.timeout, say=say) as group:
        try:
            with_restarts(lambda each: group.run(each, on_row=progress.row), job, restarts=args.max_restarts)
        except FivedcError as error:
            raise with_resume_hint(error, job) from None


def with_resume_hint(error: FivedcError, job) -> FivedcError:
    """A failed run that saved: say where to continue from; never the checkpoint this run
    resumed from when that is what the error is about (bad input: exit 2)."""
    from fivedc.runtime.checkpoint import committed

    found = committed(job.save_dir) if job.save_dir is not None else []
    same = bool(found) and job.resume is not None and found[-1][1].resolve() == Path(job.resume).resolve()
    if found and not (same and error.exit_code == 2):
        more = (f"the last checkpoint is {found[-1][1]} (step {found[-1][0]}): continue with --resume {job.save_dir} "
                "(or the same command again: --resume auto)")
        error.hint = f"{error.hint}; {more}" if error.hint else more
    return error


def _write_init(tensors: dict, path: Path) -> str:
    from safetensors.torch import save_file

    save_file({name: t.detach().contiguous().clone() for name, t in tensors.items()}, str(path))
    return str(path)


def _under_launcher(job, progress, *, timeout_s: float) -> None:
    """One rank of a torchrun job of the mesh's size; rank 0 prints and logs."""
    import torch.distributed as dist

    from fivedc.runtime.fault_hook import launcher_attempt
    from fivedc.runtime.pool import WorkerError, check_world, init_from_env
    from fivedc.runtime.train_loop import train_rank

    check_world(job.plan.mesh.world, mesh=job.plan.mesh)
    info = init_from_env(timeout_s=timeout_s)
    try:
        train_rank(info, dataclasses.replace(job, attempt=launcher_attempt()), on_row=progress.row)
    except RuntimeError as error:  # a peer died or was stopped: not a bug here, and the launcher restarts
        if not _lost_peer(error):
            raise
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise WorkerError(f"rank {info.rank} of {info.world} lost a peer: {first[:160]}", rank=info.rank,
                          hint="another rank died or was stopped (its own message says why); under torchrun "
                          "--max-restarts the job starts again from the latest checkpoint") from None
    finally:
        dist.destroy_process_group()


def _lost_peer(error: RuntimeError) -> bool:
    """A collective failed because another rank is gone (gloo and NCCL say so in a RuntimeError)."""
    import torch.distributed as dist

    return isinstance(error, dist.DistError) or bool(PEER_GONE.search(str(error)))


__all__ = ["LAUNCHERS", "SCRATCH_PREFIX", "check_launch", "launch", "restarted", "with_restarts",
           "with_resume_hint"]
