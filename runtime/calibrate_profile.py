"""A hardware profile from what was measured: one rank's step by kind of work, and the links.

`profile_of` turns both into a hardware profile (`profile_text`: `fivedc/ir/hardware.toml`'s
form): each rate is the step-time model's own count of that work
(`fivedc/plan/work_counts.py`) over the seconds it took, and the other ops' terms those for
which the model gives back the measured step, so `fivedc compile --hardware FILE --gpu
NAME` prices with what this machine did.

The step is timed by `runtime/calibrate.py`, the links by `runtime/calibrate_links.py`;
on a GPU `profile_of` keeps the GPU's profile and replaces its efficiencies.
"""

from __future__ import annotations

import dataclasses
import os
import resource

from fivedc.errors import FivedcError
from fivedc.ir.hardware import GiB, Hardware
from fivedc.plan.execution_plan import ExecutionPlan
from fivedc.plan.work_counts import compute_seconds, step_work
from fivedc.runtime.calibrate import StepSeconds
from fivedc.runtime.calibrate_links import LinkSeconds

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
