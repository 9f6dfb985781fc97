"""Ops the IR has no kind for run as ATen calls (`aten` ops), and a loss's ignore_index counts right.

A model written by a user with an op fivedc has no rule for (the sequence reversed)
is not refused: the op runs whole on every rank, listed with its line and reason in
the plan, the summary and `fivedc diff`. An op torch says is pointwise, or a
reduction or scan along some dims (Gemma's RMSNorm with 1 + w, GPT-2's tanh GELU
written out, a softmax, a running sum over the sequence), runs on shards and keeps
the splits of the dims it does not run along. Either way the model trains exactly as
on one device, composed with dp, tp (+SP), cp and ZeRO. Cross-entropy leaves targets
of -100 out of its mean as torch does, with the count taken over every shard and, under
a pipeline, over every microbatch of the step. A plan file can name only pure ATen
operators.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from fivedc.plan.diff import diff_plans
from fivedc.errors import FivedcError, NotSupportedError
from fivedc.frontends.fx_module import trace_module
from fivedc.ir.aten_layout import arg_layouts, out_layout
from fivedc.ir.graph import Op, walk_ops
from fivedc.ir.mesh import Mesh, MeshAxis
from fivedc.parallel.check import check_module
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from fivedc.cli.plan_check import load_plan
from fivedc.plan.summary import render_summary
from replicated_models import Flipped, LocalOps, flipped, running_sum
from test_frontend_fx import assert_same_as_module, line_of, llama

MODELS = str(Path(__file__).resolve().parent / "replicated_models.py")  # the factories workers load


def _islands(graph):
    return [op for op, _ in walk_ops(graph.body) if isinstance(op, Op) and op.kind == "aten"]


def test_an_op_without_a_rule_is_one_replicated_island_at_its_line() -> None:
    module, inputs = flipped()
    tm = trace_module(module, inputs)
    (island,) = _islands(tm.graph)
    assert island.attr("target") == "aten.flip.default" and island.attr("rule") == "replicated"
    assert island.loc.file == MODELS and island.loc.line == line_of(Flipped.forward, "torch.flip")
    assert_same_as_module(tm, module, inputs)
    ce = next(op for op, _ in walk_ops(tm.graph.body) if isinstance(op, Op) and op.kind == "cross_entropy")
    assert ce.attr("ignore_index") == -100


@settings(max_examples=4, deadline=None, derandomize=True)
@given(mesh=st.sampled_from(["2x1x2x1x1", "1x1x1x2x1", "2x1x1x2x1", "1x1x2x2x1"]), sp=st.booleans(),
       zero=st.sampled_from([0, 3]), seed=st.integers(0, 1000))
def test_a_replicated_island_trains_like_one_device(worker_pool, mesh: str, sp: bool, zero: int, seed: int) -> None:
    """Its inputs gathered (the sequence put back in global order under cp's balanced layout),
    its result cut again; loss, gradients and AdamW's parameters as on one device, in float64."""
    report = check_module(f"{MODELS}:flipped", kwargs={"seed": seed}, mesh=mesh, steps=2, dtype="fp64",
                          pool=worker_pool, sequence_parallel=sp, zero=zero if mesh.startswith("2") else 0)
    assert report.max_error <= 1e-10, report


def _local_plan(mesh: str):
    from replicated_models import local_ops

    module, inputs = local_ops()
    tm = trace_module(module, inputs)
    return tm, compile_graph(tm.graph, CompileOptions(mesh=Mesh.parse(mesh), sequence_parallel=True, dtype="fp64"))


def test_pointwise_ops_and_reductions_keep_their_splits() -> None:
    """No op of LocalOps runs replicated: the norm's pow, mean and rsqrt stay split over the batch and
    the sequence, the written-out GELU between the column- and row-parallel linears stays split over
    ffn (tp), and only the dims a reduction or scan runs along are whole (the softmax's features, the
    running sum's sequence)."""
    tm, plan = _local_plan("2x1x2x2x1")
    ops = {op.out: op for op in _islands(plan.graph)}
    rules = {op.attr("target"): op.attr("rule") for op in ops.values()}
    assert rules == {"aten.pow.Tensor_Scalar": "pointwise", "aten.mean.dim": "along",
                     "aten.rsqrt.default": "pointwise", "aten.softmax.int": "along",
                     "aten.cumsum.default": "along"}
    line = line_of(LocalOps.forward, "torch.pow(u, 3.0)")
    (gelu_pow,) = [op for op in ops.values() if op.loc.line == line]
    assert gelu_pow.sharding.split_axes() and "tp" in str(gelu_pow.sharding), gelu_pow.sharding
    for op in ops.values():
        assert op.sharding.axes_of("batch"), (op.out, op.sharding)  # every one keeps the batch split
        if op.attr("target") in ("aten.pow.Tensor_Scalar", "aten.mean.dim", "aten.rsqrt.default"):
            assert op.sharding.axes_of("seq"), (op.out, op.sharding)  # the norm: over the sequence shards
    (cumsum,) = [op for op in ops.values() if op.attr("target") == "aten.cumsum.default"]
    assert not cumsum.sharding.axes_of("seq")  # it runs along the sequence: whole
    console = Console(record=True, width=200)
    render_summary(plan, console=console)
    assert "Replicated ops" not in console.export_text()
    assert_same_as_module(tm, *_local_inputs())


def _local_inputs():
    from replicated_models import local_ops

    return local_ops()


@settings(max_examples=4, deadline=None, derandomize=True)
@given(mesh=st.sampled_from(["2x1x2x1x1", "1x1x2x2x1", "2x1x1x2x1", "1x2x2x1x1"]), sp=st.booleans(),
       zero=st.sampled_from([0, 3]), seed=st.integers(0, 1000))
def test_pointwise_ops_and_reductions_train_like_one_device(worker_pool, mesh, sp, zero, seed) -> None:
    """On shards (a reduction along the sequence with it gathered in global order under cp's balanced
    layout; a pipeline of two microbatches for pp): loss, gradients and parameters as on one device."""
    options = {"microbatches": 2, "stage_boundaries": ("head",)} if mesh.startswith("1x2") else {}
    report = check_module(f"{MODELS}:local_ops", kwargs={"seed": seed}, mesh=mesh, steps=2, dtype="fp64",
                          pool=worker_pool, sequence_parallel=sp, zero=zero if mesh.startswith("2") else 0, **options)
    assert report.max_error <= 1e-10, report


@pytest.mark.parametrize("factory", ["running_sum", "shifted_labels"])
def test_ops_along_the_sequence_train_under_cp(worker_pool, factory: str) -> None:
    """A running sum along the sequence (gathered, in global order); labels padded and sliced inside
    the model, whose new dim becomes the sequence at the loss (computed in global order, then put
    in cp's balanced order like every whole sequence)."""
    report = check_module(f"{MODELS}:{factory}", mesh="2x1x1x2x1", steps=2, dtype="fp64", pool=worker_pool)
    assert report.max_error <= 1e-10, report


@pytest.mark.parametrize("mesh, microbatches", [("2x1x1x1x1", None), ("1x2x1x1x1", 2), ("2x2x1x1x1", 2)])
def test_ignored_targets_count_over_shards_and_microbatches(worker_pool, mesh: str, microbatches) -> None:
    """Targets of -100 unevenly spread: the mean divides by the count over every dp shard and, under
    a pipeline, over every microbatch of the step (counted before the first one)."""
    options = {"microbatches": microbatches} if microbatches else {}
    report = check_module(f"{MODELS}:llama_ignoring", mesh=mesh, steps=2, dtype="fp64", pool=worker_pool, **options)
    assert report.max_error <= 1e-10, report


def test_targets_computed_from_the_inputs_count_over_every_microbatch(worker_pool) -> None:
    """Labels shifted inside the model (pad, slice: Hugging Face's loss) under pp2 with 2 microbatches
    and cp2: the pipeline counts them for the whole step up front, running the ops that compute them
    from the inputs once more on the step's inputs (a per-microbatch count would double the loss)."""
    report = check_module(f"{MODELS}:shifted_labels", mesh="1x2x1x2x1", steps=2, dtype="fp64", pool=worker_pool,
                          microbatches=2, stage_boundaries=("head",))
    assert report.max_error <= 1e-10, report


def test_targets_computed_from_activations_cannot_be_counted_per_step() -> None:
    class ArgmaxTargets(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            logits = self.head(self.emb(idx))
            targets = logits.detach().argmax(-1)  # from an activation: known only as each microbatch runs
            return F.cross_entropy(logits.view(-1, 16), targets.view(-1))

    graph = trace_module(ArgmaxTargets().double(), (torch.randint(0, 16, (4, 8)),), stage_boundaries=("head",)).graph
    with pytest.raises(NotSupportedError, match="targets computed from more than the inputs") as info:
        compile_graph(graph, CompileOptions(mesh=Mesh.parse("1x2x1x1x1"), microbatches=2))
    assert info.value.loc.line == line_of(ArgmaxTargets.forward, "F.cross_entropy")
    compile_graph(graph, CompileOptions(mesh=Mesh.parse("1x2x1x1x1"), microbatches=1))


def _plan(mesh: str = "2x1x2x1x1"):
    module, inputs = flipped()
    graph = trace_module(module, inputs).graph
    return compile_graph(graph, CompileOptions(mesh=Mesh.parse(mesh), sequence_parallel=True, dtype="fp64"))


def test_the_summary_and_the_diff_name_the_island() -> None:
    plan = _plan()
    console = Console(record=True, width=200)
    render_summary(plan, console=console)
    text = console.export_text()
    assert "Replicated ops" in text and "aten.flip.default" in text and "no sharding rule" in text
    ce = next(op for op, _ in walk_ops(plan.graph.body) if isinstance(op, Op) and op.kind == "cross_entropy")
    assert any("ignore_index=-100" in c.reason for c in ce.collectives)  # the count's all-reduce, with its reason
    plain = compile_graph(trace_module(*llama.factory()).graph, CompileOptions(mesh=Mesh.parse("2x1x2x1x1")))
    d = diff_plans(plain, plan)
    assert [(r.change, r.target) for r in d.replicated] == [("added", "aten.flip.default")]
    assert d.to_json()["replicated"][0]["target"] == "aten.flip.default"


def test_a_plan_with_an_island_round_trips_and_is_checked(tmp_path) -> None:
    plan = _plan()
    path = tmp_path / "p.plan.json"
    plan.save(path)
    assert load_plan(path).graph == plan.graph
    text = path.read_text()
    for bad, why in (("aten.flip.default", "aten.add_.Tensor"),  # writes to its argument
                     ("aten.flip.default", "aten.rand.default"),  # draws random numbers
                     ("aten.flip.default", "os.system.call"),  # not an ATen operator
                     ('"replicated"', '"pointwise"')):  # flip is no pointwise op: it would run on shards
        path.write_text(text.replace(bad, why))
        with pytest.raises(FivedcError) as info:
            load_plan(path)
        assert info.value.exit_code == 2, info.value.render()
    data = json.loads(text)
    op = next(item for item in data["graph"]["body"]["items"] if item.get("kind") == "aten")
    attrs = dict(op["attrs"]) if isinstance(op["attrs"], list) else op["attrs"]
    assert "flip" in json.dumps(attrs)


def test_a_replicated_island_cannot_run_per_microbatch() -> None:
    """It may reduce over the batch: a pipeline with several microbatches refuses it at its line."""
    module, inputs = flipped()
    graph = trace_module(module, inputs, stage_boundaries=("head",)).graph  # two chunks: the head apart
    with pytest.raises(NotSupportedError, match="microbatches") as info:
        compile_graph(graph, CompileOptions(mesh=Mesh.parse("1x2x1x1x1"), microbatches=2))
    assert info.value.loc.line == line_of(Flipped.forward, "torch.flip")
    compile_graph(graph, CompileOptions(mesh=Mesh.parse("1x2x1x1x1"), microbatches=1))  # one microbatch: fine
    module, inputs = running_sum()  # a scan along the sequence, not the batch: per microbatch is fine
    graph = trace_module(module, inputs, stage_boundaries=("head",)).graph
    compile_graph(graph, CompileOptions(mesh=Mesh.parse("1x2x1x1x1"), microbatches=2))


def test_a_replicated_island_runs_in_a_pipeline_of_one_microbatch(worker_pool) -> None:
    report = check_module(f"{MODELS}:flipped", mesh="1x2x1x1x1", steps=2, dtype="fp64", pool=worker_pool,
                          microbatches=1, stage_boundaries=("head",))
    assert report.max_error <= 1e-10, report


def test_writes_in_place_on_a_tensor_of_its_own_become_pure_ops(worker_pool) -> None:
    """`g /= g.sum(...)` and `g.mul_(4)` read as `g = g / g.sum(...)`, `g = g * 4` (the export path
    rewrites them); the model trains as on one device. A write through a view stays refused, at its line."""
    from replicated_models import WritesThroughAView, in_place

    module, inputs = in_place()
    tm = trace_module(module, inputs)
    assert_same_as_module(tm, module, inputs)
    assert all("_." not in str(op.attr("target")) for op in _islands(tm.graph))
    report = check_module(f"{MODELS}:in_place", mesh="2x1x2x1x1", steps=2, dtype="fp64", pool=worker_pool)
    assert report.max_error <= 1e-10, report
    import torch
    torch.manual_seed(0)
    with pytest.raises(NotSupportedError, match="writes to its arguments") as info:
        trace_module(WritesThroughAView().double(), inputs)
    assert info.value.loc.line == line_of(WritesThroughAView.forward, "first.mul_")


def test_a_tensor_written_slice_by_slice_becomes_cat_or_slice_scatter(worker_pool) -> None:
    """`new_empty` then `copy_` into slices covering a dim in order is the `cat` of what was copied;
    `new_zeros` written in part is a `slice_scatter` into zeros (fx/fill_writes.py): no write is left,
    the captured graph computes the module's loss and gradients, and dp2·tp2 trains as one device."""
    from replicated_models import filled_slices

    module, inputs = filled_slices()
    tm = trace_module(module, inputs)
    targets = [str(op.attr("target")) for op in _islands(tm.graph)]
    assert "aten.cat.default" in targets and "aten.slice_scatter.default" in targets
    assert not [t for t in targets if "copy_" in t or "empty" in t]
    assert_same_as_module(tm, module, inputs)
    report = check_module(f"{MODELS}:filled_slices", mesh="2x1x2x1x1", steps=2, dtype="fp64", pool=worker_pool)
    assert report.max_error <= 1e-10, report


def test_a_linear_over_a_transposed_view_moves_it_into_memory_order_first(worker_pool) -> None:
    """Where the IR holds a tensor's dims in another order than the torch view a linear reads, a
    pointwise `aten.clone` on shards puts them in memory order (`.contiguous()`), not a refusal."""
    from replicated_models import transposed

    module, inputs = transposed()
    tm = trace_module(module, inputs)
    assert "aten.clone.default" in [op.attr("target") for op in _islands(tm.graph)]
    assert_same_as_module(tm, module, inputs)
    for mesh in ("2x1x2x1x1", "1x1x1x2x1"):
        report = check_module(f"{MODELS}:transposed", mesh=mesh, steps=2, dtype="fp64", pool=worker_pool)
        assert report.max_error <= 1e-10, report


def test_an_operator_with_several_results_keeps_the_one_used() -> None:
    from replicated_models import SortsFeatures

    import torch
    torch.manual_seed(0)
    module = SortsFeatures().double()
    inputs = (torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8)))
    tm = trace_module(module, inputs)
    (island,) = _islands(tm.graph)
    assert island.attr("target").startswith("aten.sort.") and island.attr("item") == 0
    assert_same_as_module(tm, module, inputs)


