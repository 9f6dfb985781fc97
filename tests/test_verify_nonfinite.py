"""The checker never passes a wrong run: NaN, Inf, missing tensors and missing steps.

Before, the worst error was kept with `max((err, name), ...)`, which a NaN never
wins, so a parallel run whose numbers were all NaN reported error 0.0 and "OK".
These tests poison a real parallel run inside the workers (the job wraps
`runtime/verify.train_plan`) and check the verdict, and hold each comparison rule
to its definition.
"""

from __future__ import annotations

import math

import pytest
import torch

from fivedc.cli.main import main
from fivedc.errors import VerifyMismatch
from fivedc.frontends.dsl_file import load_model
from fivedc.ir.mesh import Mesh
from fivedc.parallel.check import ModuleRun, compare
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from fivedc.runtime import verify
from fivedc.runtime.compare import (ReferenceNotFinite, Worst, check_reference, compare_runs, loss_error,
                                   relative_error)
from fivedc.runtime.train import TrainRecord, TrainSettings
from fivedc.cli.verify import judge


def test_relative_error_treats_non_finite_values_as_infinite() -> None:
    want = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)
    assert relative_error(want.clone(), want) == 0.0
    assert relative_error(want + 0.3, want) == pytest.approx(0.1)
    for bad in (math.nan, math.inf, -math.inf):
        got = want.clone()
        got[1] = bad
        assert relative_error(got, want) == math.inf
    assert relative_error(torch.full((3,), math.nan, dtype=torch.float64), want) == math.inf
    assert relative_error(want[:2], want) == math.inf  # a shape that differs
    assert loss_error(math.nan, 2.0) == math.inf and loss_error(2.2, 2.0) == pytest.approx(0.1)
    assert Worst().add(math.nan, "x") == Worst(math.inf, "x")
    assert Worst(math.inf, "x").add(1.0, "y").where == "x"


def test_a_non_finite_reference_is_its_own_error() -> None:
    check_reference([1.0, 0.5], [{"w": torch.ones(2)}], what="m")
    with pytest.raises(ReferenceNotFinite, match="loss nan at step 2"):
        check_reference([1.0, math.nan], [], what="m")
    with pytest.raises(ReferenceNotFinite, match="non-finite value in w") as caught:
        check_reference([1.0], [{"w": torch.tensor([1.0, math.inf])}], what="m")
    assert caught.value.exit_code == 2


def _record(loss: float, grad: torch.Tensor, steps: int = 2) -> TrainRecord:
    record = TrainRecord()
    record.losses = [loss] * steps
    record.grads = [{"w": grad.clone()} for _ in range(steps)]
    record.params = {"w": grad.clone()}
    return record


def test_compare_runs_counts_nan_missing_tensors_and_missing_steps() -> None:
    good = torch.tensor([1.0, 2.0], dtype=torch.float64)
    reference = _record(1.5, good)

    def errors(record):
        return compare_runs(record, reference, names=("w",))

    assert {k: e for k, (e, _) in errors(_record(1.5, good)).items()} == {"loss": 0.0, "grad": 0.0, "param": 0.0}
    nan = errors(_record(math.nan, torch.full((2,), math.nan, dtype=torch.float64)))
    assert all(e == math.inf for e, _ in nan.values())
    missing = _record(1.5, good)
    missing.grads[1] = {}
    assert errors(missing)["grad"] == (math.inf, "gradient of w at step 2")
    assert errors(_record(1.5, good, steps=1))["loss"][0] == math.inf


