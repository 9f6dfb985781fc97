"""The step-time model prices each unit's instruction list (issue 39): the list the agreement
proof checks (tests/test_instructions.py) and the runtime is held to (tests/test_agreement.py)
says what runs, and `fivedc/estimates/unit_costs.py` reads from it which nodes run forward and
backward, which forwards backward does again (recomputation) and which gathered inputs it
gathers again (sequence parallelism). Change the list and the price follows."""

from __future__ import annotations

import pytest

from fivedc.estimates.memo import Memo
from fivedc.estimates.step_time import memo_unit_instructions, save_context
from fivedc.estimates.terms import RECOMPUTATION
from fivedc.estimates.unit_costs import distinct_units, unit_time
from fivedc.frontends.dsl_file import load_model
from fivedc.instructions.comm_program import class_instructions
from fivedc.instructions.events import COMPUTE, FORWARD, FORWARD_AGAIN, GATHER_AGAIN
from fivedc.ir.graph import Op
from fivedc.ir.hardware import hardware
from fivedc.ir.mesh import Mesh
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph

H100 = hardware("h100", ())


def compiled(recompute: str, model: str = "examples/gpt.5d", mesh: str = "1x1x4x1x1"):
    return compile_graph(load_model(model), CompileOptions(mesh=Mesh.parse(mesh), dtype="bf16", hardware=H100,
                                                           sequence_parallel=True, recompute=recompute))


def priced(plan, edit=lambda events: events):
    """Each distinct unit's time, from its instruction list with `edit` applied to its backward."""
    memo = Memo(plan.graph, plan.mesh, plan.dtype)
    listed = memo_unit_instructions(memo, plan.recompute)
    c = save_context(memo, 2, 1, plan.recompute)
    units = list(distinct_units(plan.graph, list(listed)).values())
    again = {e.node.out for u in units for e in edit(listed[u][1]) if e.phase == GATHER_AGAIN}
    return [unit_time(c, plan.graph, u, H100, instructions=(listed[u][0], tuple(edit(listed[u][1]))), again=again)
            for u in units], listed, units


def test_a_fully_recomputed_layer_is_priced_by_the_forward_its_list_does_again():
    full, listed, units = priced(compiled("full"))
    layer = next(i for i, u in enumerate(units) if u.layer is not None)
    forward, backward = listed[units[layer]]
    assert len([e for e in backward if e.phase == FORWARD_AGAIN]) == len(forward) > 0
    assert dict(full[layer].parts.input)[RECOMPUTATION] == pytest.approx(full[layer].forward, rel=1e-12)
    # the same list without its forward done again: the layer costs what it costs unrecomputed
    undone, _, _ = priced(compiled("full"), lambda events: [e for e in events if e.phase != FORWARD_AGAIN])
    assert undone[layer].backward_input == pytest.approx(full[layer].backward_input - full[layer].forward, rel=1e-12)
    assert RECOMPUTATION not in dict(undone[layer].parts.input)


def test_selective_recomputation_prices_the_ops_its_list_does_again():
    selective, listed, units = priced(compiled("selective"))
    layer = next(i for i, u in enumerate(units) if u.layer is not None)
    forward, backward = listed[units[layer]]
    redone = [e.node for e in backward if e.phase == FORWARD_AGAIN and e.op == COMPUTE]
    assert [n.kind for n in redone] == ["attention"]
    assert 0 < dict(selective[layer].parts.input)[RECOMPUTATION] < selective[layer].forward
    undone, _, _ = priced(compiled("selective"), lambda events: [e for e in events if e.phase != FORWARD_AGAIN])
    assert RECOMPUTATION not in dict(undone[layer].parts.input)
    assert undone[layer].backward_input < selective[layer].backward_input


def test_sequence_parallels_gathers_again_are_priced_where_the_list_issues_them():
    plain, listed, units = priced(compiled("none"))
    layer = next(i for i, u in enumerate(units) if u.layer is not None)
    assert any(e.phase == GATHER_AGAIN for e in listed[units[layer]][1])
    ungathered, _, _ = priced(compiled("none"), lambda events: [e for e in events if e.phase != GATHER_AGAIN])
    assert ungathered[layer].backward_weight < plain[layer].backward_weight
    assert ungathered[layer].forward == plain[layer].forward


def test_an_op_the_list_leaves_out_is_not_priced():
    plan = compiled("none")
    memo = Memo(plan.graph, plan.mesh, plan.dtype)
    listed = memo_unit_instructions(memo, "none")
    unit = next(u for u in distinct_units(plan.graph, list(listed)).values() if u.layer is not None)
    forward, backward = listed[unit]
    dropped = next(e.node for e in forward if e.op == COMPUTE and e.node.kind == "linear")
    c = save_context(memo, 2, 1, "none")
    again = {e.node.out for e in backward if e.phase == GATHER_AGAIN}
    whole = unit_time(c, plan.graph, unit, H100, instructions=(forward, backward), again=again)
    keep = lambda events: tuple(e for e in events if e.node is not dropped)  # noqa: E731
    less = unit_time(c, plan.graph, unit, H100, instructions=(keep(forward), keep(backward)), again=again)
    assert less.forward < whole.forward and less.backward_weight < whole.backward_weight


def test_the_units_priced_are_the_runs_of_the_class_list_the_proof_checks():
    """Without a pipeline, a class's list is its units' forwards, then their backwards in
    reverse (with the gradient buckets' sums, no node's, started inside them), then the step's
    end: each unit's run there is the list the model prices."""
    plan = compiled("selective")
    memo = Memo(plan.graph, plan.mesh, plan.dtype)
    listed = memo_unit_instructions(memo, plan.recompute)
    [runs] = class_instructions(plan).values()
    for unit, (forward, backward) in listed.items():
        assert any(run.events == forward for run in runs)
        assert any(tuple(e for e in run.events if e.node is not None) == backward for run in runs)
        assert all(isinstance(e.node, Op) for e in forward if e.op == COMPUTE and e.phase == FORWARD)