def test_a_table_a_cat_and_an_expand_run_on_shards_and_per_microbatch(worker_pool) -> None:
    """Rotary tables applied to even and odd features (pointwise with a constant: its rows cut to
    each rank's sequence positions, `rows`), a `cat` of several tensors along the features and an
    `expand` that grows a dim (DeepSeek-V3's interleaved rotary and keys): no op runs replicated
    and nothing is gathered, so a pipeline runs them per microbatch, and cp2, cp4 in the balanced
    layout (each rank's rows are two blocks of the table) and pp2·tp2 in two microbatches (the
    expanded heads cut to tp's) train as on one device."""
    from replicated_models import rotated_pairs

    module, inputs = rotated_pairs()
    tm = trace_module(module, inputs)
    rules = {(str(op.attr("target")), str(op.attr("rule"))) for op in _islands(tm.graph)}
    assert {("aten.mul.Tensor", "pointwise"), ("aten.cat.default", "along"), ("aten.expand.default", "along")} <= rules
    assert all(rule != "replicated" for _, rule in rules), rules
    expand = next(op for op in _islands(tm.graph) if op.attr("target") == "aten.expand.default")
    assert "[-1,-1,4,-1]" in str(expand.attr("call"))  # the sizes it keeps are the shard's or microbatch's
    assert_same_as_module(tm, module, inputs)
    plan = compile_graph(tm.graph, CompileOptions(mesh=Mesh.parse("1x1x1x4x1"), cp_layout="balanced"))
    tables = [op for op in _islands(plan.graph) if op.attr("target") == "aten.mul.Tensor"]
    assert len(tables) == 4 and all(op.attr("rows") == "1,2" and op.sharding.axes_of("seq") for op in tables)
    assert not [c for op, _ in walk_ops(plan.graph.body) if isinstance(op, Op) for c in op.collectives
                if c.kind.name == "ALL_GATHER"]  # the tables' rows are cut to each rank's positions
    for mesh, microbatches, layout in (("1x1x1x2x1", None, None), ("1x1x1x4x1", None, "balanced"),
                                       ("1x2x2x1x1", 2, None)):
        report = check_module(f"{MODELS}:rotated_pairs", mesh=mesh, steps=2, dtype="fp64", pool=worker_pool,
                              microbatches=microbatches, stage_boundaries=("head",) if microbatches else (),
                              cp_layout=layout)
        assert report.max_error <= 1e-10, (mesh, report)


