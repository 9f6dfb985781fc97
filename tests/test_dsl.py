"""Tests of the DSL frontend: the examples lower to the exact IR contract, and each user error
is a `DslError` with the right message at the right line:col.

The lowering contract checked here (SSA names, repeat carried/args/yields/results, nested-call
temporaries, locations, attrs as written, annotations) is what the passes rely on. User errors
are in tests/test_dsl_errors.py, which shares the helpers below: `_at` is the 1-based line
and column of a marker in the source, `_model` a minimal frame around statements.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from fivedc.errors import DslError, FivedcError
from fivedc.frontends.dsl_file import load_model, parse_model
from fivedc.ir.graph import Annotation, DType, Graph, Op, Param, Repeat, TensorType, walk_ops

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# The language sample of the design, completed (w_head declared, the elided repeat written).
SAMPLE = """\
# comments run from '#' to the end of the line
model gpt @sp {
  dims {
    batch = 4
    seq = 16
    hidden = 64
    heads = 4
    kv_heads = 2
    head_dim = hidden / heads
    ffn = 4 * hidden
    vocab = 256
    layers = 2
  }
  input tokens: int[batch, seq]
  input targets: int[batch, seq]

  param wte: [vocab, hidden]
  param wpe: [seq, hidden] = normal(0.01)
  x = embedding(tokens, wte)
  x = add(x, wpe)

  repeat layers {
    param ln1: [hidden] = ones
    param wq: [hidden, heads, head_dim]
    param wk: [hidden, kv_heads, head_dim]
    param wv: [hidden, kv_heads, head_dim]
    param wo: [heads, head_dim, hidden]
    h = rmsnorm(x, ln1, eps=1e-6)
    q = rope(linear(h, wq) @col, theta=500000.0)
    k = rope(linear(h, wk))
    v = linear(h, wv)
    a = attention(q, k, v, causal=true) @cp(ring)
    x = add(x, linear(a, wo) @row)
  }
  repeat 3 as dense {
    param w1: [hidden, ffn]
    param w2: [ffn, hidden]
    x = add(x, linear(gelu(linear(x, w1)), w2))
    x = mul(x, 0.5)
  }
  param lnf: [hidden] = ones
  param bias: [vocab] = zeros
  param w_head: [hidden, vocab]
  logits = add(linear(rmsnorm(x, lnf), w_head), bias)
  loss = cross_entropy(logits, targets)
  return loss
}
"""


def _at(text: str, marker: str, nth: int = 0) -> tuple[int, int]:
    """1-based (line, col) of the `nth` occurrence of `marker` in `text`."""
    pos = -1
    for _ in range(nth + 1):
        pos = text.index(marker, pos + 1)
    line = text.count("\n", 0, pos) + 1
    return line, pos - (text.rfind("\n", 0, pos) + 1) + 1


def _error(text: str) -> DslError:
    with pytest.raises(DslError) as info:
        parse_model(text, filename="m.5d")
    assert type(info.value) is DslError
    return info.value


def _where(error: FivedcError) -> tuple[int, int]:
    assert error.loc is not None and error.loc.file == "m.5d"
    return error.loc.line, error.loc.col


def _model(body: str) -> str:
    """A minimal valid frame around `body` (dims b, s, h; input t; param w)."""
    return (
        "model m {\n  dims {\n    b = 2\n    s = 4\n    h = 8\n  }\n"
        "  input t: float[b, s, h]\n  param w: [h]\n" + body + "\n}\n"
    )


@pytest.fixture(scope="module")
def sample() -> Graph:
    return parse_model(SAMPLE, filename="sample.5d")


def _ops(items) -> dict[str, Op]:
    return {op.out: op for op in items if isinstance(op, Op)}


# ---- the sample: top level ------------------------------------------------------------
def test_sample_header(sample: Graph) -> None:
    assert sample.name == "gpt"
    assert sample.dims == (
        ("batch", 4), ("seq", 16), ("hidden", 64), ("heads", 4), ("kv_heads", 2),
        ("head_dim", 16), ("ffn", 256), ("vocab", 256), ("layers", 2),
    )
    assert [(i.name, i.type) for i in sample.inputs] == [
        ("tokens", TensorType(("batch", "seq"), DType.INT)),
        ("targets", TensorType(("batch", "seq"), DType.INT)),
    ]
    assert (sample.batch_dim, sample.seq_dim, sample.source) == ("batch", "seq", "sample.5d")
    assert [str(a) for a in sample.annotations] == ["@sp"]
    assert sample.annotations[0].loc.line == 2 and sample.annotations[0].loc.col == 11
    assert sample.body.args == () and sample.body.yields == ("loss",)
    assert (sample.loc.line, sample.loc.col) == (2, 1)
    assert sample.dim_loc("head_dim").line == 9 and sample.dim_loc("head_dim").col == 5


def test_sample_params(sample: Graph) -> None:
    top = {p.name: p for p in sample.body.params}
    assert list(top) == ["wte", "wpe", "lnf", "bias", "w_head"]
    assert top["wte"] == Param("wte", ("vocab", "hidden"), "normal", 0.02, top["wte"].loc)
    assert (top["wpe"].init, top["wpe"].std) == ("normal", 0.01)
    assert (top["lnf"].init, top["bias"].init) == ("ones", "zeros")
    assert top["wpe"].loc.line == 18 and top["wpe"].loc.col == 3
    assert top["wpe"].loc.text == "  param wpe: [seq, hidden] = normal(0.01)"
    layers = sample.body.items[2]
    assert [p.name for p in layers.body.params] == ["ln1", "wq", "wk", "wv", "wo"]
    assert layers.body.params[1].dims == ("hidden", "heads", "head_dim")


def test_sample_top_level_ssa(sample: Graph) -> None:
    items = sample.body.items
    assert [type(i).__name__ for i in items] == ["Op", "Op", "Repeat", "Repeat"] + ["Op"] * 4
    ops = [(o.out, o.kind, o.args) for o in items if isinstance(o, Op)]
    assert ops == [
        ("x", "embedding", ("tokens", "wte")),
        ("x.1", "add", ("x", "wpe")),  # a later assignment gets the next number
        ("rmsnorm#6", "rmsnorm", ("x.8", "lnf")),  # after the repeats: their result
        ("linear#7", "linear", ("rmsnorm#6", "w_head")),
        ("logits", "add", ("linear#7", "bias")),
        ("loss", "cross_entropy", ("logits", "targets")),
    ]


def test_sample_repeat_by_dim(sample: Graph) -> None:
    layers = sample.body.items[2]
    assert isinstance(layers, Repeat)
    assert (layers.name, layers.count) == ("layers", 2)
    assert (layers.carried, layers.body.args, layers.body.yields, layers.results) == (
        ("x.1",), ("x.2",), ("x.3",), ("x.4",),
    )
    assert (layers.loc.line, layers.loc.col) == (22, 3)
    body = [(o.out, o.kind, o.args, o.attrs) for o in layers.body.items]
    assert body == [
        ("h", "rmsnorm", ("x.2", "ln1"), (("eps", 1e-6),)),
        ("linear#0", "linear", ("h", "wq"), ()),
        ("q", "rope", ("linear#0",), (("theta", 500000.0),)),
        ("linear#1", "linear", ("h", "wk"), ()),
        ("k", "rope", ("linear#1",), ()),  # no default filled in
        ("v", "linear", ("h", "wv"), ()),
        ("a", "attention", ("q", "k", "v"), (("causal", True),)),
        ("linear#2", "linear", ("a", "wo"), ()),
        ("x.3", "add", ("x.2", "linear#2"), ()),
    ]


def test_sample_repeat_by_name(sample: Graph) -> None:
    dense = sample.body.items[3]
    assert (dense.name, dense.count, [p.name for p in dense.body.params]) == ("dense", 3, ["w1", "w2"])
    assert (dense.carried, dense.body.args, dense.body.yields, dense.results) == (
        ("x.4",), ("x.5",), ("x.7",), ("x.8",),
    )
    body = [(o.out, o.kind, o.args) for o in dense.body.items]
    assert body == [
        ("linear#3", "linear", ("x.5", "w1")),
        ("gelu#4", "gelu", ("linear#3",)),
        ("linear#5", "linear", ("gelu#4", "w2")),
        ("x.6", "add", ("x.5", "linear#5")),
        ("x.7", "mul", ("x.6", 0.5)),  # a number argument, stored as a float
    ]


def test_annotations_bind_to_their_call(sample: Graph) -> None:
    ops = _ops(sample.body.items[2].body.items)
    assert ops["linear#0"].annotations == (Annotation("col", (), ops["linear#0"].annotations[0].loc),)
    assert ops["q"].annotations == ()
    cp = ops["a"].annotation("cp")
    assert cp is not None and cp.args == ("ring",) and str(cp) == "@cp(ring)"
    assert (cp.loc.line, cp.loc.col) == _at(SAMPLE, "@cp")
    assert [a.kind for a in ops["linear#2"].annotations] == ["row"]
    assert ops["x.3"].annotations == ()


def test_op_locations(sample: Graph) -> None:
    ops = _ops(sample.body.items[2].body.items)
    assert (ops["q"].loc.line, ops["q"].loc.col) == _at(SAMPLE, "rope(linear")
    assert (ops["linear#0"].loc.line, ops["linear#0"].loc.col) == _at(SAMPLE, "linear(h, wq)")
    assert ops["q"].loc.text == "    q = rope(linear(h, wq) @col, theta=500000.0)"
    assert ops["q"].loc.file == "sample.5d"
    for node, _ in walk_ops(sample.body):
        assert node.loc is not None and node.loc.text.strip()
    for inp in sample.inputs:
        assert inp.loc is not None and inp.loc.text.lstrip().startswith("input")


def test_keyword_values_and_number_args() -> None:
    graph = parse_model(_model(
        '  y = moe(t, w, w, w, top_k=2, score="sigmoid", capacity_factor=1)\n'
        "  z = gelu(mul(y, 2), approximate=\"tanh\")\n"
        "  u = sub(z, -1.5e-3)\n"
        "  return u"
    ))
    ops = _ops(graph.body.items)
    assert ops["y"].attrs == (("top_k", 2), ("score", "sigmoid"), ("capacity_factor", 1.0))
    assert isinstance(ops["y"].attr("capacity_factor"), float)  # a float attr written as an int
    assert ops["mul#0"].args == ("y", 2.0) and isinstance(ops["mul#0"].args[1], float)
    assert ops["u"].args == ("z", -1.5e-3)
    assert ops["z"].attrs == (("approximate", "tanh"),)


def test_annotation_arguments() -> None:
    graph = parse_model(_model('  y = relu(t) @stage @cp("ring", true)\n  return y'))
    (op,) = graph.body.items
    assert [(a.kind, a.args) for a in op.annotations] == [("stage", ()), ("cp", ("ring", True))]


def test_stage_marks_bind_to_the_statement_and_to_the_repeat() -> None:
    """`@stage` marks the statement's first op (nested calls run first); a repeat's
    `@stage(...)` layers are kept sorted (errors: tests/test_stage_marks.py)."""
    text = _model("  x = relu(t)\n  repeat 4 as layers @stage(3, 1) {\n    x = add(x, w)\n  }\n"
                  "  y = relu(mul(x, 2.0)) @stage\n  return y")
    graph = parse_model(text, filename="m.5d")
    assert graph.body.items[1].stage_layers == (1, 3) and graph.body.items[1].body.items[0].annotations == ()
    ops = _ops(graph.body.items)
    (stage,) = ops["mul#0"].annotations
    assert stage.kind == "stage" and stage.args == () and (stage.loc.line, stage.loc.col) == _at(text, "@stage", 1)
    assert ops["y"].annotations == () and ops["x"].annotations == ()


# ---- repeat scoping ---------------------------------------------------------------------
def test_repeat_carries_in_first_assignment_order_and_reads_outer_names() -> None:
    graph = parse_model(_model(
        "  x = relu(t)\n  y = relu(t)\n  keep = relu(t)\n"
        "  repeat b {\n    y = add(y, keep)\n    tmp = relu(x)\n    x = add(tmp, y)\n  }\n"
        "  out = add(x, y)\n  return out"
    ))
    rep = graph.body.items[3]
    assert (rep.carried, rep.body.args, rep.body.yields, rep.results) == (
        ("y", "x"), ("y.1", "x.1"), ("y.2", "x.2"), ("y.3", "x.3"),
    )
    assert [(o.out, o.args) for o in rep.body.items] == [
        ("y.2", ("y.1", "keep")),  # `keep` is read, not carried: its outer name
        ("tmp", ("x.1",)),
        ("x.2", ("tmp", "y.2")),
    ]
    assert graph.body.items[4].args == ("x.3", "y.3")


def test_body_locals_get_graph_unique_names_and_stay_local() -> None:
    text = _model(
        "  x = relu(t)\n"
        "  repeat b { h = relu(x)\n x = add(x, h) }\n"
        "  repeat s { h = relu(x)\n x = add(x, h) }\n"
        "  y = relu(h)\n  return y"
    )
    error = _error(text)
    assert error.message == "undefined name 'h'"
    assert "inside repeat s" in error.hint
    assert _where(error) == _at(text, "h)\n  return")
    graph = parse_model(text.replace("y = relu(h)", "y = relu(x)"))
    first, second = graph.body.items[1], graph.body.items[2]
    assert [o.out for o in first.body.items] == ["h", "x.2"]
    assert [o.out for o in second.body.items] == ["h.1", "x.5"]
    assert second.carried == first.results == ("x.3",)
    names = [i.name for i in graph.inputs] + [o.out for o, _ in walk_ops(graph.body) if isinstance(o, Op)]
    names += [n for r in (first, second) for n in r.body.args + r.results]
    assert len(names) == len(set(names))


def test_body_params_are_local_and_may_repeat_across_bodies() -> None:
    graph = parse_model(_model(
        "  x = relu(t)\n"
        "  repeat b { param g: [h] = ones\n x = mul(x, g) }\n"
        "  repeat 3 as more { param g: [h] = zeros\n x = mul(x, g) }\n  return x"
    ))
    assert graph.body.params == (graph.body.params[0],) and graph.body.params[0].name == "w"
    assert [r.body.params[0].init for r in graph.body.items[1:]] == ["ones", "zeros"]
    assert graph.body.items[2].name == "more" and graph.body.items[2].count == 3
    error = _error(_model("  repeat b { param g: [h] = ones\n  y = mul(t, g) }\n  z = mul(t, g)\n  return z"))
    assert error.message == "undefined name 'g'"


# ---- the examples -------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gpt", "tiny_llama", "llama3_405b", "deepseek_v3"])
def test_examples_parse(name: str) -> None:
    path = EXAMPLES / f"{name}.5d"
    graph = load_model(str(path))
    assert graph.name == name and graph.source == str(path)
    assert (graph.batch_dim, graph.seq_dim, graph.output) == ("batch", "seq", "loss")
    assert [i.name for i in graph.inputs] == ["tokens", "targets"]
    assert graph.body.items[-1].kind == "cross_entropy"


def test_gpt_example() -> None:
    graph = load_model(EXAMPLES / "gpt.5d")
    dims = dict(graph.dims)
    assert {k: dims[k] for k in ("batch", "seq", "hidden", "heads", "kv_heads", "ffn", "vocab")} == {
        "batch": 4, "seq": 8, "hidden": 32, "heads": 4, "kv_heads": 4, "ffn": 128, "vocab": 64,
    }
    (layers,) = [r for r in graph.body.items if isinstance(r, Repeat)]
    assert layers.count == 2 and layers.carried == ("x.1",)
    kinds = [o.kind for o in layers.body.items]
    assert kinds.count("layernorm") == 2 and "gelu" in kinds and "attention" in kinds
    b_fc = next(o for o in layers.body.items if "b_fc" in o.args)
    assert b_fc.kind == "add" and b_fc.args[0].startswith("linear#")
    params = {p.name: p for p in layers.body.params}
    assert (params["b_fc"].dims, params["b_fc"].init, params["ln1_b"].init) == (("ffn",), "zeros", "zeros")
    assert {p.name for p in graph.body.params} == {"wte", "wpe", "lnf_w", "lnf_b", "w_head"}


def test_llama3_405b_example() -> None:
    graph = load_model(EXAMPLES / "llama3_405b.5d")
    dims = dict(graph.dims)
    assert (dims["hidden"], dims["heads"], dims["kv_heads"], dims["head_dim"]) == (16384, 128, 8, 128)
    assert (dims["ffn"], dims["vocab"], dims["layers"]) == (53248, 128256, 126)
    assert dims["batch"] * dims["seq"] == 2048 * 8192
    (layers,) = [r for r in graph.body.items if isinstance(r, Repeat)]
    assert layers.count == 126
    ropes = [o for o in layers.body.items if o.kind == "rope"]
    assert [o.attr("theta") for o in ropes] == [500000.0, 500000.0]
    assert {o.attr("eps") for o in layers.body.items if o.kind == "rmsnorm"} == {1e-5}
    assert any(o.kind == "swiglu" for o in layers.body.items)


def test_deepseek_v3_example() -> None:
    graph = load_model(EXAMPLES / "deepseek_v3.5d")
    dims = dict(graph.dims)
    assert (dims["hidden"], dims["heads"], dims["vocab"], dims["batch"], dims["seq"]) == (
        7168, 128, 129280, 15360, 4096,
    )
    dense, moe = [r for r in graph.body.items if isinstance(r, Repeat)]
    assert (dense.name, dense.count, moe.name, moe.count) == ("dense", 3, "moe", 58)
    assert moe.carried == dense.results
    (routed,) = [o for o in moe.body.items if o.kind == "moe"]
    assert routed.attrs == (("top_k", 8), ("score", "sigmoid"))
    params = {p.name: p.dims for p in moe.body.params}
    assert params["wq_b"] == ("q_lora", "heads", "qk_head_dim")
    assert params["wo"] == ("heads", "v_head_dim", "hidden")
    assert params["we_down"] == ("experts", "expert_ffn", "hidden")
    assert (dims["q_lora"], dims["kv_lora"], dims["qk_head_dim"], dims["v_head_dim"]) == (1536, 512, 192, 128)
    assert (dims["experts"], dims["expert_ffn"], dims["ffn"]) == (256, 2048, 18432)


def test_parse_is_fast_after_the_first_call() -> None:
    text = (EXAMPLES / "llama3_405b.5d").read_text()
    parse_model(text)
    start = time.perf_counter()
    parse_model(text)
    assert time.perf_counter() - start < 0.1


def _loss_model(keywords: str) -> str:
    return ("model m {\n  dims {\n    b = 2\n    s = 4\n    h = 8\n    v = 4\n  }\n"
            "  input tokens: int[b, s]\n  input targets: int[b, s]\n  param e: [v, h]\n  param w: [h, v]\n"
            f"  loss = cross_entropy(linear(embedding(tokens, e), w), targets{keywords})\n  return loss\n}}\n")


def test_cross_entropy_takes_reduction_label_smoothing_and_class_weights() -> None:
    from fivedc.ir.mesh import Mesh
    from fivedc.passes.base import CompileOptions
    from fivedc.pipeline import compile_graph

    text = _loss_model(', ignore_index=0, reduction="sum", label_smoothing=0.1, weight="1.0,2.0,0.5,1"')
    graph = parse_model(text, filename="m.5d")
    (loss,) = [op for op, _ in walk_ops(graph.body) if isinstance(op, Op) and op.kind == "cross_entropy"]
    assert loss.attrs == (("ignore_index", 0), ("reduction", "sum"), ("label_smoothing", 0.1),
                          ("weight", "1.0,2.0,0.5,1"))
    compile_graph(graph, CompileOptions(mesh=Mesh.parse("2x1x2x1x1"), dtype="fp64"))  # the proof agrees
    assert "label_smoothing takes a number" in _error(_loss_model(', label_smoothing="x"')).message


@pytest.mark.parametrize("keywords, message", [
    (', reduction="none"', "reduction is 'mean' or 'sum', got 'none'"),
    (', label_smoothing=1.5', "label_smoothing is between 0 and 1, got 1.5"),
    (', weight="1,2"', "weight has 2 numbers for 4 classes"),
])
def test_a_cross_entropy_the_plan_cannot_compute_is_an_error_at_its_call(keywords: str, message: str) -> None:
    from fivedc.ir.mesh import Mesh
    from fivedc.passes.base import CompileOptions
    from fivedc.pipeline import compile_graph

    text = _loss_model(keywords)
    with pytest.raises(FivedcError) as info:
        compile_graph(parse_model(text, filename="m.5d"), CompileOptions(mesh=Mesh.parse("1x1x1x1x1")))
    assert message in info.value.message
    assert (info.value.loc.file, info.value.loc.line) == ("m.5d", _at(text, "loss =")[0])
