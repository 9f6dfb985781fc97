"""One instruction list that the runtime, the step-time model and the memory model read
(issue 39). The list the agreement proof checks (tests/test_instructions.py), which the
runtime's collectives are held to (tests/test_agreement.py), says what runs: which nodes run
forward and backward, which forwards backward does again (recomputation) and which gathered
inputs it gathers again (sequence parallelism). `fivedc/estimates/unit_costs.py` prices it,
and the runtime (`runtime/program.py`) and the memory model (`SaveContext.again`) act on
what it does again (`fivedc/instructions/done_again.py`). Change the list and each follows."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch

from fivedc.estimates.memo import Memo
from fivedc.estimates.memo import memo_unit_instructions, save_context
from fivedc.estimates.terms import RECOMPUTATION
from fivedc.estimates.unit_costs import unit_time
from fivedc.instructions.unit_program import distinct_units
from fivedc.frontends.dsl_file import load_model
from fivedc.instructions.comm_program import class_instructions
from fivedc.instructions.events import COMPUTE, FORWARD, FORWARD_AGAIN, GATHER_AGAIN, LAYER_AGAIN
from fivedc.ir.graph import Op
from fivedc.ir.hardware import hardware
from fivedc.ir.mesh import Mesh
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from fivedc.estimates.activations import layer_saves
from fivedc.estimates.saved import SaveContext
from fivedc.instructions import done_again as done_again_module
from fivedc.instructions.done_again import done_again, read_done_again
from fivedc.ir.graph import Redistribute, Repeat, walk_ops
from fivedc.runtime import program as program_module
from fivedc.runtime.kernel_context import KernelContext
from fivedc.runtime.program import Program, init_params, make_inputs

H100 = hardware("h100", ())


def compiled(recompute: str, model: str = "examples/gpt.5d", mesh: str = "1x1x4x1x1"):
    return compile_graph(load_model(model), CompileOptions(mesh=Mesh.parse(mesh), dtype="bf16", hardware=H100,
                                                           sequence_parallel=True, recompute=recompute))


def priced(plan, edit=lambda events: events):
    """Each distinct unit's time, from its instruction list with `edit` applied to its backward."""
    memo = Memo(plan.graph, plan.mesh, plan.dtype)
    listed = memo_unit_instructions(memo, plan.recompute)
    edited = {u: (forward, tuple(edit(backward))) for u, (forward, backward) in listed.items()}
    c = replace(save_context(memo, 2, 1, plan.recompute), again=done_again(plan.graph, edited))
    units = list(distinct_units(plan.graph, list(listed)).values())
    return [unit_time(c, plan.graph, u, H100, instructions=edited[u]) for u in units], listed, units


def test_a_fully_recomputed_layer_is_priced_by_the_forward_its_list_does_again():
    full, listed, units = priced(compiled("full"))
    layer = next(i for i, u in enumerate(units) if u.layer is not None)
    forward, backward = listed[units[layer]]
    assert len([e for e in backward if e.phase == LAYER_AGAIN]) == len(forward) > 0
    assert dict(full[layer].parts.input)[RECOMPUTATION] == pytest.approx(full[layer].forward, rel=1e-12)
    # the same list without its forward done again: the layer costs what it costs unrecomputed
    undone, _, _ = priced(compiled("full"), lambda events: [e for e in events if e.phase != LAYER_AGAIN])
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
    whole = unit_time(c, plan.graph, unit, H100, instructions=(forward, backward))
    keep = lambda events: tuple(e for e in events if e.node is not dropped)  # noqa: E731
    less = unit_time(c, plan.graph, unit, H100, instructions=(keep(forward), keep(backward)))
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


# ---- the runtime and the memory model act on what the list does again -------------------------
def _without(phase: str, monkeypatch) -> None:
    """Every reader of `done_again` sees the lists without their `phase` instructions."""
    made = done_again_module.unit_instructions

    def edited(*args, **kwargs):
        return {unit: (forward, tuple(e for e in backward if e.phase != phase))
                for unit, (forward, backward) in made(*args, **kwargs).items()}
    monkeypatch.setattr(done_again_module, "unit_instructions", edited)


def _kernel_calls(plan) -> Counter:
    """How often each op's kernel runs in one step of `plan`'s program on one device (float64)."""
    calls: Counter = Counter()
    kernels = dict(program_module.KERNELS)

    def counted(kind):
        def kernel(ctx, op, args, dims, *more):
            calls[op.out] += 1
            return kernels[kind](ctx, op, args, dims, *more)
        return kernel

    params = {n: t.requires_grad_() for n, t in init_params(plan.graph, seed=0, dtype=torch.float64).items()}
    ctx = KernelContext(plan.graph, plan.mesh, plan.mesh.coords(0))
    with pytest.MonkeyPatch.context() as patch:
        for kind in kernels:
            patch.setitem(program_module.KERNELS, kind, counted(kind))
        Program(plan.graph, ctx, recompute=plan.recompute).loss(
            params, make_inputs(plan.graph, seed=0, dtype=torch.float64)).backward()
    return calls


def _one_device(recompute: str):
    return compile_graph(load_model("examples/tiny_llama.5d"),
                         CompileOptions(mesh=Mesh.parse("1x1x1x1x1"), dtype="fp64", recompute=recompute))


def test_the_runtime_redoes_a_layer_where_its_list_says_so(monkeypatch):
    plan = _one_device("full")
    repeat = next(item for item in plan.graph.body.items if isinstance(item, Repeat))
    body = [node.out for node in repeat.body.items if isinstance(node, Op)]
    assert all(n == 2 * repeat.count for n in map(_kernel_calls(plan).get, body))  # forward, then again
    _without(LAYER_AGAIN, monkeypatch)
    assert all(n == repeat.count for n in map(_kernel_calls(plan).get, body))  # the list redoes nothing


def test_the_memory_model_keeps_what_the_list_does_not_redo(monkeypatch):
    plan = _one_device("full")
    repeat = next(item for item in plan.graph.body.items if isinstance(item, Repeat))
    context = lambda recompute: SaveContext.of(plan.graph, plan.mesh, dtype="fp64", dtype_bytes=8,  # noqa: E731
                                               recompute=recompute)
    redone, plain = layer_saves(context("full"), repeat), layer_saves(context("none"), repeat)
    assert redone.own == 0 < plain.own  # a layer recomputed whole keeps only its inputs
    _without(LAYER_AGAIN, monkeypatch)
    assert layer_saves(context("full"), repeat) == plain  # the list redoes nothing: it keeps it all


def test_sequence_parallels_kept_shards_are_the_lists_gathers_again(monkeypatch):
    plan = compiled("none")
    again = read_done_again(plan.graph, plan.mesh, recompute="none")
    made = {node.out: node.src for node, _ in walk_ops(plan.graph.body) if isinstance(node, Redistribute)}
    assert again.gathered and all(made[value] == shard for value, shard in again.gathered.items())
    c = SaveContext.of(plan.graph, plan.mesh, dtype="bf16", dtype_bytes=2)
    assert c.regathered == again.gathered
    _without(GATHER_AGAIN, monkeypatch)
    assert SaveContext.of(plan.graph, plan.mesh, dtype="bf16", dtype_bytes=2).regathered == {}