def test_a_gradient_zero_up_to_rounding_is_measured_at_the_models_scale() -> None:
    """A key bias with no rotary after it has gradient zero in exact arithmetic (OPT's: 1e-19 of
    the largest); both runs compute rounding noise there, and AdamW makes that noise a step of its
    own. Its gradient and parameter are measured at the model's largest gradient and parameter,
    so noise passes; a gradient there that is not zero, or a parameter moved by it, still fails."""
    w = torch.tensor([1.0, -2.0], dtype=torch.float64)

    def record(bias_grad: float, bias: float) -> TrainRecord:
        r = TrainRecord()
        r.losses = [1.5]
        r.grads = [{"w": w.clone(), "b": torch.tensor([bias_grad], dtype=torch.float64)}]
        r.params = {"w": w.clone(), "b": torch.tensor([bias], dtype=torch.float64)}
        return r

    reference = record(3e-19, 2e-12)
    noise = compare_runs(record(-4e-19, -1e-12), reference, names=("w", "b"))
    assert noise["grad"][0] < 1e-15 and noise["param"][0] < 1e-11, noise
    # a real gradient where the reference has none, and the step it makes
    assert compare_runs(record(1e-3, 2e-12), reference, names=("w", "b"))["grad"][0] > 1e-4
    assert compare_runs(record(3e-19, 1e-3), reference, names=("w", "b"))["param"][0] > 1e-4
    # a small gradient that is not noise keeps its own scale: 1e-10 of the largest, off by 10 %
    small = record(1e-10, 1.0)
    assert compare_runs(record(1.1e-10, 1.0), small, names=("w", "b"))["grad"][0] == pytest.approx(0.1)


def test_module_compare_counts_nan() -> None:
    w = torch.tensor([1.0, 2.0], dtype=torch.float64)
    reference = ModuleRun([1.0, 0.9], [{"w": w}, {"w": w}], {"w": w})
    assert compare(reference, reference).max_error == 0.0
    poisoned = ModuleRun([math.nan, math.nan], [{"w": w * math.nan}] * 2, {"w": w * math.nan})
    check = compare(reference, poisoned)
    assert check.loss_error == check.grad_error == check.param_error == math.inf
    with pytest.raises(VerifyMismatch) as caught:
        judge(check, 1e-10, what="the parallel module differs from the plain one")
    assert caught.value.exit_code == 1


def nan_rank_job(info, payload):
    """`verify.rank_job` with the parallel run poisoned on rank `payload[-1]`: NaN loss and gradients."""
    *job, poisoned_rank = payload
    real = verify.train_plan

    def poisoned(*args, **kwargs):
        record = real(*args, **kwargs)
        if info.rank == poisoned_rank:
            record.losses = [math.nan for _ in record.losses]
            record.grads = [{n: torch.full_like(g, math.nan) for n, g in step.items()} for step in record.grads]
        return record

    verify.train_plan = poisoned
    try:
        return verify.rank_job(info, tuple(job))
    finally:
        verify.train_plan = real


def test_a_nan_parallel_run_fails_verification(worker_pool, capsys) -> None:
    graph = load_model("examples/gpt.5d")
    plan = compile_graph(graph, CompileOptions(mesh=Mesh.parse("2x1x2x1x1"), dtype="fp64"))
    reference_plan = compile_graph(graph, CompileOptions(mesh=verify.single_device_mesh(), dtype="fp64"))
    settings = TrainSettings(steps=2, dtype="fp64")
    reference = verify.reference_run(reference_plan, settings)
    honest = worker_pool.run(nan_rank_job, world=4, payload=(plan, reference, settings, None, -1))
    assert verify.merge_results(honest, reference).max_error < 1e-10
    results = worker_pool.run(nan_rank_job, world=4, payload=(plan, reference, settings, None, 3))
    report = verify.merge_results(results, reference)
    assert report.grad_error == math.inf and report.max_error == math.inf
    with pytest.raises(VerifyMismatch):
        judge(report, 1e-10, what="the parallel run differs from the single-device run")
    assert "MISMATCH" in capsys.readouterr().out


@pytest.mark.parametrize("tol", ["nan", "-1", "inf"])
def test_a_tolerance_that_is_not_one_is_refused(tol: str, capsys) -> None:
    assert main(["verify", "examples/gpt.5d", "--mesh", "1x1x1x1x1", "--tol", tol]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "is not a tolerance" in err and "Traceback" not in err
