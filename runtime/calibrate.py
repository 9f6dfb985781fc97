"""Measure this machine for the step-time model: a rank's step by kind of work, the links.

`time_rank` runs one rank of a plan as `fivedc run` runs it (`setup_rank`, the
`Trainer`), in this process, in torch's `fake` process group of the plan's world
(collectives return at once and move nothing, so what is timed is the rank's own
work), on the CPU with one thread as `fivedc run`'s workers have, while copies of the
step run beside it on the other cores `fivedc run`'s ranks would keep busy. After a
warm-up step it times a few steps (each kind's least: other work on the machine only
adds): torch's profiler splits forward and backward into matmuls (`aten::mm` and its
kin), attention (the SDPA kernels) and the rest (the memory-bound ops and the runtime's
own host work between ops), and the optimizer's update is timed after them.

`time_links` runs on two local processes joined by gloo (the pool `fivedc run` uses):
an all-reduce of a few bytes gives the latency per algorithm step, one of 16 MiB the
bandwidth, and a matmul run beside an all-reduce what share of the compute the
collective takes meanwhile (`overlap_sm_share`).

`profile_of` turns both into a hardware profile (`profile_text`: `fivedc/ir/hardware.toml`'s
form): each rate is the step-time model's own count of that work
(`fivedc/plan/work_counts.py`) over the seconds it took, and the other ops' terms those for
which the model gives back the measured step, so `fivedc compile --hardware FILE --gpu
NAME` prices with what this machine did.

On a GPU (`device="cuda"`) the same rank runs on CUDA tensors, nothing beside it (one GPU
is one rank): forward and backward, and the optimizer, are timed on the wall clock with
the GPU synchronised (the least of a few steps), and the profiler's CUDA kernel times,
each under the op that launched it, split off the matmuls and the attention; the rest is
the memory-bound kernels and the gaps the host leaves between them. `profile_of` then
keeps the GPU's profile (its data-sheet peaks, its links: one GPU measures no NVLink)
and replaces the shares of the peaks the model prices with: the efficiencies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import resource
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fivedc.errors import FivedcError
from fivedc.ir.hardware import GiB, Hardware
from fivedc.plan.execution_plan import ExecutionPlan
from fivedc.plan.work_counts import compute_seconds, step_work
from fivedc.runtime.pool_worker import RankInfo
from fivedc.runtime.rehearse import quiet_stderr
from fivedc.runtime.train import Trainer, TrainSettings
from fivedc.runtime.verify import setup_rank

MATMUL_OPS = frozenset({"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::addbmm",
                        "aten::_addmm_activation"})
ATTENTION_MARKS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")
PROFILED_STEPS = 2  # on a GPU, after the timed ones: the profiler's steps split off the kernels' times
TIMED_STEPS = 5  # after one warm-up step; the least of these
LINK_BYTES = 16 * 2**20  # the all-reduce whose time gives the bandwidth
SMALL_BYTES = 64  # and the one whose time is all latency


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


@dataclass(frozen=True)
class LinkSeconds:
    """Two local processes over gloo."""

    latency_s: float  # per step of a collective's algorithm
    bytes_per_s: float  # what an all-reduce moves per second per direction
    overlap_share: float  # of a collective's seconds run beside compute, what the compute loses


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


# ---- the links: two local processes --------------------------------------------------------
def time_links(*, timeout_s: float = 300.0) -> LinkSeconds:
    from fivedc.runtime.pool import run_once

    results = run_once(_link_job, world=2, payload=None, timeout_s=timeout_s)
    latency = max(r["latency"] for r in results)
    return LinkSeconds(latency, min(r["bandwidth"] for r in results), max(r["overlap"] for r in results))


def _link_job(info, payload) -> dict:
    """In each of two workers (gloo, one thread): latency, bandwidth, the overlap's cost."""
    small, large = torch.zeros(SMALL_BYTES // 4), torch.zeros(LINK_BYTES // 4)
    latency = _least_seconds(lambda: dist.all_reduce(small), 20) / 2  # a 2-rank ring: 2 steps
    reduce = _least_seconds(lambda: dist.all_reduce(large), 5)
    bandwidth = LINK_BYTES / max(reduce - 2 * latency, 1e-9)  # 2(n-1)/n of the bytes at n = 2
    a = torch.randn(512, 512)
    reps = max(1, round(reduce / _least_seconds(lambda: a @ a, 5)))  # compute about as long as the reduce
    alone = _least_seconds(lambda: [a @ a for _ in range(reps)], 3)

    def both():
        work = dist.all_reduce(large, async_op=True)
        for _ in range(reps):
            a @ a
        work.wait()

    together = _least_seconds(both, 3)
    overlap = (together - max(alone, reduce)) / max(min(alone, reduce), 1e-9)
    return {"latency": latency, "bandwidth": bandwidth, "overlap": min(max(overlap, 0.0), 0.99)}


def _least_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    dist.barrier()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return min(seconds)  # other work on the machine only adds


# ---- the profile -------------------------------------------------------------------------
RATE_RANGE = (1e3, 1e15)  # bytes per second the search for the other ops' rate spans


def profile_of(key: str, plans: tuple[ExecutionPlan, ExecutionPlan], step: tuple[StepSeconds, StepSeconds],
               links: LinkSeconds | None, *, cores: int, source: str, base: Hardware | None = None) -> Hardware:
    """This machine as a hardware profile, from one rank's step of `plans` (a plan, then the same
    at a quarter of its batch) timed by kind of work, and the links. The matmul, attention and
    optimizer rates are the model's count of that work (`work_counts.step_work`) over its
    seconds at the full batch; the other ops' bytes per second and the host's seconds per op
    are those for which the model's forward and backward (its roofline included) take what
    was measured at both batches (`other_ops`). With a `base` profile (a GPU's), its peaks,
    memory and links stay, and the shares of its peaks become what was measured."""
    counts, seconds = step_work(plans[0]), step[0]
    if not seconds.matmul or not counts.matmul_flops:
        raise FivedcError("the calibration step ran no matmul", hint="calibrate on a model with linear layers")
    matmul = counts.matmul_flops / seconds.matmul
    attention = counts.attention_flops / seconds.attention if seconds.attention else matmul
    update = counts.optimizer_bytes / seconds.optimizer if seconds.optimizer and counts.optimizer_bytes else matmul
    if base is not None:
        return _measured_gpu(base, key, source, plans, step, rates=(matmul, attention, update))
    peak = max(matmul, attention)
    rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB  # Linux: KiB
    ram_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB / cores

    def machine(rate: float, latency: float) -> Hardware:
        hbm = max(update, rate)
        return Hardware(key, f"this machine, one core per rank ({source.split()[0]})", bf16_flops=peak,
                        hbm_bytes_per_s=hbm, memory_gib=ram_gib, reserved_gib=min(rss_gib, ram_gib / 2),
                        nvlink_bytes_per_s=links.bytes_per_s, internode_bytes_per_s=links.bytes_per_s,
                        gpus_per_node=cores, matmul_efficiency=matmul / peak, attention_efficiency=attention / peak,
                        memory_efficiency=update / hbm, link_efficiency=1.0, nvlink_latency_s=links.latency_s,
                        internode_latency_s=links.latency_s, overlap_sm_share=links.overlap_share,
                        op_memory_efficiency=rate / hbm, op_latency_s=latency)

    rate, latency = other_ops(plans, (step[0].forward_backward, step[1].forward_backward), machine)
    return machine(rate, latency)


def _measured_gpu(base: Hardware, key: str, source: str, plans, step, *, rates) -> Hardware:
    """The GPU's profile with its efficiencies measured: the matmul, attention and optimizer
    rates over its peaks, the other ops' as `other_ops` solves them (a share above the
    bandwidth, which the model's byte count would need, is held at 1). The matmul rate
    measured is that of the model's own GEMM shapes, their tiles' losses in it: the profile
    drops the tile terms (`sm_count`, `matmul_tiles`), which would count them again."""
    matmul, attention, update = rates

    def machine(rate: float, latency: float) -> Hardware:
        return dataclasses.replace(base, key=key, name=f"{base.name}, measured ({source.split()[0]})",
                                   sm_count=None, matmul_tiles=(),
                                   matmul_efficiency=matmul / base.bf16_flops,
                                   attention_efficiency=attention / base.bf16_flops,
                                   memory_efficiency=min(update / base.hbm_bytes_per_s, 1.0),
                                   op_memory_efficiency=min(rate / base.hbm_bytes_per_s, 1.0), op_latency_s=latency,
                                   host_runs_ahead=True)

    rate, latency = other_ops(plans, (step[0].forward_backward, step[1].forward_backward), machine)
    return machine(rate, latency)


def other_ops(plans, measured: tuple[float, float], machine) -> tuple[float, float]:
    """(bytes per second, seconds per op issued) of the other ops, for which the model's forward
    and backward take the `measured` seconds of both plans: for each time per op the rate
    that gives back the full batch, and of those the time per op that gives back the quarter
    (what does not shrink with the batch is the host's per op). Where the two do not
    separate (noise), no time per op, and the rate for the full batch alone."""
    full, small = plans

    def model(plan, rate: float, latency: float) -> float:
        return compute_seconds(plan, machine(rate, latency))

    def rate_for(latency: float) -> float | None:
        return _root(lambda r: model(full, r, latency) - measured[0])

    def small_excess(latency: float) -> float:  # grows with the time per op (fewer bytes each)
        rate = rate_for(latency)
        return float("inf") if rate is None else model(small, rate, latency) - measured[1]

    most = measured[1] / max(step_work(small).op_issues, 1.0)  # the quarter batch all issue, no work
    if small_excess(0.0) >= 0 or small_excess(most) <= 0:
        return rate_for(0.0) or RATE_RANGE[1], 0.0
    low, high = 0.0, most  # small_excess(low) < 0 throughout: a rate exists there
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if small_excess(middle) < 0 else (low, middle)
    return rate_for(low), low


def _root(f) -> float | None:
    """Where the decreasing `f` crosses zero, by bisection over `RATE_RANGE` in log space; None if it does not."""
    low, high = RATE_RANGE
    if f(low) < 0 or f(high) > 0:
        return None
    for _ in range(60):
        middle = (low * high) ** 0.5
        low, high = (middle, high) if f(middle) > 0 else (low, middle)
    return (low * high) ** 0.5


def profile_text(hw: Hardware, step: tuple[StepSeconds, StepSeconds], links: LinkSeconds | None,
                 source: str) -> str:
    """`hw` in `fivedc/ir/hardware.toml`'s form, with what was measured as comments."""
    measured_links = (f"# links (gloo, 2 local processes): latency {links.latency_s * 1e6:.1f} us, "
                      f"{links.bytes_per_s / 1e9:.3f} GB/s, overlap share {links.overlap_share:.2f}" if links else
                      "# links, memory and peaks: the GPU's data sheet (one GPU measures no link)")
    lines = [f"# measured by {source}",
             *(f"# one rank's step at {label} batch: matmuls {t.matmul:.4f} s, attention {t.attention:.4f} s, "
               f"other ops {t.other:.4f} s, optimizer {t.optimizer:.4f} s"
               for label, t in zip(("the", "a quarter of the"), step)),
             measured_links, f"[{hw.key}]", f'name = "{hw.name}"']
    for field in dataclasses.fields(hw):
        if field.name not in ("key", "name"):
            value = getattr(hw, field.name)
            if value is None or value == ():  # an optional term the profile leaves out
                continue
            if isinstance(value, bool):
                value = str(value).lower()
            elif isinstance(value, tuple):
                value = "[" + ", ".join("[" + ", ".join(map(str, t)) + "]" for t in value) + "]"
            elif not isinstance(value, int):
                value = f"{value:.6g}"
            lines.append(f"{field.name} = {value}")
    return "\n".join(lines) + "\n"
