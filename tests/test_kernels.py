"""Kernels against torch's own functions, on one process, in float64.

The equivalence tests compare sharded runs with the same kernels unsharded; these
check that the unsharded kernels compute what their names say, and that the
vocab-split embedding's shards sum to the full lookup.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fivedc.ir.graph import ArgSpec, Graph, Block, Op, TensorType
from fivedc.ir.mesh import Mesh, MeshAxis
from fivedc.runtime.kernel_context import KernelContext
from fivedc.runtime.kernels import KERNELS
from fivedc.ir.sharding import Sharding

DIMS = (("b", 2), ("s", 6), ("h", 3), ("kv", 1), ("d", 4), ("v", 8), ("e", 5))
GRAPH = Graph("k", DIMS, (), Block(), batch_dim="b", seq_dim="s")


def ctx(mesh: str = "1x1x1x1x1", rank: int = 0) -> KernelContext:
    m = Mesh.parse(mesh)
    return KernelContext(GRAPH, m, m.coords(rank))


def op(kind: str, out_dims: tuple[str, ...], specs=(), **attrs) -> Op:
    return Op("y", kind, (), tuple(attrs.items()), type=TensorType(out_dims), arg_specs=specs)


def test_rmsnorm_and_layernorm() -> None:
    x, w, b = torch.randn(2, 6, 5, dtype=torch.float64), torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    got = KERNELS["rmsnorm"](ctx(), op("rmsnorm", ("b", "s", "e"), eps=1e-6), [x, w], [("b", "s", "e"), ("e",)])
    torch.testing.assert_close(got, F.rms_norm(x, (5,), w, eps=1e-6))
    got = KERNELS["layernorm"](ctx(), op("layernorm", ("b", "s", "e")), [x, w, b], [("b", "s", "e"), ("e",), ("e",)])
    torch.testing.assert_close(got, F.layer_norm(x, (5,), w, b, 1e-5))


def test_rmsnorm_and_swiglu_gradients_match_torch() -> None:
    """The two kernels with their own backward (they save only their inputs and rstd)
    against autograd through torch's functions, in float64."""
    x, w = torch.randn(2, 6, 5, dtype=torch.float64, requires_grad=True), torch.randn(5, dtype=torch.float64, requires_grad=True)
    gate, up = (torch.randn(2, 6, 5, dtype=torch.float64, requires_grad=True) for _ in range(2))
    for kind, args, expected in (
        ("rmsnorm", [x, w], lambda: F.rms_norm(x, (5,), w, eps=1e-6)),
        ("swiglu", [gate, up], lambda: F.silu(gate) * up),
    ):
        got = KERNELS[kind](ctx(), op(kind, ("b", "s", "e"), eps=1e-6), args, [("b", "s", "e")] * 2)
        grad = torch.randn_like(got)
        ours = torch.autograd.grad(got, args, grad)
        theirs = torch.autograd.grad(expected(), args, grad)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b)


