"""Measure this machine for the step-time model: one rank's step, by kind of work.

`time_rank` runs one rank of a plan as `fivedc run` runs it (`setup_rank`, the
`Trainer`), in this process, in torch's `fake` process group of the plan's world
(collectives return at once and move nothing, so what is timed is the rank's own
work), on the CPU with one thread as `fivedc run`'s workers have, while copies of the
step run beside it on the other cores `fivedc run`'s ranks would keep busy. After a
warm-up step it times a few steps (each kind's least: other work on the machine only
adds): torch's profiler splits forward and backward into matmuls (`aten::mm` and its
kin), attention (the SDPA kernels) and the rest (the memory-bound ops and the runtime's
own host work between ops), and the optimizer's update is timed after them.

On a GPU (`device="cuda"`) the same rank runs on CUDA tensors, nothing beside it (one GPU
is one rank): forward and backward, and the optimizer, are timed on the wall clock with
the GPU synchronised (the least of a few steps), and the profiler's CUDA kernel times,
each under the op that launched it, split off the matmuls and the attention; the rest is
the memory-bound kernels and the gaps the host leaves between them. `profile_of` then
keeps the GPU's profile (its data-sheet peaks, its links: one GPU measures no NVLink)
and replaces the shares of the peaks the model prices with: the efficiencies.

The links are measured by `runtime/calibrate_links.py`, and both turned into a profile by
`runtime/calibrate_profile.py`.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fivedc.errors import FivedcError
from fivedc.plan.execution_plan import ExecutionPlan
from fivedc.runtime.pool_worker import RankInfo
from fivedc.runtime.rehearse import quiet_stderr
from fivedc.runtime.train import Trainer, TrainSettings
from fivedc.runtime.verify import setup_rank

MATMUL_OPS = frozenset({"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::addbmm",
                        "aten::_addmm_activation"})
ATTENTION_MARKS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")
PROFILED_STEPS = 2  # on a GPU, after the timed ones: the profiler's steps split off the kernels' times
TIMED_STEPS = 5  # after one warm-up step; the least of these


@dataclass(frozen=True)
class StepSeconds:
    """One rank's step on this machine, by kind of work (seconds, the least of a few steps)."""

    matmul: float
    attention: float
    other: float  # forward and backward's memory-bound ops and the host's work between ops
    optimizer: float

    @property
    def forward_backward(self) -> float:
        return self.matmul + self.attention + self.other


def time_rank(plan: ExecutionPlan, rank: int = 0, *, beside: int = 0, device: str = "cpu") -> StepSeconds:
    """Rank `rank`'s step, timed on `device` (cpu or cuda) in a fake process group of the plan's
    world; on the CPU while `beside` other processes run the same step (`fivedc run`'s ranks
    share the machine: its memory bandwidth, caches, and cores that may be two threads of one)."""
    if device == "cuda":
        with _fake_group(plan, rank, device), quiet_stderr():
            return _timed_steps_cuda(plan, rank)
    with _busy_copies(plan, rank, beside), _fake_group(plan, rank):
        with quiet_stderr():  # the profiler's start and stop lines
            return _timed_steps(plan, rank)


@contextlib.contextmanager
def _fake_group(plan: ExecutionPlan, rank: int, device: str = "cpu"):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise FivedcError("a calibration joins a fake process group of its own; this process is in one already")
    backends = "cpu:fake,cuda:fake" if device == "cuda" else "cpu:fake"
    dist.init_process_group(backends, store=FakeStore(), rank=rank, world_size=plan.mesh.world)
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)  # as each of fivedc run's workers
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        with quiet_stderr():  # c10d warns that the group's undefined device type has no hooks: it has none
            dist.destroy_process_group()


@contextlib.contextmanager
def _busy_copies(plan: ExecutionPlan, rank: int, count: int, timeout_s: float = 600.0):
    """`count` processes stepping rank `rank`'s program from when they are all warm until the end."""
    if count < 1:
        yield
        return
    context = multiprocessing.get_context("spawn")
    ready, stop = context.Queue(), context.Event()
    copies = [context.Process(target=_step_until, args=(plan, rank, ready, stop), daemon=True) for _ in range(count)]
    for copy in copies:
        copy.start()
    try:
        _await_warm(copies, ready, timeout_s)
        yield
    finally:
        stop.set()
        for copy in copies:
            copy.join(timeout=60)
            if copy.is_alive():
                copy.terminate()