def test_a_pair_rotary_and_a_repeat_by_expand_train_on_every_axis(worker_pool) -> None:
    """torchtune's attention, written into examples/llama.py's: a rotary embedding that rotates
    adjacent pairs of head_dim (a view into pairs, `select`s, `stack`, `flatten`) and k/v repeated
    by unsqueeze, expand and flatten. The stack is a cat of unsqueezed views (runs along its new
    dim), the repeat is grouped-query attention's, and the attention reads the head_dim the
    rotary made of two dims as one (a pointwise clone along it): no op runs replicated, so a
    pipeline runs it per microbatch, and dp2·tp2 with ZeRO-3 and pp2·cp2 train as on one device."""
    from replicated_models import PairRotaryAttention, pair_rotary

    module, inputs = pair_rotary()
    tm = trace_module(module, inputs)
    ops = _islands(tm.graph)
    assert all(op.attr("rule") != "replicated" for op in ops), [(op.attr("target"), op.attr("rule")) for op in ops]
    assert {str(op.attr("target")) for op in ops} >= {"aten.select.int", "aten.cat.default", "aten.clone.default"}
    attention = [op for op, _ in walk_ops(tm.graph.body) if isinstance(op, Op) and op.kind == "attention"]
    assert len(attention) == 2 and all(op.loc.line == line_of(PairRotaryAttention.forward, "scaled_dot_product")
                                       for op in attention)
    assert not {"aten.repeat_interleave.self_int", "aten.expand.default"} & {op.attr("target") for op in ops}  # GQA
    assert_same_as_module(tm, module, inputs)
    for mesh, zero in (("2x1x2x1x1", 3), ("1x2x1x2x1", 0)):  # dp2·tp2 with ZeRO-3, pp2·cp2
        report = check_module(f"{MODELS}:pair_rotary", mesh=mesh, steps=2, dtype="fp64", pool=worker_pool, zero=zero)
        assert report.max_error <= 1e-10, (mesh, report)


