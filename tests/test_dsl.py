"""Tests of the DSL frontend: the examples lower to the exact IR contract, and each user error
is a `DslError` with the right message at the right line:col.

The lowering contract checked here (SSA names, repeat carried/args/yields/results, nested-call
temporaries, locations, attrs as written, annotations) is what the passes rely on. Error
positions are found with `_at`, the 1-based line and column of a marker in the source.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from fivedc.errors import DslError, FivedcError
from fivedc.frontend_dsl import load_model, parse_model
from fivedc.ir import Annotation, DType, Graph, Op, Param, Repeat, TensorType, walk_ops

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
        "  input t: float[b, s, h]\n  param w: [h, h]\n" + body + "\n}\n"
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
