"""Checkpoints: what they hold, atomic commits, pruning, exact resume, and resume on another layout.

In float64: training 4 steps equals training 2, saving, resuming and training 2 on
the same layout, bitwise (parameters, both AdamW moments, losses); on another mesh
or options (dp2·tp2 -> tp4, pp2 -> pp1, ZeRO-3 -> ZeRO-1, ep2 -> ep1, cp2 -> cp1)
the resumed run ends within 1e-12 of four steps on one device. Crashes are
simulated in-process at two points of a save; loading is run with pickle disabled.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path

import pytest
import torch

from fivedc.errors import FivedcError
from fivedc.runtime import checkpoint as ckpt
from fivedc.runtime.checkpoint import committed, find_checkpoint, prune, read_index
from fivedc.runtime.reshard import consolidate
from fivedc.runtime.train_loop import train_job
from train_helpers import job_for, make_tokens, one_device, plan_of

TOL = 1e-12
CONFIG = dict(steps=4, lr=1e-2, save_every=2, keep=5, clip=0.5, seed=1)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[str, str]:
    return make_tokens(tmp_path_factory.mktemp("tokens"))


def saved(folder: Path, kind: str = "param") -> dict[str, torch.Tensor]:
    return consolidate(folder, read_index(folder), kind=kind)


def run(pool, job) -> list[dict]:
    return pool.run(train_job, world=job.plan.mesh.world, payload=job)[0]["rows"]


@pytest.fixture(scope="module")
def straight(worker_pool, data, tmp_path_factory) -> tuple:
    """Four steps on dp2·pp2 with ZeRO-3, saving at steps 2 and 4: (job, rows, save dir)."""
    root = tmp_path_factory.mktemp("straight")
    job = dataclasses.replace(job_for(plan_of("tiny_llama", "2x2x1x1x1", zero=3), data, **CONFIG), save_dir=str(root))
    return job, run(worker_pool, job), root


def test_resume_continues_exactly(worker_pool, straight, tmp_path) -> None:
    job, rows, root = straight
    resumed = dataclasses.replace(job, resume=str(root / "step-00000002"), save_dir=str(tmp_path))
    again = run(worker_pool, resumed)
    assert [r["step"] for r in again] == [3, 4] and [r["loss"] for r in again] == [r["loss"] for r in rows[2:]]
    for kind in ("param", "exp_avg", "exp_avg_sq"):
        want, got = saved(root / "step-00000004", kind), saved(tmp_path / "step-00000004", kind)
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), kind


def test_index_records_layout_step_data_and_optimizer(straight) -> None:
    job, rows, root = straight
    index = json.loads((root / "step-00000004" / "index.json").read_text())
    assert (index["step"], index["world"], index["plan"]["mesh"], index["plan"]["zero"]) == (4, 4, "2x2x1x1x1", 3)
    assert index["val_loss"] == rows[-1]["val_loss"] and index["optimizer"]["steps_taken"] == 4
    assert index["data"]["tokens_seen"] == 4 * 4 * 8 and index["data"]["step"] == 4 and index["config"]["seed"] == 1
    wq = index["tensors"]["exp_avg/layers.0.wq"]  # a pp rank's parameter, ZeRO-3 chunks over dp
    assert wq["shape"] == [32, 4, 8] and wq["dims"] == ["hidden", "heads", "head_dim"]
    assert sorted(p["flat"][0] for p in wq["pieces"]) == [0, 512] and len({p["file"] for p in wq["pieces"]}) == 2
    assert len(list((root / "step-00000004").glob("rank-*.safetensors"))) == 4
    best = min((r for r in rows if "val_loss" in r), key=lambda r: r["val_loss"])
    assert index["best"] == {"step": best["step"], "val_loss": best["val_loss"]}
    from safetensors.torch import load_file

    model = load_file(root / "best_model.safetensors")  # consolidated: the best step's parameters
    want = saved(root / f"step-{best['step']:08d}")
    assert model.keys() == want.keys() and all(torch.equal(model[k], want[k]) for k in want)


PAIRS = [
    ("gpt", ("2x1x2x1x1", {"sequence_parallel": True}), ("1x1x4x1x1", {})),  # dp2·tp2 -> tp4
    ("tiny_llama", ("1x2x1x1x1", {}), ("1x1x1x1x1", {})),  # pp2 -> pp1
    ("tiny_llama", ("2x1x1x1x1", {"zero": 3}), ("2x1x1x1x1", {"zero": 1})),  # ZeRO-3 -> ZeRO-1
    ("moe", ("1x1x1x1x2", {}), ("1x1x1x1x1", {})),  # ep2 -> ep1
    ("gpt", ("1x1x1x2x1", {}), ("1x1x1x1x1", {})),  # cp2 -> cp1 (the position table in the balanced layout)
]
_REFERENCES: dict[str, Path] = {}


@pytest.mark.parametrize("model,before,after", PAIRS, ids=[f"{b[0]}->{a[0]}" for _, b, a in PAIRS])
def test_resume_on_another_layout_matches_one_device(worker_pool, data, tmp_path_factory, model, before, after) -> None:
    if model not in _REFERENCES:  # four steps on one device, once per model
        root = tmp_path_factory.mktemp(f"one-{model}")
        one_device(dataclasses.replace(job_for(plan_of(model, "1x1x1x1x1"), data, **CONFIG), save_dir=str(root)))
        _REFERENCES[model] = root / "step-00000004"
    first, second = tmp_path_factory.mktemp("first"), tmp_path_factory.mktemp("second")
    job = job_for(plan_of(model, before[0], **before[1]), data, **CONFIG)
    run(worker_pool, dataclasses.replace(job, save_dir=str(first), until=2))
    job = job_for(plan_of(model, after[0], **after[1]), data, **CONFIG)
    run(worker_pool, dataclasses.replace(job, save_dir=str(second), resume=str(find_checkpoint(first))))
    for kind in ("param", "exp_avg", "exp_avg_sq"):  # every state AdamW resumes from
        want, got = saved(_REFERENCES[model], kind), saved(second / "step-00000004", kind)
        assert want.keys() == got.keys() and want, kind
        for name in want:
            assert (got[name] - want[name]).abs().max() <= TOL * want[name].abs().max(), (kind, name)


def test_prune_keeps_the_last_and_the_best(tmp_path) -> None:
    for step in range(1, 6):
        (tmp_path / f"step-{step:08d}").mkdir()
        (tmp_path / f"step-{step:08d}" / "index.json").write_text("{}")
    (tmp_path / "step-00000009").mkdir()  # never committed: no index
    (tmp_path / ".tmp-step-00000006").mkdir()
    assert prune(tmp_path, keep=2, best_step=1) == [2, 3]
    assert [s for s, _ in committed(tmp_path)] == [1, 4, 5] and not (tmp_path / ".tmp-step-00000006").exists()
    assert find_checkpoint(tmp_path) == tmp_path / "step-00000005"


def _fail(*args, **kwargs):
    raise OSError("disk full")


@pytest.mark.parametrize("where", ["rank file", "rename"])
def test_a_crash_mid_save_leaves_the_previous_checkpoint(data, tmp_path, monkeypatch, where: str) -> None:
    """Steps 1-2 saved; the save of step 4 dies (writing a rank's file, or just before the
    rename): step 2 stays the latest committed checkpoint, and resuming from it ends
    exactly where an uninterrupted run ends."""
    job = dataclasses.replace(job_for(plan_of("tiny_llama", "1x1x1x1x1"), data, **CONFIG), save_dir=str(tmp_path / "a"))
    whole = one_device(dataclasses.replace(job, save_dir=str(tmp_path / "b")))
    import safetensors.torch

    real, real_commit = safetensors.torch.save_file, ckpt._commit
    with monkeypatch.context() as patch:
        if where == "rank file":
            patch.setattr(safetensors.torch, "save_file", lambda t, path, **k: (real(t, path, **k), _fail())
                          if "step-00000004" in str(path) else real(t, path, **k))
        else:
            patch.setattr(ckpt, "_commit", lambda tmp, final: _fail() if final.name.endswith("4") else
                          real_commit(tmp, final))
        with pytest.raises(OSError, match="disk full"):
            one_device(job)
    assert find_checkpoint(tmp_path / "a") == tmp_path / "a" / "step-00000002"
    assert (tmp_path / "a" / ".tmp-step-00000004").exists()  # what the crash left: never read
    rows = one_device(dataclasses.replace(job, resume=str(find_checkpoint(tmp_path / "a"))))
    assert [r["loss"] for r in rows] == [r["loss"] for r in whole[2:]]


def test_loading_a_checkpoint_never_unpickles(data, tmp_path, monkeypatch) -> None:
    job = dataclasses.replace(job_for(plan_of("tiny_llama", "1x1x1x1x1"), data, **CONFIG), save_dir=str(tmp_path),
                              until=2)
    one_device(job)
    for module, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(module, name, _fail)
    rows = one_device(dataclasses.replace(job, resume=str(tmp_path / "step-00000002"), until=None))
    assert [r["step"] for r in rows] == [3, 4]


def test_another_models_checkpoint_is_refused(data, tmp_path) -> None:
    one_device(dataclasses.replace(job_for(plan_of("gpt", "1x1x1x1x1"), data, **CONFIG), save_dir=str(tmp_path),
                                   until=2))
    job = dataclasses.replace(job_for(plan_of("tiny_llama", "1x1x1x1x1"), data, **CONFIG),
                              resume=str(tmp_path / "step-00000002"))
    with pytest.raises(FivedcError, match="is of another model than tiny_llama: it lacks"):
        one_device(job)


def test_moe_balancing_biases_are_saved_and_restored(worker_pool, data, tmp_path) -> None:
    """DeepSeek-V3's balancing bias is state outside the parameters: saved once (ep2), read
    back on one device; without it the routing, so the loss, would differ."""
    from fivedc.frontends.dsl_file import parse_model
    from fivedc.ir.mesh import Mesh
    from fivedc.passes.base import CompileOptions
    from fivedc.pipeline import compile_graph
    from train_helpers import ROOT

    text = (ROOT / "examples" / "moe.5d").read_text().replace("aux_loss=0.01", "aux_loss=0.01, bias_update=0.05")
    plans = [compile_graph(parse_model(text), CompileOptions(mesh=Mesh.parse(m), dtype="fp64"))
             for m in ("1x1x1x1x2", "1x1x1x1x1")]
    job = dataclasses.replace(job_for(plans[0], data, **CONFIG), save_dir=str(tmp_path / "a"), until=2)
    run(worker_pool, job)
    assert "moe_bias/layers.0.r" in read_index(tmp_path / "a" / "step-00000002")["tensors"]
    whole = one_device(dataclasses.replace(job, plan=plans[1], save_dir=None, until=None))
    rows = one_device(dataclasses.replace(job, plan=plans[1], save_dir=None, until=None,
                                          resume=str(tmp_path / "a" / "step-00000002")))
    for got, want in zip(rows, whole[2:], strict=True):
        assert abs(got["loss"] - want["loss"]) <= TOL * abs(want["loss"])


def test_a_checkpoints_balancing_biases_are_held_to_the_models() -> None:
    """A checkpoint is untrusted: a balancing bias no balancing MoE layer has, or of another
    number of experts, is refused by name before anything is read."""
    from fivedc.errors import FivedcError
    from fivedc.frontends.dsl_file import parse_model
    from fivedc.ir.mesh import Mesh
    from fivedc.passes.base import CompileOptions
    from fivedc.pipeline import compile_graph
    from fivedc.runtime.program import qualified_params
    from fivedc.runtime.resume import check_same_model
    from train_helpers import ROOT

    text = (ROOT / "examples" / "moe.5d").read_text().replace("aux_loss=0.01", "aux_loss=0.01, bias_update=0.05")
    plan = compile_graph(parse_model(text), CompileOptions(mesh=Mesh.parse("1x1x1x1x1"), dtype="fp64"))
    graph = plan.graph
    params = {f"param/{n}": {"shape": [graph.dim(d) for d in p.dims]} for n, p in qualified_params(graph)}
    experts = next(graph.dim(p.dims[1]) for n, p in qualified_params(graph) if n == "layers.0.router")
    check_same_model({"tensors": {**params, "moe_bias/layers.0.r": {"shape": [experts]}}}, plan, where="ck")
    for name, shape in (("layers.0.r", [experts + 1]), ("layers.0.nowhere", [experts])):
        with pytest.raises(FivedcError, match=f"balancing bias {name}"):
            check_same_model({"tensors": {**params, f"moe_bias/{name}": {"shape": shape}}}, plan, where="ck")