def test_a_complex_rotary_and_layers_in_a_module_dict_train_on_every_axis(worker_pool) -> None:
    """Meta's (and torchtitan's) rotary: head_dim's pairs as complex numbers times a complex table.
    fivedc's IR is real: the product is written out on real and imaginary parts (fx/aten_rewrites.py),
    so only the table's own ops see complex values and nothing runs replicated. Cast to float64 for
    the check, the table becomes complex128 (nn.Module.to would drop its imaginary part); the layers,
    kept in an nn.ModuleDict, are the pipeline's units; dp2·tp2 and pp2·cp2 train as on one device."""
    from fivedc.frontends.fx.precision import float64_everywhere
    from fivedc.parallel.check import in_dtype
    from replicated_models import complex_rotary

    module, inputs = complex_rotary()
    table = module.layers["0"].attention.rope.freqs_cis
    module = in_dtype(module, torch.float64)
    cast = module.layers["0"].attention.rope.freqs_cis
    assert cast.dtype == torch.complex128 and torch.equal(cast, table.to(torch.complex128))
    tm = trace_module(module, inputs)
    ops = _islands(tm.graph)
    assert ops and all(op.attr("rule") != "replicated" for op in ops), [(op.attr("target"), op.attr("rule")) for op in ops]
    assert not [op for op in ops if "complex" in str(op.attr("target"))]
    with float64_everywhere(True):  # its x.float() in float64 too, as the plan computes (fx/precision.py)
        assert_same_as_module(tm, module, inputs)
    for mesh in ("2x1x2x1x1", "1x2x1x2x1"):  # dp2·tp2, pp2·cp2
        report = check_module(f"{MODELS}:complex_rotary", mesh=mesh, steps=2, dtype="fp64", pool=worker_pool)
        assert report.max_error <= 1e-10, (mesh, report)


