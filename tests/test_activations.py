"""The activation estimate against Megatron's published counts, the schedules, and the kernels.

Megatron ("Reducing Activation Recomputation in Large Transformer Models", Korthikanti
et al. 2022, table 2) counts a GPT layer's activations in 16-bit training as
34·s·b·h/t bytes with tensor and sequence parallelism (10·s·b·h + 24·s·b·h/t without
SP), plus 5·a·s²·b/t for an attention that materialises its scores. fivedc's ops
differ in three places, each a term below: no dropout (Megatron keeps two masks of
s·b·h/t bytes), a flash-style attention (no s² term, but a float32 log-sum-exp per
query row: 4·a·s·b/t), and its norms keep float32 statistics per row (layernorm mean
and 1/std: 8·s·b/t). Per-layer figures are differences between plans of L and L'
layers, so everything outside the layers cancels: the test holds the estimate against
the formula, not against itself. The kernels' own saves are measured too (each
storage autograd keeps, parameters and inputs aside).
"""

from __future__ import annotations

import pytest
import torch

from fivedc.frontends.dsl_file import parse_model
from fivedc.ir.mesh import Mesh
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from fivedc.runtime.kernel_context import KernelContext
from fivedc.runtime.program import Program, init_params, make_inputs
from fivedc.runtime.saved import SavedRecorder, saving_scope
from random_models import model_text

S, B, A, HEAD_DIM = 64, 4, 8, 16
H = A * HEAD_DIM


def plan_of(*, layers: int, mesh: str = "1x1x4x1x1", sp: bool = True, style: str = "gpt", kv_heads: int = A,
            dtype: str = "bf16", recompute: str = "none", seq: int = S, batch: int = B, **options):
    text = model_text(style=style, batch=batch, seq=seq, heads=A, kv_heads=kv_heads, head_dim=HEAD_DIM, ffn=4 * H,
                      vocab=64, layers=layers, causal=True)
    return compile_graph(parse_model(text, filename="m.5d"),
                         CompileOptions(mesh=Mesh.parse(mesh), sequence_parallel=sp, dtype=dtype, recompute=recompute,
                                        **options))


def region(plan) -> int:
    """The largest recomputed region of one microbatch (the transient's recomputation part)."""
    from fivedc.estimates.memory import rank_activations

    _, regions = rank_activations(plan.graph, plan.mesh, dtype=plan.dtype, dtype_bytes=2, pipeline=plan.pipeline,
                                  recompute=plan.recompute)
    return max(regions)


def per_layer(category: str = "activations", **kw) -> int:
    return getattr(plan_of(layers=3, **kw).memory, category) - getattr(plan_of(layers=2, **kw).memory, category)


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_a_gpt_layer_keeps_megatrons_34sbh_over_t(t: int) -> None:
    """With sequence parallelism: 34·s·b·h/t, less the two dropout masks (2·s·b·h/t),
    plus the log-sum-exp (4·a·s·b/t) and two layernorms' statistics (2 x 8·s·b/t)."""
    megatron = 34 * S * B * H // t
    dropout_masks, lse, norm_stats = 2 * S * B * H // t, 4 * A * S * B // t, 2 * 8 * S * B // t
    assert per_layer(mesh=f"1x1x{t}x1x1", sp=t > 1) == megatron - dropout_masks + lse + norm_stats


def test_a_gpt_layer_without_sequence_parallelism() -> None:
    """Megatron's 10·s·b·h + 24·s·b·h/t: the norms' inputs and the inputs of the first
    linears of attention and MLP stay whole (2·s·b·h each), the dropout masks too
    (s·b·h each, absent here), as do the norms' statistics."""
    t = 4
    megatron = 10 * S * B * H + 24 * S * B * H // t
    assert per_layer(sp=False) == megatron - 2 * S * B * H + 4 * A * S * B // t + 2 * 8 * S * B


def test_tensor_and_sequence_parallel_activations_are_1_over_t() -> None:
    """TP8 with SP keeps exactly 1/8 of TP1's activations per layer."""
    assert per_layer(mesh="1x1x8x1x1", sp=True) * 8 == per_layer(mesh="1x1x1x1x1", sp=False)


def test_no_term_grows_with_s_squared() -> None:
    """Megatron's 5·a·s²·b (scores, softmax, dropout) has no counterpart: the kernel never
    holds an s x s matrix, so a layer's count is linear in s."""
    assert per_layer(seq=128) == 2 * per_layer(seq=64)


