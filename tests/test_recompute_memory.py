"""The activation estimate under recomputation, against the published formulas.

Megatron ("Reducing Activation Recomputation in Large Transformer Models", Korthikanti
et al. 2022): full recomputation keeps each layer's input, 2·s·b·h bytes in 16-bit
training (divided by t when sequence parallelism splits it over tp); selective
recomputation drops what the attention core keeps inside. In the paper that is the
5·a·s²·b term of a kernel that materialises the scores; fivedc's attention is
flash-style, so what it keeps inside is the log-sum-exp (4·a·s·b bytes in float32,
/t under tp) and, for grouped-query attention at cp = 1, K and V repeated to every
query head (2 x 2·s·b·h bytes, /t). The per-layer figures are taken as differences
between plans of L and L' layers (everything outside the layers cancels), so they
test the estimate against the formula, not against itself; the kernel's internals are
also measured with saved-tensor hooks.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from fivedc.activations import attention_inner_bytes
from fivedc.frontend_dsl import parse_model
from fivedc.ir import Op, walk_ops
from fivedc.mesh import Mesh
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from fivedc.runtime.kernels import KERNELS, KernelContext
from random_models import model_text


def activations(*, layers: int, recompute: str, mesh: str = "2x1x4x1x1", sp: bool = True, seq: int = 64,
                heads: int = 8, kv_heads: int = 8, dtype: str = "bf16", style: str = "gpt", **options) -> int:
    text = model_text(style=style, batch=4, seq=seq, heads=heads, kv_heads=kv_heads, head_dim=16, ffn=256,
                      vocab=64, layers=layers, causal=True)
    plan = compile_graph(parse_model(text, filename="m.5d"),
                         CompileOptions(mesh=Mesh.parse(mesh), sequence_parallel=sp, dtype=dtype,
                                        recompute=recompute, **options))
    return plan.memory.activations


S, B, HEADS, HEAD_DIM = 64, 4, 8, 16
H = HEADS * HEAD_DIM


@pytest.mark.parametrize("sp,t", [(True, 4), (False, 4), (False, 1)])
def test_full_recompute_keeps_2sbh_per_layer(sp: bool, t: int) -> None:
    """Megatron's full recomputation: 2·s·b·h bytes per layer (b: a dp rank's batch),
    /t with sequence parallelism, the whole of it without."""
    mesh = f"2x1x{t}x1x1"
    per_layer = activations(layers=5, recompute="full", mesh=mesh, sp=sp) - \
        activations(layers=2, recompute="full", mesh=mesh, sp=sp)
    b = B // 2
    assert per_layer == 3 * 2 * S * b * H // (t if sp else 1)


def test_full_recompute_adds_one_layer_while_its_backward_runs() -> None:
    """Full = everything outside the layers + L x the layer input + one whole layer
    (its recomputed activations, alive during its backward)."""
    none = [activations(layers=n, recompute="none") for n in (3, 4)]
    layer = none[1] - none[0]  # one layer's activations when nothing is recomputed
    outside = none[0] - 3 * layer
    kept = 2 * S * (B // 2) * H // 4
    assert activations(layers=3, recompute="full") == outside + 3 * kept + layer


@pytest.mark.parametrize("style,kv_heads", [("gpt", 8), ("llama", 4)])
def test_selective_drops_the_attention_internals(style: str, kv_heads: int) -> None:
    """Per layer, none - selective = what the flash-style attention keeps inside:
    the float32 log-sum-exp, 4·a·s·b/t bytes, plus for grouped-query attention K and V
    repeated to all a heads, 2 x 2·s·b·h/t bytes. One attention's come back while its
    backward runs, so L layers save L - 1 of them."""
    t, b = 4, B // 2
    inner = 4 * HEADS * S * b // t + (2 * 2 * S * b * H // t if kv_heads < HEADS else 0)
    for layers in (1, 3):
        none = activations(layers=layers, recompute="none", style=style, kv_heads=kv_heads)
        selective = activations(layers=layers, recompute="selective", style=style, kv_heads=kv_heads)
        assert none - selective == (layers - 1) * inner


def test_no_attention_term_grows_with_s_squared() -> None:
    """Megatron's 5·a·s²·b (scores, softmax, dropout) has no counterpart: the kernel
    never holds an s x s matrix, so a layer's count is linear in s."""
    per_layer = {s: activations(layers=2, recompute="none", seq=s) - activations(layers=1, recompute="none", seq=s)
                 for s in (64, 128)}
    assert per_layer[128] == 2 * per_layer[64]


@settings(max_examples=8, deadline=None)
@given(heads=st.sampled_from([2, 4]), group=st.sampled_from([1, 2]), dtype=st.sampled_from(["fp32", "bf16"]),
       seq=st.sampled_from([8, 16]))
def test_the_attention_internals_are_what_the_kernel_saves(heads: int, group: int, dtype: str, seq: int) -> None:
    """Measured: the bytes the runtime's attention kernel saves for backward beyond its
    inputs and output (new storages seen by a saved-tensor hook) equal
    `attention_inner_bytes`, with and without grouped-query attention."""
    text = model_text(style="llama", batch=2, seq=seq, heads=heads * group, kv_heads=heads, head_dim=8, ffn=16,
                      vocab=16, layers=1, causal=True)
    plan = compile_graph(parse_model(text, filename="m.5d"), CompileOptions(mesh=Mesh.parse("1x1x1x1x1"), dtype=dtype))
    op = next(node for node, _ in walk_ops(plan.graph.body) if isinstance(node, Op) and node.kind == "attention")
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    shapes = {"q": (2, seq, heads * group, 8), "kv": (2, seq, heads, 8)}
    q, k, v = (torch.randn(shapes[n], dtype=torch_dtype, requires_grad=True) for n in ("q", "kv", "kv"))
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    ctx = KernelContext(plan.graph, plan.mesh, plan.mesh.coords(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = KERNELS["attention"](ctx, op, [q, k, v], [("batch", "seq", "heads", "head_dim")] * 3)
    known = {t.untyped_storage().data_ptr() for t in (q, k, v, out)}
    inner = sum(n for ptr, n in saved.items() if ptr not in known)
    dtype_bytes = 4 if dtype == "fp32" else 2
    assert inner == attention_inner_bytes(plan.graph, op, plan.mesh, dtype=dtype, dtype_bytes=dtype_bytes,
                                          repeat=next(r for n, r in walk_ops(plan.graph.body) if n is op))