def test_norms_over_the_trailing_dims_of_their_weight() -> None:
    """A weight [h, d] normalises x [b, s, h, d] over both (OLMo 2's q_norm before the view into
    heads), gradients included, as torch's norms over the last two dims."""
    x = torch.randn(2, 6, 3, 4, dtype=torch.float64, requires_grad=True)
    w, b = (torch.randn(3, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    dims = [("b", "s", "h", "d"), ("h", "d"), ("h", "d")]
    for kind, args, expected in (
        ("rmsnorm", [x, w], lambda: F.rms_norm(x, (3, 4), w, eps=1e-6)),
        ("layernorm", [x, w, b], lambda: F.layer_norm(x, (3, 4), w, b, 1e-6)),
    ):
        got = KERNELS[kind](ctx(), op(kind, ("b", "s", "h", "d"), eps=1e-6), args, dims[:len(args)])
        torch.testing.assert_close(got, expected())
        grad = torch.randn_like(got)
        for ours, theirs in zip(torch.autograd.grad(got, args, grad), torch.autograd.grad(expected(), args, grad)):
            torch.testing.assert_close(ours, theirs)


def test_attention_gqa_matches_explicit_softmax() -> None:
    q = torch.randn(2, 6, 3, 4, dtype=torch.float64)
    k, v = torch.randn(2, 6, 1, 4, dtype=torch.float64), torch.randn(2, 6, 1, 4, dtype=torch.float64)
    got = KERNELS["attention"](ctx(), op("attention", ("b", "s", "h", "d"), causal=True), [q, k, v], [None] * 3)
    scores = torch.einsum("bqhd,bkd->bhqk", q, k[:, :, 0]) / math.sqrt(4)
    scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    expected = torch.einsum("bhqk,bkd->bqhd", scores.softmax(-1), v[:, :, 0])
    torch.testing.assert_close(got, expected)


def test_rope_rotates_pairs_by_position() -> None:
    x = torch.randn(2, 6, 3, 4, dtype=torch.float64)
    got = KERNELS["rope"](ctx(), op("rope", ("b", "s", "h", "d"), theta=100.0), [x], [("b", "s", "h", "d")])
    half = 2
    freqs = 100.0 ** (-torch.arange(half, dtype=torch.float64) / half)
    angle = torch.arange(6, dtype=torch.float64)[:, None] * freqs
    z = torch.complex(x[..., :half], x[..., half:]) * torch.polar(torch.ones_like(angle), angle)[None, :, None, :]
    torch.testing.assert_close(got, torch.cat((z.real, z.imag), -1))
    assert torch.allclose(got.norm(dim=-1), x.norm(dim=-1))  # a rotation


def test_cross_entropy_is_the_global_token_mean() -> None:
    logits, targets = torch.randn(2, 6, 8, dtype=torch.float64), torch.randint(0, 8, (2, 6))
    got = KERNELS["cross_entropy"](ctx(), op("cross_entropy", ()), [logits, targets], [("b", "s", "v"), ("b", "s")])
    torch.testing.assert_close(got, F.cross_entropy(logits.reshape(-1, 8), targets.reshape(-1)))


CLASS_WEIGHTS = torch.linspace(0.5, 2.0, 8, dtype=torch.float64)
LOSS_FORMS = [  # the op's attrs, torch's keywords
    ({"ignore_index": 3, "reduction": "sum"}, {"ignore_index": 3, "reduction": "sum"}),
    ({"ignore_index": 3, "label_smoothing": 0.3}, {"ignore_index": 3, "label_smoothing": 0.3}),
    ({"ignore_index": 3, "weight": ",".join(map(repr, CLASS_WEIGHTS.tolist()))}, {"ignore_index": 3, "weight": CLASS_WEIGHTS}),
    ({"weight": ",".join(map(repr, CLASS_WEIGHTS.tolist())), "label_smoothing": 0.3, "reduction": "sum"},
     {"weight": CLASS_WEIGHTS, "label_smoothing": 0.3, "reduction": "sum"}),
]


@pytest.mark.parametrize("attrs, keywords", LOSS_FORMS)
def test_cross_entropy_in_each_form_is_torchs(attrs: dict, keywords: dict) -> None:
    torch.manual_seed(0)
    logits, targets = torch.randn(2, 6, 8, dtype=torch.float64), torch.randint(0, 8, (2, 6))
    targets[0, :2] = 3
    got = KERNELS["cross_entropy"](ctx(), op("cross_entropy", (), **attrs), [logits, targets], [("b", "s", "v"), ("b", "s")])
    torch.testing.assert_close(got, F.cross_entropy(logits.reshape(-1, 8), targets.reshape(-1), **keywords))


@pytest.mark.parametrize("attrs, keywords", LOSS_FORMS)
def test_vocab_parallel_cross_entropy_forward_and_backward_are_torchs(attrs: dict, keywords: dict) -> None:
    """The vocab-parallel function itself (its all-reduces over a group of one): the loss and the
    logits' gradient of each form, smoothing and weights folded into its three all-reduces."""
    import torch.distributed as dist

    from fivedc.runtime.loss import _VocabParallelCrossEntropy, class_weights

    torch.manual_seed(0)
    logits, targets = torch.randn(12, 8, dtype=torch.float64, requires_grad=True), torch.randint(0, 8, (12,))
    targets[:3] = 3
    counted = (targets != attrs.get("ignore_index", -100)).double()
    weight = class_weights(op("cross_entropy", (), **attrs), 8, torch.float64, "cpu")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        total = _VocabParallelCrossEntropy.apply(logits * 1, targets, counted, 0, dist.group.WORLD,
                                                 float(attrs.get("label_smoothing", 0.0)), weight)
        (got,) = torch.autograd.grad(total, logits)
    finally:
        dist.destroy_process_group()
    want = F.cross_entropy(logits, targets, **(keywords | {"reduction": "sum"}))
    torch.testing.assert_close(total, want)
    torch.testing.assert_close(got, torch.autograd.grad(want, logits)[0])


def test_linear_contracts_named_dims() -> None:
    a, w = torch.randn(2, 6, 3, 4, dtype=torch.float64), torch.randn(3, 4, 5, dtype=torch.float64)
    got = KERNELS["linear"](ctx(), op("linear", ("b", "s", "e")), [a, w], [("b", "s", "h", "d"), ("h", "d", "e")])
    torch.testing.assert_close(got, torch.einsum("bshd,hde->bse", a, w))


def test_vocab_split_embedding_shards_sum_to_the_full_lookup() -> None:
    table, tokens = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 8, (2, 6))
    spec = (ArgSpec(Sharding()), ArgSpec(Sharding.of(v=(MeshAxis.TP,))))
    total = sum(
        KERNELS["embedding"](ctx("1x1x4x1x1", r), op("embedding", ("b", "s", "e"), spec),
                             [tokens, table[2 * r: 2 * r + 2]], [("b", "s"), ("v", "e")])
        for r in range(4)
    )
    torch.testing.assert_close(total, F.embedding(tokens, table))