def test_grouped_query_attention_keeps_k_and_v_once() -> None:
    """K and V are not repeated to every query head (SDPA's enable_gqa): a layer with
    a/2 kv heads keeps half of K and V less, 2 x 2·s·b·h/t / 2 bytes."""
    t = 4
    full, grouped = per_layer(style="llama", kv_heads=A), per_layer(style="llama", kv_heads=A // 2)
    assert full - grouped == 2 * 2 * S * B * H // t // 2


def test_selective_recomputation_drops_the_log_sum_exp() -> None:
    """Selective keeps q, k, v (checkpoint holds them) and rebuilds the attention's own
    buffer in backward: per layer 4·a·s·b/t less, and one layer's comes back while its
    backward runs (the transient)."""
    lse = 4 * A * S * B // 4  # t = 4
    assert per_layer() - per_layer(recompute="selective") == lse
    assert region(plan_of(layers=3, recompute="selective")) == lse


@pytest.mark.parametrize("sp,t", [(True, 4), (False, 4), (False, 1)])
def test_full_recomputation_keeps_2sbh_per_layer(sp: bool, t: int) -> None:
    """Megatron's full recomputation: each layer keeps its input, 2·s·b·h bytes (/t
    under SP); while one layer's backward runs its activations come back (transient):
    one layer's count less the input it already keeps, and under SP the two gathered
    linear inputs whole (inside the recomputed region they are not gathered again)."""
    mesh, split = f"1x1x{t}x1x1", t if sp else 1
    assert per_layer(mesh=mesh, sp=sp, recompute="full") == 2 * S * B * H // split
    layer, gathered = per_layer(mesh=mesh, sp=sp), 2 * (2 * S * B * H - 2 * S * B * H // split)
    assert region(plan_of(layers=2, mesh=mesh, sp=sp, recompute="full")) == layer - 2 * S * B * H // split + gathered


def test_allgather_context_parallelism_keeps_the_gathered_k_and_v() -> None:
    """Ring attention keeps this rank's K/V block; all-gather attention keeps K and V of
    the whole sequence: (cp - 1)/cp of 2 x 2·s·b·h more per layer (MHA, bf16)."""
    cp = 4
    ring = per_layer(mesh=f"1x1x1x{cp}x1", sp=False, cp_attention="ring")
    gathered = per_layer(mesh=f"1x1x1x{cp}x1", sp=False, cp_attention="allgather")
    assert gathered - ring == 2 * 2 * S * B * H * (cp - 1) // cp
    assert ring * cp == per_layer(mesh="1x1x1x1x1", sp=False)  # the sequence splits everything


@pytest.mark.parametrize("p,m", [(4, 16), (2, 8)])
def test_gpipe_holds_every_microbatch_and_1f1b_pp_of_them(p: int, m: int) -> None:
    """GPipe m=16 on pp=4 holds all 16 microbatches at stage 0, 1F1B holds 4 (p):
    the same chunks, so the activations differ by exactly that factor."""
    kw = dict(layers=2 * p, mesh=f"1x{p}x1x1x1", sp=False, microbatches=m, batch=m)
    gpipe = plan_of(schedule="gpipe", **kw).memory.of_pp_rank(0, p).activations
    one_f = plan_of(schedule="1f1b", **kw).memory.of_pp_rank(0, p).activations
    assert gpipe * p == one_f * m


@pytest.mark.parametrize("style", ["gpt", "llama"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_the_kernels_keep_what_the_rules_say(style: str, recompute: str) -> None:
    """Measured on one device in float32: every storage autograd keeps for backward (and
    checkpoint's region inputs), parameters and inputs aside, is the estimate."""
    text = model_text(style=style, batch=2, seq=16, heads=4, kv_heads=2, head_dim=8, ffn=64, vocab=32, layers=2,
                      causal=True)
    plan = compile_graph(parse_model(text, filename="m.5d"),
                         CompileOptions(mesh=Mesh.parse("1x1x1x1x1"), dtype="fp32", recompute=recompute))
    params = {n: t.requires_grad_() for n, t in init_params(plan.graph, seed=0, dtype=torch.float32).items()}
    inputs = make_inputs(plan.graph, seed=0, dtype=torch.float32)
    recorder = SavedRecorder(exclude=[*params.values(), *inputs.values()])
    with saving_scope(recorder):
        Program(plan.graph, KernelContext(plan.graph, plan.mesh, plan.mesh.coords(0)), recompute=recompute).loss(
            params, inputs)
    assert recorder.bytes == plan.memory.activations