def test_attention_written_out_by_hand_runs_its_matmuls_on_shards(worker_pool) -> None:
    """`q @ k^T` and `probs @ v` of an attention the IR has no op for (ReLU² over a sliding
    window): matmuls of two activations run on shards of the batch and the heads, with the key
    positions a new dim of the scores (the query positions are the sequence), so nothing runs
    replicated, and the model trains as on one device under dp2·tp2 with ZeRO-3. The residual
    added to the attention's output (whole along the sequence) keeps the other's split under cp."""
    from replicated_models import relu_squared

    module, inputs = relu_squared()
    tm = trace_module(module, inputs)
    ops = _islands(tm.graph)
    matmuls = [op for op in ops if op.attr("target") == "aten.matmul.default"]
    assert len(matmuls) == 2 * len(module.layers) and all(op.attr("rule") == "matmul" for op in matmuls)
    assert all(op.attr("rule") != "replicated" for op in ops), [(op.attr("target"), op.attr("rule")) for op in ops]
    rows, columns = out_layout(matmuls[0])[-2:]  # the scores: rows the sequence, columns a dim of their own
    assert rows == (tm.graph.seq_dim,) and len(columns) == 1 and columns != rows, out_layout(matmuls[0])
    assert_same_as_module(tm, module, inputs)
    plan = compile_graph(tm.graph, CompileOptions(mesh=Mesh.parse("1x1x1x2x1")))
    loss = next(op for op, _ in walk_ops(plan.graph.body) if isinstance(op, Op) and op.kind == "cross_entropy")
    assert loss.arg_sharding(0).axes_of(tm.graph.seq_dim), loss  # the residual `out + x` takes x's split
    # cp2 and a pipeline of microbatches: the matmuls of test_a_baddbmm_is_a_matmul_and_pointwise_ops
    for mesh, zero in (("2x1x2x1x1", 3),):
        report = check_module(f"{MODELS}:relu_squared", mesh=mesh, steps=2, dtype="fp64", pool=worker_pool, zero=zero)
        assert report.max_error <= 1e-10, (mesh, report)