def _await_warm(copies: list, ready, timeout_s: float) -> None:
    """Until every copy has said it is warm; a copy that exits first is an error, not a wait."""
    import queue

    warm, deadline = 0, time.monotonic() + timeout_s
    while warm < len(copies):
        try:
            ready.get(timeout=1.0)
            warm += 1
        except queue.Empty:
            dead = [c.exitcode for c in copies if c.exitcode is not None]
            if dead or time.monotonic() > deadline:
                what = f"exited with code {dead[0]}" if dead else f"was not warm after {timeout_s:.0f} s"
                raise FivedcError(f"a copy of the timed step {what} before the timing began",
                                  hint="run the plan with fivedc run to see its error")


def _step_until(plan: ExecutionPlan, rank: int, ready, stop) -> None:
    """In a copy: warm up, say so, then step until told to stop."""
    with _fake_group(plan, rank):
        trainer, inputs = _trainer(plan, rank)
        _step(trainer, inputs, profile=False)
        ready.put(os.getpid())
        while not stop.is_set():
            _step(trainer, inputs, profile=False)


def _trainer(plan: ExecutionPlan, rank: int, device: str = "cpu") -> tuple[Trainer, dict]:
    settings = TrainSettings(steps=1, dtype=plan.dtype, keep_grads=False)
    program, params, inputs, _ = setup_rank(plan, RankInfo(rank, plan.mesh.world, device), settings)
    return Trainer(program, params, settings, zero=plan.zero, buckets=plan.buckets, overlap=plan.overlap,
                   pipeline=plan.pipeline), inputs


def _timed_steps(plan: ExecutionPlan, rank: int) -> StepSeconds:
    trainer, inputs = _trainer(plan, rank)
    steps = [_step(trainer, inputs) for _ in range(TIMED_STEPS + 1)][1:]
    return StepSeconds(*(min(s[k] for s in steps) for k in range(4)))  # noise only adds


def _step(trainer: Trainer, inputs: dict, *, profile: bool = True) -> tuple[float, float, float, float]:
    """(matmuls, attention, the rest of forward and backward, optimizer) seconds of one step."""
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile else None
    with profiler or contextlib.nullcontext():
        start = time.perf_counter()
        trainer.forward_backward(inputs)
        middle = time.perf_counter()
    trainer.optimizer.step()
    trainer.end_step()
    optimizer = time.perf_counter() - middle
    matmul, attention = _kernel_seconds(profiler.events()) if profiler else (0.0, 0.0)
    return matmul, attention, max(0.0, middle - start - matmul - attention), optimizer


def _timed_steps_cuda(plan: ExecutionPlan, rank: int) -> StepSeconds:
    """On a GPU: forward and backward, and the optimizer, on the wall clock (synchronised; the
    least of a few steps, unprofiled: the profiler slows the host), then the matmul and
    attention kernels' seconds from profiled steps; the rest of the wall is the other ops."""
    trainer, inputs = _trainer(plan, rank, "cuda")
    walls = [_step_cuda(trainer, inputs) for _ in range(TIMED_STEPS + 1)][1:]
    kernels = [_step_cuda(trainer, inputs, profile=True) for _ in range(PROFILED_STEPS)]
    forward_backward, optimizer = (min(w[k] for w in walls) for k in range(2))
    matmul, attention = (min(k[i] for k in kernels) for i in range(2))
    return StepSeconds(matmul, attention, max(0.0, forward_backward - matmul - attention), optimizer)


def _step_cuda(trainer: Trainer, inputs: dict, *, profile: bool = False) -> tuple[float, float]:
    """(forward and backward, optimizer) seconds on the wall clock; with `profile`, (matmul,
    attention) kernel seconds instead."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    profiler = torch.profiler.profile(activities=activities) if profile else None
    torch.cuda.synchronize()
    with profiler or contextlib.nullcontext():
        start = time.perf_counter()
        trainer.forward_backward(inputs)
        torch.cuda.synchronize()
        middle = time.perf_counter()
    trainer.optimizer.step()
    trainer.end_step()
    torch.cuda.synchronize()
    if profiler is not None:
        return _kernel_seconds(profiler.events(), device=True)
    return middle - start, time.perf_counter() - middle


def _kernel_seconds(events, *, device: bool = False) -> tuple[float, float]:
    """Seconds in matmul kernels and in attention kernels (each op's own time, not its callees'):
    on the CPU the ops' own time, on a GPU the kernels each op launched."""
    matmul = attention = 0.0
    for event in events:
        seconds = _self_device_us(event) if device else event.self_cpu_time_total
        if event.name in MATMUL_OPS:
            matmul += seconds
        elif any(mark in event.name for mark in ATTENTION_MARKS):
            attention += seconds
    return matmul * 1e-6, attention * 1e-6


def _self_device_us(event) -> float:
    """An op's own kernels' microseconds (torch renamed `self_cuda_time_total` in 2.4)."""
    value = getattr(event, "self_device_time_total", None)
    return value if value is not None else event.self_cuda_time_total
