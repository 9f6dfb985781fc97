"""A plan or model from someone else is safe to open, and the work it asks for is bounded (issue 40).

A plan names ATen operators, sizes and a model file: `fivedc check` and `fivedc run` must
refuse an operator outside the frontend's allow-list before calling anything, compare the
plan's model with its source where the source is there, refuse sizes no real model has
in seconds, and treat a model file that exits as bad input.
"""

from __future__ import annotations

import copy
import hashlib
import json
import time
from pathlib import Path

import pytest
import torch

from fivedc.cli.main import main
from fivedc.ir.aten_allow import check_allowed
from fivedc.ir.aten_call import AtenCallError, resolve
from fivedc.ir.graph import Op, walk_ops

GPT = "examples/gpt.5d"


# ---- a model file that exits, a fault with no op ---------------------------------------------
def test_a_model_file_that_exits_at_import_is_a_located_error(tmp_path, capsys) -> None:
    model = tmp_path / "quits.py"
    model.write_text("import sys\n\nsys.exit(3)\n")
    out = tmp_path / "quits.plan.json"
    assert main(["compile", f"{model}:factory", "--mesh", "1x1x1x1x1", "-q", "-o", str(out)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{model}:3:1: error" in err and "exited during import" in err and "SystemExit(3)" in err
    assert "Traceback" not in err and not out.exists()


def test_a_factory_that_exits_is_a_located_error(tmp_path, capsys) -> None:
    model = tmp_path / "quits_later.py"
    model.write_text("def factory():\n    raise SystemExit('bye')\n")
    assert main(["compile", f"{model}:factory", "--mesh", "1x1x1x1x1", "-q", "-o", str(tmp_path / "p.json")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{model}:2:5: error" in err and "factory() exited" in err and "SystemExit('bye')" in err


def test_an_empty_fault_is_refused_with_the_ops_hint(capsys) -> None:
    assert main(["verify", GPT, "--mesh", "1x1x1x1x1", "--inject-fault", ""]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "names no op" in err and "fivedc show PLAN --ops" in err
    assert main(["verify", GPT, "--mesh", "1x1x1x1x1", "--inject-fault", "@0"]) == 2
    assert "names no op" in " ".join(capsys.readouterr().err.split())


# ---- an allow-list of operators ---------------------------------------------------------------
def _aten_ops(data):
    """The `aten` op objects of a plan's JSON."""
    found = []

    def walk(obj):
        if isinstance(obj, dict):
            if obj.get("kind") == "aten":
                found.append(obj)
            for value in obj.values():
                walk(value)
        elif isinstance(obj, list):
            for value in obj:
                walk(value)

    walk(data["graph"])
    return found


def _set_attr(op: dict, key: str, value) -> None:
    op["attrs"] = [[k, value if k == key else v] for k, v in op["attrs"]]


@pytest.fixture(scope="module")
def flipped_plan(tmp_path_factory) -> dict:
    """The plan of a model with one replicated `aten` op (aten.flip)."""
    out = tmp_path_factory.mktemp("flipped") / "flipped.plan.json"
    assert main(["compile", "tests/replicated_models.py:flipped", "--mesh", "1x1x1x1x1", "-q", "-o", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.fixture
def called_ops(monkeypatch) -> list[str]:
    """Every ATen operator called in this process (a spy on `OpOverload.__call__`)."""
    calls: list[str] = []
    original = torch._ops.OpOverload.__call__

    def spy(self, *args, **kwargs):
        calls.append(str(self))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch._ops.OpOverload, "__call__", spy)
    return calls


@pytest.mark.parametrize("command", ["check", "run", "show"])
def test_a_plan_naming_a_file_reading_operator_is_refused_before_it_runs(command, flipped_plan, tmp_path, capsys,
                                                                         called_ops) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"\x00" * 4096)
    data = copy.deepcopy(flipped_plan)
    (op,) = _aten_ops(data)
    _set_attr(op, "target", "aten.from_file.default")
    _set_attr(op, "call", json.dumps({"args": [str(secret)], "kwargs": {"size": 512, "dtype": {"dtype": "float64"}}}))
    plan = tmp_path / "stolen.plan.json"
    plan.write_text(json.dumps(data))
    argv = {"check": ["check", str(plan)], "run": ["run", str(plan), "--steps", "1"],
            "show": ["show", str(plan), "--ops"]}[command]
    assert main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "op flip_default" in err and "aten.from_file.default" in err and "allow-list" in err
    assert "replicated_models.py:59:9" in err and "Traceback" not in err
    assert not any("from_file" in name for name in called_ops)  # never called, not even on meta tensors


@pytest.mark.parametrize("target", ["aten.save.default", "aten._assert_async.msg", "aten.sleep.default"])
def test_io_and_process_operators_are_not_on_the_list(target: str) -> None:
    with pytest.raises(AtenCallError, match="allow-list"):
        check_allowed(target)


def test_the_list_holds_every_operator_the_examples_and_library_models_emit() -> None:
    """Measured with every factory of examples/hf_models.py, tests/replicated_models.py,
    tests/flex_models.py and the examples (the list the frontend emitted before the allow-list)."""
    emitted = ("add.Tensor bmm.default cat.default chunk.default clone.default cumsum.default expand.default "
               "flip.default index.Tensor layer_norm.default masked_fill.Scalar matmul.default mean.dim "
               "mul.Tensor new_zeros.default pad.default pow.Tensor_Scalar repeat_interleave.self_int "
               "rms_norm.default rsqrt.default rsub.Scalar scaled_dot_product_attention.default select.int "
               "slice.Tensor slice_scatter.default softmax.int split.Tensor split_with_sizes.default "
               "square.default sum.dim_IntList where.self").split()
    for name in emitted:
        resolve(f"aten.{name}")  # allowed, and a pure operator of this torch


@pytest.mark.parametrize("spec", ["examples/hf_models.py:bloom", "examples/hf_models.py:codegen",
                                  "tests/replicated_models.py:alibi"])
def test_library_models_still_compile(spec: str) -> None:
    from fivedc.frontends.python_file import graph_from_spec

    graph = graph_from_spec(spec)
    assert any(isinstance(op, Op) and op.kind == "aten" for op, _ in walk_ops(graph.body))


def test_the_frontend_refuses_an_operator_off_the_list_at_its_line(tmp_path, capsys) -> None:
    model = tmp_path / "cdist.py"
    model.write_text(CDIST_MODEL)
    out = tmp_path / "cdist.plan.json"
    assert main(["compile", f"{model}:factory", "--mesh", "1x1x1x1x1", "-q", "-o", str(out)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{model}:13:" in err and "allow-list" in err and not out.exists()


CDIST_MODEL = """import torch
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, idx, targets):
        h = self.emb(idx)
        h = torch.cdist(h, h).sum(-1, keepdim=True) + h
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def factory():
    return Model().double(), (torch.randint(0, 16, (2, 4)), torch.randint(0, 16, (2, 4)))
"""


# ---- bounded work ---------------------------------------------------------------------------
def _timed(argv: list[str]) -> tuple[int, float]:
    start = time.perf_counter()
    code = main(argv)
    return code, time.perf_counter() - start


def test_divisors_come_from_the_factors() -> None:
    from fivedc.search.space import divisors

    assert divisors(12) == [1, 2, 3, 4, 6, 12] and divisors(1) == [1] and divisors(97) == [1, 97]
    assert all(divisors(n) == [d for d in range(1, n + 1) if n % d == 0] for n in range(1, 300))
    start = time.perf_counter()
    assert len(divisors(10**12)) == 169 and divisors(2 * (2**61 - 1)) == [1, 2, 2**61 - 1, 2 * (2**61 - 1)]
    assert time.perf_counter() - start < 0.5


def test_a_search_of_a_billion_gpus_is_refused_at_once(capsys) -> None:
    code, seconds = _timed(["search", GPT, "--gpus", "1000000000", "--gpu", "h100"])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and seconds < 2 and "--gpus 1000000000" in err and "2^20 = 1048576" in err


def test_a_search_with_a_huge_global_batch_answers_in_seconds(capsys) -> None:
    code, seconds = _timed(["search", GPT, "--gpus", "1024", "--gpu", "h100", "--global-batch", str(2**30)])
    assert code in (0, 2) and seconds < 2 * 3  # within 2 s on an idle machine; this one is shared
    code, seconds = _timed(["search", GPT, "--gpus", "1024", "--gpu", "h100", "--global-batch", str(10**12)])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and seconds < 2 and "--global-batch 1000000000000" in err and "2^31" in err


def test_a_model_of_a_million_layers_is_refused_at_its_repeat(tmp_path, capsys) -> None:
    model = tmp_path / "deep.5d"
    model.write_text(Path(GPT).read_text().replace("    layers = 2\n", "    layers = 1000000\n"))
    out = tmp_path / "deep.plan.json"
    code, seconds = _timed(["compile", str(model), "--mesh", "1x1x1x1x1", "-q", "-o", str(out)])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and seconds < 10 and not out.exists()
    assert f"{model}:27:3: error: the model has 1000000 layers" in err and "at most 2048" in err


def test_a_mesh_beyond_two_to_the_twenty_ranks_is_refused(capsys) -> None:
    assert main(["compile", GPT, "--mesh", "1048576x1x2x1x1", "-q", "-o", "/dev/null"]) == 2
    assert "mesh 1048576x1x2x1x1 has 2097152 ranks" in " ".join(capsys.readouterr().err.split())


def test_too_many_microbatches_are_refused_with_the_most_that_fit(capsys) -> None:
    argv = ["compile", "examples/tiny_llama.5d", "--mesh", "1x2x1x1x1", "--microbatches", "32769", "--global-batch",
            "32769", "-q", "-o", "/dev/null"]
    assert main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "32769 microbatches x 2 pipeline chunks = 65538 schedule slots" in err and "at most 32768 here" in err


@pytest.fixture(scope="module")
def gpt_plan(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpt") / "gpt.plan.json"
    assert main(["compile", GPT, "--mesh", "1x2x1x1x1", "-q", "-o", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("edit,message", [
    (lambda d: _repeat(d).update(count=10**9), "1000000000 layers in its repeats; fivedc plans for at most 2048"),
    (lambda d: d["pipeline"].update(microbatches=10**9), "1000000000 microbatches x 2 pipeline chunks"),
    (lambda d: d["mesh"]["sizes"].update(dp=2**30), "has 2147483648 ranks"),
    (lambda d: d["graph"]["dims"][0].__setitem__(1, 10**15), "dim batch = 1000000000000000 is larger"),
])
def test_a_plan_asking_for_unbounded_work_is_refused_on_load(edit, message, gpt_plan, tmp_path, capsys) -> None:
    data = copy.deepcopy(gpt_plan)
    edit(data)
    plan = tmp_path / "edited.plan.json"
    plan.write_text(json.dumps(data))
    code, seconds = _timed(["check", str(plan)])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and seconds < 10 and message in err and "Traceback" not in err


def _repeat(data: dict) -> dict:
    return next(i for i in data["graph"]["body"]["items"] if i.get("node") == "repeat")


@pytest.mark.parametrize("command", ["check", "diff"])
def test_a_plan_nested_a_hundred_thousand_deep_is_bad_input(command, tmp_path, capsys) -> None:
    plan = tmp_path / "deep.plan.json"
    plan.write_text('{"version": 1, "graph": ' + "[" * 100_000 + "]" * 100_000 + "}")
    argv = ["check", str(plan)] if command == "check" else ["diff", str(plan), str(plan)]
    assert main(argv) == 2
    assert "nests deeper than 64 levels" in " ".join(capsys.readouterr().err.split())
    shallow = tmp_path / "shallow.plan.json"  # deep enough to pass json but not the depth bound
    shallow.write_text('{"version": 1, "graph": ' + "[" * 500 + "]" * 500 + "}")
    assert main(["check", str(shallow)]) == 2
    assert "nests deeper than 64 levels" in " ".join(capsys.readouterr().err.split())


# ---- the model a plan was made from -----------------------------------------------------------
def _body_op(data: dict, kind: str) -> dict:
    return next(op for op in _repeat(data)["body"]["items"] if op.get("kind") == kind)


@pytest.mark.parametrize("kind,key,value", [("attention", "causal", False), ("gelu", "approximate", "none")])
@pytest.mark.parametrize("command", ["check", "run"])
def test_a_consistently_edited_model_is_not_the_one_its_source_compiles_to(kind, key, value, command, gpt_plan,
                                                                           tmp_path, capsys) -> None:
    data = copy.deepcopy(gpt_plan)
    _set_attr(_body_op(data, kind), key, value)
    plan = tmp_path / "edited.plan.json"
    plan.write_text(json.dumps(data))
    argv = ["check", str(plan)] if command == "check" else ["run", str(plan), "--steps", "1"]
    assert main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"is not the plan {GPT} compiles to" in err and "attrs" in err
    assert "Traceback" not in err


def test_a_plan_whose_source_changed_names_both_hashes(gpt_plan, tmp_path, capsys) -> None:
    model = tmp_path / "gpt.5d"
    model.write_text(Path(GPT).read_text())
    plan = tmp_path / "gpt.plan.json"
    assert main(["compile", str(model), "--mesh", "1x2x1x1x1", "-q", "-o", str(plan)]) == 0
    recorded = json.loads(plan.read_text())["graph"]["model_hash"]
    assert recorded == "sha256:" + hashlib.sha256(model.read_bytes()).hexdigest()
    capsys.readouterr()
    assert main(["check", str(plan)]) == 0
    assert f"model: {model} (sha256:" in " ".join(capsys.readouterr().out.split())
    model.write_text(Path(GPT).read_text().replace('approximate="tanh"', 'approximate="none"'))
    assert main(["check", str(plan)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    actual = "sha256:" + hashlib.sha256(model.read_bytes()).hexdigest()
    assert f"{model} is not the model" in err and recorded[:23] in err and actual[:23] in err


def test_a_missing_source_is_said_plainly(gpt_plan, tmp_path, capsys) -> None:
    data = copy.deepcopy(gpt_plan)
    data["graph"]["model_file"] = str(tmp_path / "gone.5d")  # a plan from a machine with another tree
    plan = tmp_path / "moved.plan.json"
    plan.write_text(json.dumps(data))
    gone = tmp_path / "gone.5d"
    for argv in (["check", str(plan)], ["check", str(plan), "--source", str(gone)]):
        capsys.readouterr()
        assert main(argv) == 0
        printed = capsys.readouterr().out
        out = " ".join(printed.split())
        assert f"model: {gone} not found: the plan's model cannot be checked against its source" in out
        assert all(len(line) <= 100 for line in printed.splitlines())


def test_a_python_source_is_hashed_never_imported(tmp_path, capsys) -> None:
    plan = tmp_path / "flipped.plan.json"
    assert main(["compile", "tests/replicated_models.py:flipped", "--mesh", "1x1x1x1x1", "-q", "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["check", str(plan)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "model: tests/replicated_models.py (sha256:" in out and "its traced model is not compared" in out
