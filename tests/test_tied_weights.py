"""Tied weights: an output projection whose weight is the embedding table.

GPT-2, Gemma and many small models share one tensor between the token embedding
([vocab, hidden]) and the output projection (nn.Linear's [out, in] = [vocab, hidden]).
The IR keeps it as one parameter that both ops use (`linear` takes a weight stored
[out, in]); its gradient sums both uses, and the plan trains exactly as on one device
(float64) under dp, tp (vocab-parallel for both uses) and ZeRO-3. Under a pipeline whose
first and last stages both use it, each holds a copy (one layout) and the two sum their
gradients over the pp ranks holding it before the gradient sync, as Megatron does
(`passes/tied.py`): in float64 the parallelized module and fivedc's own training
loop (clipping, a checkpoint, resuming on another pipeline) equal one device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from pathlib import Path

import pytest

from fivedc.errors import FivedcError
from fivedc.frontends.dsl_file import parse_model
from fivedc.frontends.fx_module import trace_module
from fivedc.ir.graph import Annotation, Op, walk_ops
from fivedc.ir.mesh import Mesh, MeshAxis
from fivedc.parallel.check import check_module
from fivedc.passes.base import CompileOptions
from fivedc.passes.chunk_params import chunk_param_names
from fivedc.pipeline import compile_graph
from fivedc.proof.agreement import prove_agreement
from fivedc.instructions.comm_program import class_programs
from fivedc.runtime.checkpoint import read_index
from fivedc.runtime.reshard import consolidate
from fivedc.runtime.train_loop import train_job
from replicated_models import ShiftedLabels, tied_lm
from test_frontend_fx import assert_same_as_module, line_of
from train_helpers import job_for, make_tokens, one_device, rel

MODELS = str(Path(__file__).resolve().parent / "replicated_models.py")


def test_a_tied_table_is_one_parameter_used_twice() -> None:
    module, inputs = tied_lm()
    tm = trace_module(module, inputs)
    (table,) = [p for p in tm.graph.body.params if p.dims == ("vocab", "hidden")]
    users = [op.kind for op, _ in walk_ops(tm.graph.body) if isinstance(op, Op) and table.name in op.args]
    assert users == ["embedding", "linear"]
    assert_same_as_module(tm, module, inputs)
    plan = compile_graph(tm.graph, CompileOptions(mesh=Mesh.parse("2x1x2x1x1"), dtype="fp64"))
    (table,) = [p for p in plan.graph.body.params if p.dims == ("vocab", "hidden")]
    assert str(table.sharding) == "vocab:tp"  # both uses vocab-parallel: the same shard on each rank


@pytest.mark.parametrize("mesh, options", [("2x1x2x1x1", {"sequence_parallel": True}), ("2x1x1x1x1", {"zero": 3})])
def test_tied_weights_train_like_one_device(worker_pool, mesh: str, options: dict) -> None:
    report = check_module(f"{MODELS}:tied_lm", mesh=mesh, steps=2, dtype="fp64", pool=worker_pool, **options)
    assert report.max_error <= 1e-10, report


# The DSL's tied LM: the head is `linear` with the table itself (weight stored [out, in]).
TIED_DSL = """
model tied {
  dims {
    batch = 4
    seq = 8
    hidden = 16
    heads = 2
    head_dim = hidden / heads
    ffn = 32
    vocab = 64
    layers = 2
  }
  input tokens: int[batch, seq]
  input targets: int[batch, seq]
  param wte: [vocab, hidden]
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
    param ln2: [hidden] = ones
    param w_up: [hidden, ffn]
    param w_down: [ffn, hidden]
    x = add(x, linear(gelu(linear(rmsnorm(x, ln2), w_up)), w_down))
  }
  param lnf: [hidden] = ones
  logits = linear(rmsnorm(x, lnf), wte)
  loss = cross_entropy(logits, targets)
  return loss
}
"""


def tied_plan(mesh: str, **options):
    return compile_graph(parse_model(TIED_DSL, filename="<tied>"),
                         CompileOptions(mesh=Mesh.parse(mesh), dtype="fp64", **options))


def test_pipeline_stages_that_use_a_tied_table_each_hold_it_and_sum_its_gradient() -> None:
    module, inputs = tied_lm()
    graph = trace_module(module, inputs, stage_boundaries=("head",)).graph
    plan = compile_graph(graph, CompileOptions(mesh=Mesh.parse("2x2x1x1x1"), microbatches=1, dtype="fp64", zero=1))
    (table,) = [p.name for p in plan.graph.body.params if p.dims == ("vocab", "hidden")]
    assert all(table in chunk_param_names(plan.graph, plan.pipeline, pp_rank=r) for r in (0, 1))
    (tied,) = [c for c in plan.collectives if c.axes == (MeshAxis.PP,) and c.kind == "all_reduce"]
    assert (tied.phase, tied.bytes) == ("grad_sync", 32 * 16 * 8) and "tied weights" in tied.reason
    assert [b.params for b in plan.buckets if table in b.params] == [(table,)]  # held whole by both stages
    assert plan.memory.of_pp_rank(1, 2).params == plan.pipeline.chunks[1].param_bytes == 32 * 16 * 8  # the copy
    # four stages: the first and the last hold it, and only they sum it (a group of those two pp ranks)
    plan = tied_plan("2x4x1x1x1", zero=1)
    programs = class_programs(plan)
    sums = {r: [e for e in program if e.pp_ranks] for r, program in programs.items()}
    assert [len(sums[r]) for r in range(4)] == [1, 0, 0, 1] and sums[0][0].pp_ranks == (0, 3)
    assert sums[0][0].numel == 64 * 16 and prove_agreement(plan).across == 2  # the loss's sum and this one
    held = [plan.memory.of_pp_rank(r, 4).params for r in (0, 3)]
    assert held == [64 * 16 * 8, (64 + 1) * 16 * 8]  # the table, and the table with the final norm


@pytest.mark.parametrize("spec, mesh, options", [
    (f"{MODELS}:tied_targets", "1x2x1x1x1", {}),  # 1F1B, two microbatches
    (f"{MODELS}:tied_targets", "2x2x1x1x1", {"zero": 1}),  # each copy's ZeRO chunks over dp
    (f"{MODELS}:tied_targets", "1x2x2x1x1", {}),  # both copies vocab-parallel
    ("examples/hf_models.py:gpt2", "1x2x1x1x1", {}),  # wte and lm_head, the library's own model and loss
])
def test_a_tied_table_across_pipeline_stages_trains_like_one_device(worker_pool, spec: str, mesh: str,
                                                                     options: dict) -> None:
    marks = {"stage_boundaries": ("head",)} if spec.endswith("tied_targets") else {}
    report = check_module(spec, mesh=mesh, steps=2, dtype="fp64", pool=worker_pool, microbatches=2, **marks, **options)
    assert report.max_error <= 1e-10, report


def test_a_tied_table_clips_saves_once_and_resumes_on_another_pipeline(worker_pool, tmp_path) -> None:
    """fivedc's own loop: dp2·pp2 with ZeRO-1 and clipping (the global norm counts the tied gradient
    once), a checkpoint holding the table once, resumed on four stages with ZB-H1 (the first and the
    last sum it over a group of their own): the same norms, losses and parameters as one device."""
    data = make_tokens(tmp_path)
    config = dict(steps=4, lr=1e-2, save_every=2, keep=5, clip=0.2, val_every=0, seed=1)
    one = dataclasses.replace(job_for(tied_plan("1x1x1x1x1"), data, **config), save_dir=str(tmp_path / "one"))
    ref = one_device(one)
    first = dataclasses.replace(job_for(tied_plan("2x2x1x1x1", zero=1), data, **config), save_dir=str(tmp_path / "a"),
                                until=2)
    rows = worker_pool.run(train_job, world=4, payload=first)[0]["rows"]
    index = read_index(tmp_path / "a" / "step-00000002")
    files = {kind: sorted(p["file"] for p in index["tensors"][f"{kind}/wte"]["pieces"])
             for kind in ("param", "exp_avg")}
    assert files == {"param": ["rank-00000.safetensors"],  # whole, and once: written by pp rank 0 alone
                     "exp_avg": ["rank-00000.safetensors", "rank-00001.safetensors"]}  # ZeRO-1's chunks over dp
    second = dataclasses.replace(job_for(tied_plan("1x4x1x1x1", schedule="zb-h1"), data, **config),
                                 save_dir=str(tmp_path / "b"), resume=str(tmp_path / "a" / "step-00000002"))
    rows += worker_pool.run(train_job, world=4, payload=second)[0]["rows"]
    assert all(r["grad_norm"] > 0.2 for r in ref)  # every step clips
    for got, want in zip(rows, ref, strict=True):
        assert rel(got["grad_norm"], want["grad_norm"]) < 1e-12 and rel(got["loss"], want["loss"]) < 1e-12
    for kind in ("param", "exp_avg"):
        want, got = (consolidate(folder, read_index(folder), kind=kind)
                     for folder in (tmp_path / "one" / "step-00000004", tmp_path / "b" / "step-00000004"))
        assert want.keys() == got.keys()
        assert all((got[n] - want[n]).abs().max() <= 1e-12 * want[n].abs().max() for n in want), kind


def test_the_shardings_of_both_uses_must_agree() -> None:
    """A tied table that its two ops need sharded differently (the embedding kept whole by
    @replicate, the head vocab-parallel) is refused at the second use, not silently resharded."""
    module, inputs = tied_lm()
    graph = trace_module(module, inputs).graph
    items = tuple(replace(op, annotations=(Annotation("replicate", ()),)) if isinstance(op, Op) and
                  op.kind == "embedding" else op for op in graph.body.items)
    graph = replace(graph, body=replace(graph.body, items=items))
    with pytest.raises(FivedcError, match="sharded differently") as info:
        compile_graph(graph, CompileOptions(mesh=Mesh.parse("1x1x2x1x1")))
    assert info.value.loc.line == line_of(ShiftedLabels.forward, "logits = self.head(h)")
