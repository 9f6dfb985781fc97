"""The plan validator: a loaded plan is exactly what its model and options compile to.

Every example (DSL and traced modules, every axis, ZeRO and the schedules) round-trips
through a file and `load_plan`; named edits that would run differently (a mesh size,
a collective's count, a sharding, the microbatches, a dim) are rejected before any
process starts; and a hypothesis test mutates saved plans at random and shows that
each mutation is either rejected with a `PlanError` or gives a plan equal to a fresh
compile of its own model and options, never another exception.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fivedc.cli.main import load_graph, main
from fivedc.errors import PlanError
from fivedc.ir.mesh import Mesh
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from fivedc.plan.execution_plan import ExecutionPlan
from fivedc.cli.plan_check import check_plan, first_difference, load_plan, options_of, source_graph

CASES = [
    ("examples/gpt.5d", "2x1x2x1x1", dict(sequence_parallel=True)),
    ("examples/tiny_llama.5d", "2x1x1x4x1", dict(zero=3)),
    ("examples/tiny_llama.5d", "1x1x2x2x1", dict(cp_attention="allgather", cp_layout="contiguous")),
    ("examples/tiny_llama.5d", "1x2x2x1x1", dict(schedule="interleaved", microbatches=4)),
    ("examples/gpt.5d", "1x2x1x1x1", dict(pp_layout=(1, 1), zero=1, bucket_mb=0.01)),
    ("examples/gpt.5d", "1x2x2x1x1", dict(schedule="zb-h1", overlap=False)),
    ("examples/moe.5d", "2x1x1x1x2", dict(zero=2)),
    ("examples/deepseek_v3.5d", "1x2x8x1x32", dict(schedule="dualpipev")),
    ("examples/llama3_405b.5d", "2048x1x8x1x1", dict(sequence_parallel=True)),
    ("examples/llama.py:factory", "2x1x2x1x1", dict(sequence_parallel=True)),
    ("examples/mixtral.py:hf_factory", "1x1x1x1x2", dict(zero=2)),
]
_PLANS: dict[int, ExecutionPlan] = {}


def plan_of(index: int) -> ExecutionPlan:
    if index not in _PLANS:
        model, mesh, options = CASES[index]
        _PLANS[index] = compile_graph(load_graph(model), CompileOptions(mesh=Mesh.parse(mesh), **options))
    return _PLANS[index]


def saved(tmp_path, plan: ExecutionPlan, edit=None):
    data = json.loads(json.dumps(__import__("fivedc.ir.serialize", fromlist=["encode"]).encode(plan)))
    if edit is not None:
        edit(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{m}@{mesh}" for m, mesh, _ in CASES])
def test_every_example_round_trips_through_the_check(tmp_path, index: int) -> None:
    plan = plan_of(index)
    path = tmp_path / "p.json"
    plan.save(path)
    assert load_plan(path) == plan
    fresh = compile_graph(source_graph(plan.graph), options_of(plan))
    assert first_difference(plan, fresh, "plan") is None


def _items(data):
    return data["graph"]["body"]["items"]


def _first_op_with(data, key):
    def walk(items):
        for item in items:
            if key in item:
                yield item
            if item.get("node") == "repeat":
                yield from walk(item["body"]["items"])
    return next(walk(_items(data)))


EDITS = {
    "dp 2 -> 3 (a world of 6)": (lambda d: d["mesh"]["sizes"].update(dp=3), "not divisible by dp=3"),
    "dp 2 -> 1": (lambda d: d["mesh"]["sizes"].update(dp=1), "plan.graph.inputs"),
    "a float mesh size": (lambda d: d["mesh"]["sizes"].update(tp=2.0), "sizes.tp: expected an integer"),
    "a collective's count 1e9": (lambda d: d["collectives"][0].update(count=10**9), "collectives[0].count"),
    "a collective's count as 1e9": (lambda d: d["collectives"][0].update(count=1e9), "expected an integer"),
    "a collective dropped": (lambda d: d["collectives"].pop(), "collectives (length)"),
    "a dim": (lambda d: d["graph"]["dims"][0].__setitem__(1, d["graph"]["dims"][0][1] * 2), None),
    "a sharding": (lambda d: _first_op_with(d, "sharding").update(sharding=""), "sharding"),
    "a parameter's shape": (lambda d: d["graph"]["body"]["params"][0]["dims"].reverse(), None),
    "the version as text": (lambda d: d.update(version="1"), "the version field is '1', not a number"),
    "an unknown field": (lambda d: d.update(worlds=6), "no field 'worlds'"),
    "the memory estimate": (lambda d: d["memory"]["ranks"][0].update(params=1, total=d["memory"]["ranks"][0]["total"]
                                                                         - d["memory"]["ranks"][0]["params"] + 1),
                            "plan.memory.ranks[0].params"),
}


@pytest.mark.parametrize("name", list(EDITS))
def test_edits_that_would_run_differently_are_rejected(tmp_path, name: str) -> None:
    edit, message = EDITS[name]
    path = saved(tmp_path, plan_of(0), edit)
    with pytest.raises(PlanError) as caught:
        load_plan(path)
    if message:
        assert message in caught.value.message


def test_pipeline_edits_are_rejected(tmp_path) -> None:
    plan = plan_of(3)
    for edit, message in [
        (lambda d: d["pipeline"].update(microbatches=10**6), "microbatches"),
        (lambda d: d["pipeline"].update(microbatches=1e6), "expected an integer"),
        (lambda d: d["pipeline"].update(schedule="nosuch"), "nosuch"),
        (lambda d: d["pipeline"]["chunks"][0].update(rank=1), r"chunks\[0\]\.rank"),
    ]:
        with pytest.raises(PlanError, match=message):
            load_plan(saved(tmp_path, plan, edit))


def test_cli_refuses_an_edited_plan_before_any_process(tmp_path, capsys) -> None:
    path = saved(tmp_path, plan_of(0), EDITS["dp 2 -> 3 (a world of 6)"][0])
    assert main(["run", str(path)]) == 2
    assert main(["check", str(path)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "not divisible by dp=3" in err and "Traceback" not in err
    good = tmp_path / "good.json"
    plan_of(0).save(good)
    assert main(["check", str(good)]) == 0
    assert main(["check", str(tmp_path)]) == 2  # a directory
    assert "is a directory" in " ".join(capsys.readouterr().err.split())


# ---- random mutations ------------------------------------------------------------------------
def _leaves(value, path=()):
    """Every (path, value) in a JSON tree, containers included."""
    yield path, value
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, path + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _leaves(item, path + (index,))


def _mutations(value):
    out = [None, "x", True, [], {}, 0, -1, 1e6, float("nan")]
    if isinstance(value, bool):
        out.append(not value)
    elif isinstance(value, int):
        out += [value + 1, value - 1, value * 3, float(value)]
    elif isinstance(value, float):
        out += [value * 2, -value, math.inf]
    elif isinstance(value, str):
        out += [value + "x", value[::-1], ""]
    elif isinstance(value, list) and value:
        out += [value[:-1], value + value[-1:], value[::-1]]
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(index=st.sampled_from([0, 1, 3, 4, 6]), pick=st.integers(0, 10**9), how=st.integers(0, 10**9),
       delete=st.booleans())
def test_every_mutation_is_rejected_or_compiles_to_itself(tmp_path, index, pick, how, delete) -> None:
    from fivedc.ir.serialize import encode

    data = json.loads(json.dumps(encode(plan_of(index))))
    leaves = [(p, v) for p, v in _leaves(data) if p]
    path, value = leaves[pick % len(leaves)]
    mutated = copy.deepcopy(data)
    parent = mutated
    for key in path[:-1]:
        parent = parent[key]
    if delete:
        del parent[path[-1]]
    else:
        options = _mutations(value)
        parent[path[-1]] = options[how % len(options)]
    file = tmp_path / "mutated.json"
    file.write_text(json.dumps(mutated))
    try:
        loaded = load_plan(file)
    except PlanError:
        return
    fresh = compile_graph(source_graph(loaded.graph), options_of(loaded))
    assert first_difference(loaded, fresh, "plan") is None


def test_check_plan_names_the_first_difference() -> None:
    plan = plan_of(0)
    edited = type(plan)(**{**{f: getattr(plan, f) for f in plan.__dataclass_fields__}, "zero": 1})
    with pytest.raises(PlanError, match=r"plan\.(collectives|memory|buckets|zero|notes)"):
        check_plan(edited)


def test_a_figure_in_its_last_bits_loads_and_an_edited_one_does_not(tmp_path) -> None:
    """A plan compiled on another machine differs in the last bits of its figures (another
    maths library, another order of sums): it loads. A figure changed beyond that does not."""
    from fivedc.ir.hardware import hardware

    plan = compile_graph(load_graph("examples/gpt.5d"), CompileOptions(mesh=Mesh.parse("2x1x2x1x1"),
                                                                       hardware=hardware("h100")))

    def scaled(factor: float):
        return lambda d: d["time"].update(step_seconds=d["time"]["step_seconds"] * factor)

    assert load_plan(saved(tmp_path, plan, scaled(1 + 4e-16))).time.step_seconds != plan.time.step_seconds
    with pytest.raises(PlanError, match=r"plan\.time\.step_seconds"):
        load_plan(saved(tmp_path, plan, scaled(1 + 1e-6)))
