"""`fivedc rehearse --device cpu --calibrate`: a profile measured on this machine.

The model's counts of a step's work (`fivedc/plan/work_counts.py`) are checked against
what a layout must do to them; a profile made from measured seconds gives those seconds
back; the command writes a profile `fivedc compile --hardware` reads, and refuses what it
cannot measure; and the structure of the step-time model (the split of work over ranks,
a pipeline's bubble) holds against `fivedc run` on this machine, within a bound loose
enough for a loaded CI machine (`benchmarks/cpu_step_time.py` has the 20 % table).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from fivedc.cli.main import main
from fivedc.cli.shared import with_shape
from fivedc.errors import FivedcError
from fivedc.frontends.dsl_file import load_model
from fivedc.ir.hardware import hardware
from fivedc.ir.mesh import Mesh
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from fivedc.plan.work_counts import compute_seconds, own_work_seconds, step_work
from fivedc.runtime.calibrate import StepSeconds
from fivedc.runtime.calibrate_links import LinkSeconds
from fivedc.runtime.calibrate_profile import profile_of, profile_text
from fivedc.runtime.run import run_plan
from fivedc.runtime.train import TrainSettings

MODEL = "examples/tiny_llama.5d"
FLAT = dict(sm_count=None, matmul_tiles=())  # a machine whose matmuls run at one rate, as a calibration measures it


def _plan(mesh: str, model: str = MODEL, batch: int | None = None, **options):
    graph = with_shape(load_model(model), batch=batch, seq=None)
    return compile_graph(graph, CompileOptions(mesh=Mesh.parse(mesh), dtype="fp32", **options))


def test_the_counts_split_as_the_layout_splits_the_work() -> None:
    one = step_work(_plan("1x1x1x1x1"))
    assert one.matmul_flops > 0 and one.attention_flops > 0 and one.op_bytes > 0 and one.optimizer_bytes > 0
    dp = step_work(_plan("2x1x1x1x1"))  # half the batch each, every parameter
    assert dp.matmul_flops == pytest.approx(one.matmul_flops / 2)
    assert dp.attention_flops == pytest.approx(one.attention_flops / 2)
    assert dp.optimizer_bytes == pytest.approx(one.optimizer_bytes)
    zero = step_work(_plan("2x1x1x1x1", zero=1))  # each rank updates half the parameters
    assert zero.optimizer_bytes == pytest.approx(one.optimizer_bytes / 2, rel=0.05)
    full = step_work(_plan("1x1x1x1x1", recompute="full"))  # the forward again in backward
    assert full.matmul_flops == pytest.approx(one.matmul_flops * 4 / 3, rel=0.05)


def test_a_pipeline_cannot_be_calibrated() -> None:
    with pytest.raises(FivedcError, match="pp=1"):
        step_work(_plan("1x2x1x1x1", schedule="1f1b", microbatches=2))


def test_a_calibrated_profile_gives_back_the_seconds_it_was_measured_from(tmp_path) -> None:
    """Seconds 'measured' on a known machine (the model's own, on it) calibrate a profile that
    prices both batches as that machine does, and finds its per-op latency."""
    plans = (_plan("1x1x1x1x1"), _plan("1x1x1x1x1", batch=1))
    truth = dataclasses.replace(hardware("a100"), op_latency_s=2e-4, op_memory_efficiency=0.3, **FLAT)
    measured = tuple(_seconds_on(plan, truth) for plan in plans)
    links = LinkSeconds(latency_s=1e-4, bytes_per_s=1e9, overlap_share=0.9)
    hw = profile_of("box", plans, measured, links, cores=2, source="a test")
    assert hw.op_latency_s == pytest.approx(truth.op_latency_s, rel=1e-3)
    for plan in plans:
        assert compute_seconds(plan, hw) == pytest.approx(compute_seconds(plan, truth), rel=1e-4)
    path = tmp_path / "box.toml"
    path.write_text(profile_text(hw, measured, links, "a test"))
    read = hardware("box", (path,))
    assert (read.nvlink_latency_s, read.nvlink_bytes_per_s, read.overlap_sm_share) == pytest.approx((1e-4, 1e9, 0.9))
    assert read.op_latency_s == pytest.approx(hw.op_latency_s, rel=1e-5)


def test_a_gpu_keeps_its_data_sheet_and_gets_its_measured_efficiencies() -> None:
    """On a GPU the profile is the GPU's (peaks, memory, links) with the shares of its peaks
    that the measured step gives: a GPU that runs at known shares is found at them."""
    plans = (_plan("1x1x1x1x1"), _plan("1x1x1x1x1", batch=1))
    # a slow GPU, so that the tiny model's ops are not all shorter than their issue
    base = dataclasses.replace(hardware("h100"), bf16_flops=1e9, hbm_bytes_per_s=1e8, **FLAT)
    truth = dataclasses.replace(base, matmul_efficiency=0.6, attention_efficiency=0.3, memory_efficiency=0.7,
                                op_memory_efficiency=0.4, op_latency_s=3e-5, host_runs_ahead=True)
    measured = tuple(_seconds_on(plan, truth) for plan in plans)
    hw = profile_of("h100_here", plans, measured, None, cores=1, source="2026-11-28 a test", base=base)
    assert (hw.bf16_flops, hw.nvlink_bytes_per_s, hw.memory_gib) == (base.bf16_flops, base.nvlink_bytes_per_s,
                                                                     base.memory_gib)
    for field in ("matmul_efficiency", "attention_efficiency", "memory_efficiency", "op_memory_efficiency",
                  "op_latency_s"):
        assert getattr(hw, field) == pytest.approx(getattr(truth, field), rel=1e-3), field
    assert "one GPU measures no link" in profile_text(hw, measured, None, "a test")


def test_cuda_without_a_gpu_is_refused_before_anything_runs(capsys, monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["rehearse", MODEL, "--mesh", "1x1x1x1x1", "--device", "cuda"]) == 2
    assert "no GPU that torch can use" in " ".join(capsys.readouterr().err.split())


def _seconds_on(plan, hw) -> StepSeconds:
    """A step as the model prices it on `hw`, by kind of work."""
    work = step_work(plan)
    matmul = work.matmul_flops / (hw.bf16_flops * hw.matmul_efficiency)
    attention = work.attention_flops / (hw.bf16_flops * hw.attention_efficiency)
    other = compute_seconds(plan, hw) - matmul - attention
    return StepSeconds(matmul, attention, other, work.optimizer_bytes / (hw.hbm_bytes_per_s * hw.memory_efficiency))


def test_the_command_writes_a_profile_compile_prices_with(tmp_path, capsys) -> None:
    profile = tmp_path / "laptop.toml"
    assert main(["rehearse", MODEL, "--mesh", "1x1x1x1x1", "--dtype", "fp32", "--device", "cpu",
                 "--calibrate", str(profile)]) == 0
    out = capsys.readouterr().out
    assert "one step's seconds by kind of work" in out and f"wrote {profile}" in out
    hw = hardware("laptop", (profile,))
    assert hw.bf16_flops > 1e8 and 0 < hw.op_memory_efficiency <= 1 and hw.nvlink_latency_s > 0
    assert main(["compile", MODEL, "--mesh", "2x1x1x1x1", "--dtype", "fp32", "--hardware", str(profile),
                 "--gpu", "laptop", "-o", str(tmp_path / "p.plan.json")]) == 0
    assert "Step time on this machine" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (["--calibrate", "x.toml"], "add --device cpu"),
    (["--device", "cpu", "--calibrate", "x.json"], "a profile is a .toml file"),
    (["--device", "cpu", "--calibrate", "x.toml", "--mesh", "1x2x1x1x1", "--microbatches", "2"], "pp=1"),
])
def test_what_cannot_be_calibrated_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys, flags,
                                                                   message) -> None:
    monkeypatch.chdir(tmp_path)
    args = ["rehearse", f"{_root()}/{MODEL}", "--dtype", "fp32", *flags]
    if "--mesh" not in flags:
        args += ["--mesh", "1x1x1x1x1"]
    assert main(args) == 2
    assert message in " ".join(capsys.readouterr().err.split())  # wrapped to 100 columns
    assert not (tmp_path / "x.toml").exists()


def _root() -> str:
    return str(Path(__file__).resolve().parent.parent)


def test_the_step_time_model_holds_against_fivedc_run_on_this_machine(tmp_path) -> None:
    """Calibrated on one rank, the model's step for two-rank layouts (data, tensor and pipeline
    parallel) against `fivedc run`'s: within 2x each (a loaded CI machine), and within 1.5x of
    each other (the load scales every layout alike; a structure gone wrong does not)."""
    profile, model = tmp_path / "here.toml", tmp_path / "small.5d"
    text = (Path(_root()) / "benchmarks" / "cpu_step.5d").read_text()
    model.write_text(text.replace("batch = 8", "batch = 4"))  # half the bench model's batch: half the time
    assert main(["rehearse", str(model), "--mesh", "1x1x1x1x1", "--dtype", "fp32", "--device", "cpu",
                 "--calibrate", str(profile)]) == 0
    ratios = []
    for layout in ({"mesh": "2x1x1x1x1"}, {"mesh": "1x1x2x1x1"},
                   {"mesh": "1x2x1x1x1", "schedule": "1f1b", "microbatches": 4}):
        options = dict(layout, mesh=Mesh.parse(layout["mesh"]), hardware=hardware("here", (profile,)))
        plan = compile_graph(load_model(str(model)), CompileOptions(dtype="fp32", **options))
        ratios.append(plan.time.step_seconds / _least_step(plan, unless=plan.time.step_seconds))
    assert all(0.5 <= r <= 2.0 for r in ratios), ratios
    assert max(ratios) / min(ratios) <= 1.5, ratios


def _least_step(plan, *, unless: float, tries: int = 3) -> float:
    """The least step of a short `fivedc run` (after the first); other work on the machine only adds
    to a step (and more to a two-rank one on two cores), so a run half again slower than `unless`
    predicts is run again, up to `tries` in all."""
    least = float("inf")
    for _ in range(tries):
        report = run_plan(plan, TrainSettings(steps=4, dtype="fp32", keep_grads=False))
        least = min(least, *report.seconds[1:])
        if least <= 1.5 * unless:
            break
    return least


def test_own_work_is_the_step_without_its_collectives_and_idle_time() -> None:
    hw = hardware("a100")
    one = _plan("1x1x1x1x1", hardware=hw)  # nothing to sum, no schedule: all of the step is its own
    assert own_work_seconds(one, hw) == pytest.approx(one.time.step_seconds)
    dp = _plan("2x1x1x1x1", hardware=hw, overlap=False)  # the sum after backward: its copies are own work
    assert dp.time.compute_seconds + dp.time.optimizer_seconds < own_work_seconds(dp, hw) < dp.time.step_seconds
    pp = _plan("1x2x1x1x1", hardware=hw, schedule="gpipe", microbatches=2)  # gpipe's idle share is not work
    assert own_work_seconds(pp, hw) < pp.time.step_seconds


@pytest.mark.parametrize("name, key", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                       ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA GeForce RTX 4090", None)])
def test_a_gpus_profile_is_the_built_in_one_its_name_holds(monkeypatch, name, key) -> None:
    import torch

    from fivedc.cli.rehearse import _profile_of_this_gpu

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    if key is None:
        with pytest.raises(FivedcError, match="no built-in profile is this GPU"):
            _profile_of_this_gpu()
    else:
        assert _profile_of_this_gpu() == key