def test_a_matmul_on_shards_must_keep_its_columns_apart_from_its_rows(tmp_path) -> None:
    """A plan whose matmul names the scores' columns by the sequence, as their rows, would split
    both over cp and compute only the diagonal blocks: such a plan is refused when loaded."""
    from replicated_models import relu_squared

    plan = compile_graph(trace_module(*relu_squared()).graph, CompileOptions(mesh=Mesh.parse("1x1x1x2x1")))
    path = tmp_path / "p.plan.json"
    plan.save(path)
    load_plan(path)
    data = json.loads(path.read_text())
    op = next(item for item in _plan_items(data["graph"]["body"])
              if ["target", "aten.matmul.default"] in item.get("attrs", []))
    out = next(attr for attr in op["attrs"] if attr[0] == "out")
    rows = out[1].split(",")[-2]
    out[1] = out[1].rsplit(",", 1)[0] + "," + rows  # the columns named as the rows
    path.write_text(json.dumps(data))
    with pytest.raises(FivedcError) as info:
        load_plan(path)
    assert info.value.exit_code == 2 and "line up" in info.value.render(), info.value.render()


def _plan_items(block: dict):
    """The ops of a plan file's block, those inside repeats too."""
    for item in block["items"]:
        yield from _plan_items(item["body"]) if "body" in item else (item,)


def test_a_plan_may_cut_constants_only_along_the_dims_they_span(tmp_path) -> None:
    """`rows` names the result dims where a pointwise op's constants are cut to the shards'
    rows: only among the dims the constants span (`along`); any other is refused."""
    from replicated_models import rotated_pairs

    plan = compile_graph(trace_module(*rotated_pairs()).graph, CompileOptions(mesh=Mesh.parse("1x1x1x2x1")))
    path = tmp_path / "p.plan.json"
    plan.save(path)
    load_plan(path)
    data = json.loads(path.read_text())
    for rows, why in (("0", "among `along`"), ("1,x", "among `along`")):
        edited = json.loads(json.dumps(data))
        op = next(item for item in _plan_items(edited["graph"]["body"]) if ["rows", "1,2"] in item.get("attrs", []))
        op["attrs"][op["attrs"].index(["rows", "1,2"])] = ["rows", rows]
        path.write_text(json.dumps(edited))
        with pytest.raises(FivedcError) as info:
            load_plan(path)
        assert info.value.exit_code == 2 and why in info.value.render(), info.value.render()


def test_a_tied_table_whose_uses_split_their_work_differently_trains(worker_pool) -> None:
    """The embedding splits the tokens over dp and cp; the head that shares its table reads them
    after an op that runs whole: the table's gradient is summed over dp and cp, the head's part
    kept on the first rank of each (`grad_once`), so it counts once, as on one device."""
    from replicated_models import tied_after_an_island

    module, inputs = tied_after_an_island()
    plan = compile_graph(trace_module(module, inputs).graph, CompileOptions(mesh=Mesh.parse("2x1x1x2x1")))
    (table,) = [p for p in plan.graph.body.params if p.name == "emb"]
    assert set(table.grad_partial) == {MeshAxis.DP, MeshAxis.CP}
    uses = [(op.kind, spec) for op, _ in walk_ops(plan.graph.body) if isinstance(op, Op)
            for arg, spec in zip(op.args, op.arg_specs) if arg == "emb"]
    assert sorted((kind, set(spec.grad_once)) for kind, spec in uses) == [
        ("embedding", set()), ("linear", {MeshAxis.DP, MeshAxis.CP})], uses
    for mesh, zero in (("2x1x1x2x1", 0), ("2x1x2x1x1", 0), ("2x1x1x1x1", 3)):
        report = check_module(f"{MODELS}:tied_after_an_island", mesh=mesh, steps=2, dtype="fp64", pool=worker_pool,
                              zero=zero)
        assert report.max_error <= 1e-10, (mesh, report)


