"""Random small decoder models, written as DSL text, for the property tests.

`draw_case` draws a mesh (dp, tp with world <= 8) and a model whose dims fit it:
GPT-style (layernorm, gelu MLP with bias, learned positions) or Llama-style
(rmsnorm, rope, GQA, SwiGLU), with random layers, heads, kv-heads and widths.
`draw_cp_case` adds context parallelism (cp in {2, 4}) with its attention variant
and sequence layout, and sometimes a causal sliding window. `draw_moe_case` draws mixture-of-experts models (experts,
top-k, score, SwiGLU or GELU experts, a shared expert, balancing, capacity) on
meshes with ep in {2, 4} composed with dp and tp.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st


@dataclass(frozen=True)
class Case:
    text: str
    mesh: str
    sp: bool
    cp_attention: str | None = None
    cp_layout: str | None = None


def model_text(*, style: str, batch: int, seq: int, heads: int, kv_heads: int, head_dim: int,
               ffn: int, vocab: int, layers: int, causal: bool) -> str:
    norm = "layernorm(x, {w}, {w}_b)" if style == "gpt" else "rmsnorm(x, {w})"
    norm_params = "param {w}: [hidden] = ones\n    param {w}_b: [hidden] = zeros" if style == "gpt" else "param {w}: [hidden] = ones"
    if style == "gpt":
        qk = "q = linear(h, wq)\n    k = linear(h, wk)"
        mlp = "m = gelu(add(linear(h, w_up), b_up))"
        mlp_params = "param w_up: [hidden, ffn]\n    param b_up: [ffn] = zeros"
        pos = "param wpe: [seq, hidden]\n  x = add(x, wpe)"
    else:
        qk = "q = rope(linear(h, wq))\n    k = rope(linear(h, wk), theta=500.0)"
        mlp = "m = swiglu(linear(h, w_gate), linear(h, w_up))"
        mlp_params = "param w_gate: [hidden, ffn]\n    param w_up: [hidden, ffn]"
        pos = ""
    return f"""
model random_{style} {{
  dims {{
    batch = {batch}
    seq = {seq}
    heads = {heads}
    kv_heads = {kv_heads}
    head_dim = {head_dim}
    hidden = heads * head_dim
    ffn = {ffn}
    vocab = {vocab}
  }}
  input tokens: int[batch, seq]
  input targets: int[batch, seq]
  param wte: [vocab, hidden] = normal(0.5)
  x = embedding(tokens, wte)
  {pos}
  repeat {layers} as layers {{
    {norm_params.format(w="ln1")}
    param wq: [hidden, heads, head_dim] = normal(0.3)
    param wk: [hidden, kv_heads, head_dim] = normal(0.3)
    param wv: [hidden, kv_heads, head_dim] = normal(0.3)
    param wo: [heads, head_dim, hidden] = normal(0.3)
    h = {norm.format(w="ln1")}
    {qk}
    a = attention(q, k, linear(h, wv), causal={str(causal).lower()})
    x = add(x, linear(a, wo))
    {norm_params.format(w="ln2")}
    {mlp_params}
    param w_down: [ffn, hidden] = normal(0.3)
    h = {norm.format(w="ln2")}
    {mlp}
    x = add(x, linear(m, w_down))
  }}
  param lnf: [hidden] = ones
  param w_head: [hidden, vocab] = normal(0.3)
  loss = cross_entropy(linear(rmsnorm(x, lnf), w_head), targets)
  return loss
}}
"""


def _draw_dense(draw, *, dp: int, tp: int, seq_unit: int, seq_most: int, ffn_most: int, vocab_most: int) -> str:
    """A GPT- or Llama-style model whose dims fit dp and tp: heads and kv-heads split
    over tp, the sequence a multiple of `seq_unit`."""
    kv_heads = tp * draw(st.integers(1, 2))
    heads = kv_heads * draw(st.integers(1, 2))
    return model_text(
        style=draw(st.sampled_from(["gpt", "llama"])),
        batch=dp * draw(st.integers(1, 2)),
        seq=seq_unit * draw(st.integers(1, seq_most)),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=draw(st.sampled_from([4, 6])),  # hidden >= 4: layernorm over 2 features cancels gradients to noise
        ffn=tp * draw(st.integers(1, ffn_most)) * 2,
        vocab=tp * draw(st.integers(2, vocab_most)),
        layers=draw(st.integers(1, 2)),
        causal=draw(st.booleans()),
    )


@st.composite
def draw_case(draw, *, max_world: int = 8) -> Case:
    dp = draw(st.sampled_from([1, 2, 4]))
    tp = draw(st.sampled_from([t for t in (1, 2, 4) if dp * t <= max_world]))
    sp = draw(st.booleans()) if tp > 1 else False
    text = _draw_dense(draw, dp=dp, tp=tp, seq_unit=2 * tp, seq_most=3, ffn_most=4, vocab_most=6)
    return Case(text, f"{dp}x1x{tp}x1x1", sp)


@st.composite
def draw_cp_case(draw, *, max_world: int = 8) -> Case:
    cp = draw(st.sampled_from([2, 4]))
    dp = draw(st.sampled_from([d for d in (1, 2) if d * cp <= max_world]))
    tp = draw(st.sampled_from([t for t in (1, 2) if dp * cp * t <= max_world]))
    sp = draw(st.booleans()) if tp > 1 else False
    # the sequence: the balanced layout's 2*cp chunks, each split over tp
    text = _draw_dense(draw, dp=dp, tp=tp, seq_unit=2 * cp * tp, seq_most=2, ffn_most=3, vocab_most=5)
    window = draw(st.sampled_from([0, 0, 2, 3, 5]))  # a causal sliding window of that many keys (0: none)
    if window:
        text = text.replace("causal=true)", f"causal=true, window={window})")
    return Case(
        text, f"{dp}x1x{tp}x{cp}x1", sp,
        cp_attention=draw(st.sampled_from(["ring", "allgather"])),
        cp_layout=draw(st.sampled_from([None, "contiguous", "balanced"])),
    )


def moe_model_text(*, batch: int, seq: int, hidden: int, experts: int, expert_ffn: int, vocab: int, layers: int,
                   top_k: int, score: str, swiglu: bool, shared: bool, down_first: bool, extra: str) -> str:
    """Embedding, `layers` x (rmsnorm, moe [+ a shared SwiGLU expert], residual), a head.
    `down_first` writes w_down as [experts, hidden, ffn]; `extra` adds moe keywords."""
    down = "[experts, hidden, ffn]" if down_first else "[experts, ffn, hidden]"
    gate = "param we_gate: [experts, hidden, ffn] = normal(0.3)\n    " if swiglu else ""
    weights = "we_gate, we_up, we_down" if swiglu else "we_up, we_down"
    shared_params = ("param ws_gate: [hidden, ffn] = normal(0.3)\n    param ws_up: [hidden, ffn] = normal(0.3)\n"
                     "    param ws_down: [ffn, hidden] = normal(0.3)\n    ") if shared else ""
    out = "add(r, linear(swiglu(linear(h, ws_gate), linear(h, ws_up)), ws_down))" if shared else "r"
    return f"""
