"""A top-level parameter that only a repeat's body reads: one scale and one bias every layer shares.

Such a parameter used to be in no gradient bucket (the buckets took a repeat's own
parameters and the top-level ones read outside it), so its gradient was never summed
over dp and the agreement proof refused the plan. It is now a top-level bucket of its
own, launched right after the repeat's buckets (its gradient is complete once backward
has run the first layer); a pipeline that splits the repeat's layers over pp ranks holds
it on each and sums its gradient over them as a tied weight (`passes/tied.py`).
In float64 the plans train like one device.
"""

from __future__ import annotations

import pytest

from fivedc.frontends.dsl_file import parse_model
from fivedc.ir.mesh import Mesh, MeshAxis
from fivedc.passes.base import CompileOptions
from fivedc.passes.chunk_params import chunk_param_names
from fivedc.passes.tied import tied_names
from fivedc.pipeline import compile_graph
from fivedc.proof.agreement import prove_agreement
from fivedc.runtime.train import TrainSettings
from fivedc.runtime.verify import single_device_mesh, verify_plan
from wire_log import assert_calls_match

SHARED = """
model shared {
  dims {
    batch = 8
    seq = 8
    hidden = 16
    heads = 2
    head_dim = hidden / heads
    ffn = 32
    vocab = 32
    layers = 4
  }
  input tokens: int[batch, seq]
  input targets: int[batch, seq]
  param wte: [vocab, hidden]
  param scale: [hidden] = ones
  param bias: [hidden] = normal(0.1)
  x = embedding(tokens, wte)
  repeat layers {
    param ln1: [hidden] = ones
    param wq: [hidden, heads, head_dim]
    param wk: [hidden, heads, head_dim]
    param wv: [hidden, heads, head_dim]
    param wo: [heads, head_dim, hidden]
    h = rmsnorm(x, ln1)
    a = attention(linear(h, wq), linear(h, wk), linear(h, wv), causal=true)
    x = add(x, linear(a, wo))
    param w_up: [hidden, ffn]
    param w_down: [ffn, hidden]
    h = add(mul(rmsnorm(x, scale), scale), bias)
    x = add(x, linear(gelu(linear(h, w_up)), w_down))
  }
  param lnf: [hidden] = ones
  param w_head: [hidden, vocab]
  logits = linear(rmsnorm(x, lnf), w_head)
  loss = cross_entropy(logits, targets)
  return loss
}
"""
# the whole repeat on pp rank 0: the head's statement begins the second chunk
ON_ONE_STAGE = SHARED.replace("logits = linear(rmsnorm(x, lnf), w_head)",
                              "logits = linear(rmsnorm(x, lnf), w_head) @stage")
SHARED_NAMES = {"scale", "bias"}
MODELS = {"split": SHARED, "one stage": ON_ONE_STAGE}  # where the pipeline puts the repeat's layers


def plan_of(model: str, mesh: str, **options):
    return compile_graph(parse_model(MODELS[model], filename="<shared>"),
                         CompileOptions(mesh=Mesh.parse(mesh), dtype="fp64", **options))


def summed_buckets(plan, pp_rank: int) -> list[tuple[str, ...]]:
    """The buckets the pp rank runs that hold a shared parameter."""
    held = chunk_param_names(plan.graph, plan.pipeline, pp_rank=pp_rank)
    return [b.params for b in plan.buckets if SHARED_NAMES & set(b.params) and set(b.params) <= held]


@pytest.mark.parametrize("mesh, options", [
    ("2x1x1x1x1", {}),
    ("2x1x1x1x1", {"zero": 1}),
    ("2x1x1x1x1", {"zero": 2}),
    ("2x1x2x1x1", {"sequence_parallel": True}),
    ("2x1x2x1x1", {"zero": 3}),
])
def test_a_shared_parameter_is_bucketed_after_the_repeat_without_a_pipeline(mesh: str, options: dict) -> None:
    plan = plan_of("split", mesh, **options)
    indices = [b.index for b in plan.buckets if b.repeat == "layers"]
    (shared,) = [b for b in plan.buckets if SHARED_NAMES & set(b.params)]
    assert shared.params == ("bias", "scale") and shared.count == 1  # backward order, once per step
    assert shared.index == max(indices) + 1  # launched once backward has run the first layer
    assert MeshAxis.DP in shared.axes
    assert prove_agreement(plan).classes == 1


@pytest.mark.parametrize("model, mesh, options, holders", [
    ("one stage", "2x2x1x1x1", {}, (0,)),
    ("one stage", "2x2x1x1x1", {"zero": 1}, (0,)),
    ("one stage", "2x2x1x1x1", {"zero": 3}, (0,)),
    ("split", "2x2x1x1x1", {"zero": 1}, (0, 1)),  # the layers on both stages: a tied pair
    ("split", "2x2x1x1x1", {"schedule": "dualpipe", "microbatches": 4}, (0, 1)),  # DualPipe's two copies
])
def test_a_shared_parameter_is_summed_by_the_pp_ranks_that_hold_it(model: str, mesh: str, options: dict,
                                                                   holders: tuple[int, ...]) -> None:
    plan = plan_of(model, mesh, **options)
    held = [r for r in range(2) if SHARED_NAMES <= chunk_param_names(plan.graph, plan.pipeline, pp_rank=r)]
    assert tuple(held) == holders
    for r in held:  # each holder sums its gradient over dp in one bucket
        assert [set(b) for b in summed_buckets(plan, r)] == [SHARED_NAMES]
    tied = tied_names(plan.graph, plan.pipeline, plan.mesh.size(MeshAxis.PP))
    assert (SHARED_NAMES <= tied) == (len(holders) > 1 and options.get("schedule") != "dualpipe")
    assert prove_agreement(plan).classes == 2


@pytest.mark.parametrize("model, mesh, options", [
    ("split", "2x1x1x1x1", {}),  # overlap on: the bucket starts from backward's hooks
    ("split", "2x1x1x1x1", {"zero": 2}),  # reduce-scattered from the hooks
    ("split", "2x1x2x1x1", {"zero": 3}),
    ("one stage", "2x2x1x1x1", {"zero": 1, "microbatches": 2}),
    ("split", "2x2x1x1x1", {"microbatches": 2}),  # held by both stages: summed over pp, then dp
])
def test_a_shared_parameter_trains_like_one_device(model: str, mesh: str, options: dict, worker_pool) -> None:
    graph = parse_model(MODELS[model], filename="<shared>")
    plan = compile_graph(graph, CompileOptions(mesh=Mesh.parse(mesh), dtype="fp64", **options))
    reference = compile_graph(graph, CompileOptions(mesh=single_device_mesh(), dtype="fp64"))
    report = verify_plan(plan, reference, settings=TrainSettings(steps=2), pool=worker_pool)
    assert report.max_error <= 1e-10, report
    assert report.losses[1] != report.losses[0]


@pytest.mark.parametrize("model, mesh, options", [
    ("split", "2x1x1x1x1", {}),  # the bucket from backward's hooks, where the proof expects it
    ("split", "2x1x2x1x1", {"zero": 3}),  # ZeRO-3 gathers its group in every layer
    ("one stage", "2x2x1x1x1", {"zero": 1, "microbatches": 2}),
])
def test_the_proof_expects_what_the_runtime_calls(model: str, mesh: str, options: dict, worker_pool) -> None:
    assert_calls_match(plan_of(model, mesh, **options), worker_pool)