def test_norms_without_weights_run_on_shards(worker_pool) -> None:
    """`F.layer_norm` and `F.rms_norm` without a weight have no IR op; they run along the dims they
    normalise (whole), on shards of the others, so nothing runs replicated under dp2·tp2 or cp2."""
    from replicated_models import weightless_norms

    module, inputs = weightless_norms()
    tm = trace_module(module, inputs)
    rules = {(str(op.attr("target")), str(op.attr("rule")), str(op.attr("along"))) for op in _islands(tm.graph)}
    assert {("aten.layer_norm.default", "along", "2"), ("aten.rms_norm.default", "along", "2")} <= rules, rules
    assert all(rule != "replicated" for _, rule, _ in rules), rules
    for mesh in ("2x1x2x1x1", "1x1x1x2x1"):
        report = check_module(f"{MODELS}:weightless_norms", mesh=mesh, steps=2, dtype="fp64", pool=worker_pool)
        assert report.max_error <= 1e-10, (mesh, report)


def test_an_index_by_evenly_spaced_constant_positions_is_a_slice() -> None:
    """`h[..., [1, 3, 5, ...]]` and `h[..., [-8, ..., -1]]` (Falcon's `fused[..., [-2], :]`) are the
    slices `h[..., 1::2]` and `h[..., 8:]`, which run on shards; `h[..., [0, 1, 4, ...]]` stays an
    index by a tensor (replicated). The model equals the module (slices along a dim train on every
    axis in the tests above)."""
    from replicated_models import picks_features

    module, inputs = picks_features()
    tm = trace_module(module, inputs)
    calls = sorted((str(op.attr("target")), op.attr("rule"), json.loads(str(op.attr("call")))["args"][1:])
                   for op in _islands(tm.graph) if str(op.attr("target")) != "aten.cat.default")
    assert calls == [("aten.index.Tensor", "replicated", [[None, None, {"constant": [0, 1, 4, 6, 8, 9, 12, 15],
                                                                         "dtype": "int64"}]]),
                     ("aten.slice.Tensor", "along", [2, 1, 16, 2]), ("aten.slice.Tensor", "along", [2, 8, 16, 1])]
    assert_same_as_module(tm, module, inputs)


def test_norms_with_computed_weights_run_on_shards(worker_pool) -> None:
    """`F.layer_norm(x, shape, 1 + w, 2 * b)` and `F.rms_norm(x, shape, 1 - w)` (a weight computed
    from a parameter, not the parameter: Nemotron's) are the norm without them, times the weight,
    plus the bias: the norm along its dims and the product and sum pointwise, nothing replicated;
    the parameters' gradients flow through the computed weights, under dp2·tp2 as on one device."""
    from replicated_models import computed_norm_weights

    module, inputs = computed_norm_weights()
    tm = trace_module(module, inputs)
    rules = {(str(op.attr("target")), str(op.attr("rule"))) for op in _islands(tm.graph)}
    assert {("aten.layer_norm.default", "along"), ("aten.rms_norm.default", "along")} <= rules, rules
    assert all(rule != "replicated" for _, rule in rules), rules
    assert all(op.attr("call").count('"tensor"') == 1 for op in _islands(tm.graph) if "norm" in str(op.attr("target")))
    assert_same_as_module(tm, module, inputs)
    report = check_module(f"{MODELS}:computed_norm_weights", mesh="2x1x2x1x1", steps=2, dtype="fp64",
                          pool=worker_pool)
    assert report.max_error <= 1e-10, report