model random_moe {{
  dims {{
    batch = {batch}
    seq = {seq}
    hidden = {hidden}
    experts = {experts}
    ffn = {expert_ffn}
    vocab = {vocab}
  }}
  input tokens: int[batch, seq]
  input targets: int[batch, seq]
  param wte: [vocab, hidden] = normal(0.5)
  x = embedding(tokens, wte)
  repeat {layers} as layers {{
    param norm: [hidden] = ones
    param router: [hidden, experts] = normal(0.5)
    {gate}param we_up: [experts, hidden, ffn] = normal(0.3)
    param we_down: {down} = normal(0.3)
    {shared_params}h = rmsnorm(x, norm)
    r = moe(h, router, {weights}, top_k={top_k}, score="{score}"{extra})
    x = add(x, {out})
  }}
  param lnf: [hidden] = ones
  param w_head: [hidden, vocab] = normal(0.3)
  loss = cross_entropy(linear(rmsnorm(x, lnf), w_head), targets)
  return loss
}}
"""


@st.composite
def draw_moe_case(draw, *, max_world: int = 8, capacity: bool = False) -> Case:
    """An MoE model on a mesh with ep in {2, 4} composed with dp and tp (world <= 8).
    Dropless unless `capacity`: then a capacity factor small enough to drop tokens."""
    ep = draw(st.sampled_from([2, 4]))
    dp = draw(st.sampled_from([d for d in (1, 2) if d * ep <= max_world]))
    tp = draw(st.sampled_from([t for t in (1, 2) if dp * ep * t <= max_world]))
    sp = draw(st.booleans()) if tp > 1 else False
    experts = ep * draw(st.integers(1, 2))
    top_k = draw(st.integers(1, min(3, experts)))
    keywords = []
    if top_k == 1 or draw(st.booleans()):
        keywords.append(f"normalize={str(top_k > 1 and draw(st.booleans())).lower()}")
    if draw(st.booleans()):
        keywords.append("aux_loss=0.5")
    if draw(st.booleans()):
        keywords.append("bias_update=0.05")
    if capacity:  # seq * top_k >= 2 * experts: with a factor <= 0.5 some expert must drop
        keywords.append(f"capacity_factor={draw(st.sampled_from([0.25, 0.5]))}")
    text = moe_model_text(
        batch=dp * ep * draw(st.integers(1, 2)),
        seq=16 if capacity else tp * draw(st.integers(2, 4)),
        hidden=draw(st.sampled_from([6, 8, 12])),
        experts=experts,
        expert_ffn=tp * draw(st.integers(2, 4)),
        vocab=tp * draw(st.integers(3, 6)),
        layers=draw(st.integers(1, 2)),
        top_k=top_k,
        score=draw(st.sampled_from(["softmax", "sigmoid"])),
        swiglu=draw(st.booleans()),
        shared=draw(st.booleans()),
        down_first=draw(st.booleans()),
        extra="".join(", " + k for k in keywords),
    )
    return Case(text, f"{dp}x1x{tp}x1x{ep}", sp)