def test_a_baddbmm_is_a_matmul_and_pointwise_ops(worker_pool) -> None:
    """`baddbmm(bias, q, k^T, beta=, alpha=)` (BLOOM's ALiBi scores) is `beta * bias + alpha *
    (q @ k^T)`: the product a matmul on shards, the bias (a constant [batch x heads, seq, seq]
    table, alike in every batch row) added pointwise with its rows cut to the rank's heads,
    positions and batch rows; nothing runs replicated or gathered, and the model trains as on
    one device under pp2·tp2 in two microbatches (the sequence's rows under cp:
    test_a_table_a_cat_and_an_expand_run_on_shards_and_per_microbatch)."""
    from replicated_models import alibi

    module, inputs = alibi()
    tm = trace_module(module, inputs)
    ops = _islands(tm.graph)
    assert not [op for op in ops if "baddbmm" in str(op.attr("target"))]
    assert sum(op.attr("rule") == "matmul" for op in ops) == 2 * len(module.layers)
    assert all(op.attr("rule") != "replicated" for op in ops), [(op.attr("target"), op.attr("rule")) for op in ops]
    penalties = [op for op in ops if op.attr("target") == "aten.add.Tensor"]
    assert len(penalties) == len(module.layers) and all(op.attr("rows") == "0,1,2" for op in penalties)
    assert_same_as_module(tm, module, inputs)
    plan = compile_graph(tm.graph, CompileOptions(mesh=Mesh.parse("2x1x2x1x1")))
    assert not [c for op, _ in walk_ops(plan.graph.body) if isinstance(op, Op) for c in op.collectives
                if c.kind.name == "ALL_GATHER"]  # the batch and the heads keep their split
    report = check_module(f"{MODELS}:alibi", mesh="1x2x2x1x1", steps=2, dtype="fp64", pool=worker_pool,
                          microbatches=2)
    assert report.max_error <= 1e-10, report


def test_a_constant_that_differs_between_batch_rows_is_seen_whole(worker_pool) -> None:
    """A constant that differs from one batch row to the next cannot be cut to a microbatch's
    rows (a microbatch does not know which rows it holds): its op sees the batch whole, so a
    pipeline of microbatches is refused at its line, dp2 gathers the batch there and trains as
    on one device; a plan that cuts it anyway stops at the op instead of computing a wrong sum."""
    import dataclasses

    from fivedc.runtime.aten_kernel import aten_kernel
    from fivedc.runtime.kernel_context import KernelContext
    from replicated_models import per_row_alibi

    module, inputs = per_row_alibi()
    tm = trace_module(module, inputs)
    penalties = [op for op in _islands(tm.graph) if op.attr("target") == "aten.add.Tensor"]
    assert penalties and all(op.attr("rows") == "1,2" for op in penalties)
    assert_same_as_module(tm, module, inputs)
    with pytest.raises(NotSupportedError, match="sees the whole batch") as info:
        compile_graph(tm.graph, CompileOptions(mesh=Mesh.parse("1x2x1x1x1"), microbatches=2))
    assert "replicated_models.py" in info.value.render()
    mesh = Mesh.parse("2x1x1x1x1")
    plan = compile_graph(tm.graph, CompileOptions(mesh=mesh))
    op = next(op for op, _ in walk_ops(plan.graph.body) if isinstance(op, Op) and op.out == penalties[0].out)
    cut = dataclasses.replace(op, attrs=tuple((k, "0,1,2" if k == "rows" else v) for k, v in op.attrs))
    scores = tuple(d for group in arg_layouts(op)[0] for d in group)
    local = [1 if d == plan.graph.batch_dim else plan.graph.dim(d) for d in scores]
    with pytest.raises(FivedcError, match="differs between batch rows"):
        aten_kernel(KernelContext(plan.graph, mesh, mesh.coords(1)), cut, [torch.zeros(local, dtype=torch.float64)],
                    [scores])
    report = check_module(f"{MODELS}:per_row_alibi", mesh="2x1x1x1x1", steps=2, dtype="fp64", pool=worker_pool)
    assert report.max_error <= 1e-10, report


def test_positions_at_an_offset_repeated_over_the_batch_are_rows_of_the_table(worker_pool) -> None:
    """`embedding(arange(seq).expand(batch, seq) + 2)` (OPT's learned positions): rows 2..seq+1 of
    the table (a slice along its rows), read once and broadcast over the batch where every use
    adds it to a tensor of the whole shape, so nothing runs replicated (a pipeline can run it per
    microbatch) and dp2·cp2 trains as one device; read another way (summed over the batch) it
    runs replicated, still exact."""
    from replicated_models import offset_positions

    module, inputs = offset_positions()
    tm = trace_module(module, inputs)
    ops = _islands(tm.graph)
    assert [(str(op.attr("target")), op.attr("rule"), json.loads(str(op.attr("call")))["args"][1:]) for op in ops] \
        == [("aten.slice.Tensor", "along", [0, 2, 10])]
    assert_same_as_module(tm, module, inputs)
    report = check_module(f"{MODELS}:offset_positions", mesh="2x1x1x2x1", steps=2, dtype="fp64", pool=worker_pool)
    assert report.max_error <= 1e-10, report
    module, inputs = offset_positions(twice=True)
    tm = trace_module(module, inputs)
    assert [str(op.attr("target")) for op in _islands(tm.graph) if op.attr("rule") == "replicated"] \
        == ["aten.embedding.default"]
    assert_same_as_module(tm, module, inputs)
