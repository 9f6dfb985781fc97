"""A grammar of common layer code, for the fuzz test of the fx frontend (tests/test_fx_fuzz.py).

`Spec` names one choice per slot of a small decoder: the norm (LayerNorm or RMSNorm, as modules
or in their common hand-written forms), the projections (separate, or one fused qkv Linear then
split, chunk or a view and unbind), the rotary (none, Llama's complex multiply, Hugging Face's
rotate_half with cos/sin, the interleaved even/odd pairs), the attention and its mask (SDPA with
is_causal, a tril or triu mask buffer, an additive -inf mask, a sliding window, each by SDPA or
written out), how k/v are repeated over the query heads, the MLP (GELU, SwiGLU), the residual
(pre-norm, parallel, post-norm) and the loss (F.cross_entropy in its forms). `build(spec)` is the
factory: the float64 module and its `(tokens, targets)`. The code below is the "user's code": a
refusal must name a line of this file.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH, SEQ, VOCAB, THETA, EPS, IGNORE = 4, 8, 16, 10000.0, 1e-5, 3

NORMS = ("layernorm", "rmsnorm", "ln_written", "ln_functional", "rms_llama", "rms_hf", "rms_gemma")
PROJECTIONS = ("separate", "split", "chunk", "unbind", "unpacked")
ROTARIES = ("none", "complex", "rotate_half", "hf_dynamic", "interleaved")
MASKS = ("is_causal", "tril_fill", "triu_fill", "additive", "additive_sdpa", "window_fill",
         "tril_forward", "additive_forward", "window_forward",
         "window_sdpa", "bool_sdpa", "none")
REPEATS = ("expand", "repeat_interleave", "gqa_flag")
MLPS = ("gelu", "gelu_tanh", "gelu_sequential", "swiglu", "swiglu_fused", "square_gate")
RESIDUALS = ("pre", "parallel", "post")
LOSSES = ("flat", "default_ignore", "ignore_index", "class_dim", "class_dim_extra", "module", "nll",
          "sum", "smoothing", "none_mean", "shifted")
SLOTS = {"norm": NORMS, "projection": PROJECTIONS, "rotary": ROTARIES, "mask": MASKS,
         "repeat": REPEATS, "mlp": MLPS, "residual": RESIDUALS, "loss": LOSSES}
# every field of `Spec` but kv_heads (a divisor of heads, or heads where the fused width is cut
# in three equal parts), with the values a draw takes
CHOICES = {**SLOTS, "layers": (1, 2, 3), "heads": (2, 4), "head_dim": (4, 8),
           "window": (2, 3, 5, 8, 12), "tied": (False, True), "float_softmax": (False, True),
           "qk_norm": (False, True), "positions": (False, True), "emb_scale": (False, True), "softcap": (0.0, 0.0, 30.0),
           "dropout": (0.0, 0.0, 0.1), "scale": ("default", "divide", "own"),
           "out_proj": (True, True, False)}


@dataclass(frozen=True)
class Spec:
    """One drawn model: a choice per slot (the tuples above) and its sizes."""

    norm: str = "rmsnorm"
    projection: str = "separate"
    rotary: str = "none"
    mask: str = "is_causal"
    repeat: str = "expand"
    mlp: str = "swiglu"
    residual: str = "pre"
    loss: str = "flat"
    layers: int = 1
    heads: int = 2
    kv_heads: int = 2
    head_dim: int = 4
    window: int = 3
    tied: bool = False
    float_softmax: bool = False
    qk_norm: bool = False  # RMSNorm over head_dim on q and k (OLMo 2, Qwen3)
    positions: bool = False  # a learned position embedding added to the tokens' (GPT-2)
    emb_scale: bool = False  # the embedding times sqrt(hidden) (Gemma)
    softcap: float = 0.0  # the logits capped by c * tanh(logits / c) (Gemma 2)
    dropout: float = 0.0  # nn.Dropout after attention and MLP (off in the plan: a warning)
    scale: str = "default"  # 1/sqrt(head_dim); "divide": scores / sqrt(head_dim); "own": another scale
    out_proj: bool = True  # attention's output projection; without, the heads add to the residual

    def kwargs(self) -> dict:
        """The spec as the factory's keyword arguments (plain data a worker process can take)."""
        return asdict(self)


# ---- norms ------------------------------------------------------------------------------------
class LayerNormWritten(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(dim)), nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + EPS) * self.weight + self.bias


class LayerNormFunctional(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(dim)), nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, EPS)


class RMSNormLlama(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS)
        return normed.type_as(x) * self.weight


class RMSNormHF(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = hidden.dtype
        hidden = hidden.to(torch.float32)
        variance = hidden.pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + EPS)
        return self.weight * hidden.to(dtype)


class RMSNormGemma(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
        return out * (1.0 + self.weight)


def make_norm(kind: str, dim: int) -> nn.Module:
    """A norm over the last dim of width `dim`, of the given kind."""
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=EPS)
    if kind == "rmsnorm":
        return nn.RMSNorm(dim, eps=EPS)
    return {"ln_written": LayerNormWritten, "ln_functional": LayerNormFunctional,
            "rms_llama": RMSNormLlama, "rms_hf": RMSNormHF, "rms_gemma": RMSNormGemma}[kind](dim)


# ---- rotary embeddings (x: [batch, seq, heads, head_dim] unless said) ---------------------------
def _freqs(head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return torch.outer(torch.arange(SEQ, dtype=torch.float64), inv_freq)  # [seq, head_dim/2]


class ComplexRotary(nn.Module):
    """Llama's and torchtitan's: pairs as complex numbers, times a complex table."""

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        freqs = _freqs(head_dim)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(freqs), freqs), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_ = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
        freqs = self.freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, x_.shape[-1])
        return torch.view_as_real(x_ * freqs).flatten(3).type_as(x)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class HalfRotary(nn.Module):
    """Hugging Face's: `x * cos + rotate_half(x) * sin` on [batch, heads, seq, head_dim]."""

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        emb = torch.cat((_freqs(head_dim), _freqs(head_dim)), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos[None, None, : x.shape[2]], self.sin[None, None, : x.shape[2]]
        return x * cos + rotate_half(x) * sin


class DynamicRotary(nn.Module):
    """Hugging Face's rotary module: cos and sin computed in the forward from `inv_freq` and the
    positions, then applied with rotate_half on [batch, heads, seq, head_dim]."""

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        inv_freq = 1.0 / THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[2], device=x.device)[None, :].to(self.inv_freq.dtype)
        freqs = (self.inv_freq[None, :, None] @ positions[:, None, :]).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
        return x * cos + rotate_half(x) * sin


class InterleavedRotary(nn.Module):
    """GPT-J's and Cohere's: even and odd entries as the pairs, stacked back."""

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        freqs = _freqs(head_dim)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos[None, : x.shape[1], None], self.sin[None, : x.shape[1], None]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


# ---- masks (buffers [seq, seq]) -----------------------------------------------------------------
def _band(window: int | None) -> torch.Tensor:
    """True where query i may see key j: j <= i, and i - j < window."""
    i, j = torch.arange(SEQ)[:, None], torch.arange(SEQ)[None, :]
    return (j <= i) & (i - j < window) if window else j <= i


def mask_buffer(kind: str, window: int) -> torch.Tensor | None:
    """The mask buffer a kind of attention keeps, or None."""
    if kind == "tril_fill":
        return torch.tril(torch.ones(SEQ, SEQ)).view(1, 1, SEQ, SEQ)
    if kind == "triu_fill":
        return torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)
    if kind in ("additive", "additive_sdpa"):
        return torch.full((SEQ, SEQ), float("-inf"), dtype=torch.float64).triu(1)
    if kind in ("window_fill", "window_sdpa"):
        return _band(window)
    if kind == "bool_sdpa":
        return _band(None)
    return None


# ---- attention ----------------------------------------------------------------------------------
class Attention(nn.Module):
    """Projections (separate or fused), a rotary, k/v repeated over the query heads, a mask."""

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.spec, hd = spec, spec.head_dim
        dim, kv = spec.heads * hd, spec.kv_heads * hd
        if spec.projection == "separate":
            self.wq, self.wk, self.wv = nn.Linear(dim, dim), nn.Linear(dim, kv), nn.Linear(dim, kv)
        else:
            self.wqkv = nn.Linear(dim, dim + 2 * kv, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False) if spec.out_proj else nn.Identity()
        self.rotary = {"none": None, "complex": ComplexRotary, "rotate_half": HalfRotary,
                       "hf_dynamic": DynamicRotary, "interleaved": InterleavedRotary}[spec.rotary]
        self.rotary = self.rotary(hd) if self.rotary else None
        if spec.qk_norm:
            self.q_norm, self.k_norm = nn.RMSNorm(hd, eps=EPS), nn.RMSNorm(hd, eps=EPS)
        mask = mask_buffer(spec.mask, spec.window)
        if mask is not None:
            self.register_buffer("mask", mask, persistent=spec.mask == "tril_fill")

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v as [batch, seq, heads, head_dim]."""
        b, s, _ = x.shape
        spec, hd = self.spec, self.spec.head_dim
        dim, kv = spec.heads * hd, spec.kv_heads * hd
        if spec.projection == "separate":
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        elif spec.projection == "split":
            q, k, v = self.wqkv(x).split([dim, kv, kv], dim=-1)
        elif spec.projection == "chunk":
            q, k, v = self.wqkv(x).chunk(3, dim=-1)
        elif spec.projection == "unbind":
            q, k, v = self.wqkv(x).view(b, s, 3, spec.heads, hd).unbind(2)
        else:  # timm's: the three parts first, then unpacked
            q, k, v = self.wqkv(x).view(b, s, 3, spec.heads, hd).permute(2, 0, 1, 3, 4)
        return q.view(b, s, -1, hd), k.view(b, s, -1, hd), v.view(b, s, -1, hd)

    def repeat_kv(self, t: torch.Tensor) -> torch.Tensor:
        """[batch, kv_heads, seq, hd] repeated to the query heads (Hugging Face's, or torch's)."""
        rep = self.spec.heads // self.spec.kv_heads
        if rep == 1 or self.gqa():
            return t
        if self.spec.repeat == "repeat_interleave":
            return t.repeat_interleave(rep, dim=1)
        b, kv, s, hd = t.shape
        return t[:, :, None, :, :].expand(b, kv, rep, s, hd).reshape(b, kv * rep, s, hd)

    def gqa(self) -> bool:
        """Whether SDPA repeats k/v itself (`enable_gqa`): only where SDPA computes the attention."""
        sdpa = self.spec.mask in ("is_causal", "none", "additive_sdpa", "window_sdpa", "bool_sdpa")
        return sdpa and self.spec.repeat == "gqa_flag" and self.spec.heads != self.spec.kv_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.project(x)
        if self.spec.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.spec.rotary in ("complex", "interleaved"):
            q, k = self.rotary(q), self.rotary(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.spec.rotary in ("rotate_half", "hf_dynamic"):
            q, k = self.rotary(q), self.rotary(k)
        y = self.attend(q, self.repeat_kv(k), self.repeat_kv(v))
        return self.wo(y.transpose(1, 2).contiguous().view(b, s, -1))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(hd) + mask) v, by SDPA or written out, as the spec's mask says."""
        kind, s, gqa = self.spec.mask, q.shape[2], self.gqa()
        scale = 0.5 if self.spec.scale == "own" else None  # Gemma 3's query_pre_attn_scalar
        if kind in ("is_causal", "none"):
            return F.scaled_dot_product_attention(q, k, v, is_causal=kind == "is_causal", enable_gqa=gqa,
                                                  scale=scale)
        if kind in ("additive_sdpa", "window_sdpa", "bool_sdpa"):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask[:s, :s], enable_gqa=gqa,
                                                  scale=scale)
        if self.spec.scale == "divide":
            scores = q @ k.transpose(-2, -1) / math.sqrt(k.size(-1))
        else:
            scores = q @ k.transpose(-2, -1) * (scale or 1.0 / math.sqrt(k.size(-1)))
        if kind == "tril_fill":
            scores = scores.masked_fill(self.mask[:, :, :s, :s] == 0, float("-inf"))
        elif kind == "triu_fill":
            scores = scores.masked_fill(self.mask[:s, :s], float("-inf"))
        elif kind == "additive":
            scores = scores + self.mask[:s, :s]
        elif kind == "tril_forward":
            causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
        elif kind == "additive_forward":
            scores = scores + torch.full((s, s), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
        elif kind == "window_forward":
            i, j = torch.arange(s, device=q.device)[:, None], torch.arange(s, device=q.device)[None, :]
            scores = scores.masked_fill((j > i) | (i - j >= self.spec.window), float("-inf"))
        else:
            scores = scores.masked_fill(~self.mask[:s, :s], float("-inf"))
        if self.spec.float_softmax:
            return F.softmax(scores.float(), dim=-1).type_as(q) @ v
        return F.softmax(scores, dim=-1) @ v


# ---- MLPs, blocks, the model ----------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self, kind: str, dim: int) -> None:
        super().__init__()
        self.kind, ffn = kind, 2 * dim
        if kind == "gelu_sequential":
            self.seq = nn.Sequential(nn.Linear(dim, ffn), nn.GELU(), nn.Linear(ffn, dim))
            return
        if kind == "square_gate":  # a square weight whose output gates its own input
            self.gate = nn.Linear(dim, dim)
            return
        if kind == "swiglu_fused":
            self.gate_up = nn.Linear(dim, 2 * ffn, bias=False)
        else:
            self.up = nn.Linear(dim, ffn, bias=kind.startswith("gelu"))
        if kind == "swiglu":
            self.gate = nn.Linear(dim, ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=kind.startswith("gelu"))
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "gelu_sequential":
            return self.seq(x)
        if self.kind == "square_gate":
            return x * torch.sigmoid(self.gate(x))
        if self.kind == "gelu":
            return self.down(self.act(self.up(x)))
        if self.kind == "gelu_tanh":
            return self.down(F.gelu(self.up(x), approximate="tanh"))
        if self.kind == "swiglu":
            return self.down(F.silu(self.gate(x)) * self.up(x))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, spec: Spec) -> None:
        super().__init__()
        dim = spec.heads * spec.head_dim
        self.residual, self.drop = spec.residual, nn.Dropout(spec.dropout)
        self.attn, self.mlp = Attention(spec), MLP(spec.mlp, dim)
        self.norm1, self.norm2 = make_norm(spec.norm, dim), make_norm(spec.norm, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.residual == "pre":
            x = x + self.drop(self.attn(self.norm1(x)))
            return x + self.drop(self.mlp(self.norm2(x)))
        if self.residual == "parallel":
            h = self.norm1(x)
            return x + self.attn(h) + self.mlp(h)
        x = self.norm1(x + self.attn(x))
        return self.norm2(x + self.mlp(x))


class Model(nn.Module):
    """Embedding, `spec.layers` blocks, a final norm, the head and the loss."""

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        dim = spec.heads * spec.head_dim
        self.loss_kind, self.spec = spec.loss, spec
        self.emb = nn.Embedding(VOCAB, dim)
        if spec.positions:
            self.wpe = nn.Embedding(SEQ, dim)
        self.layers = nn.ModuleList(Block(spec) for _ in range(spec.layers))
        self.norm = make_norm(spec.norm, dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        if spec.tied:
            self.head.weight = self.emb.weight
        self.criterion = nn.CrossEntropyLoss(ignore_index=IGNORE)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        if self.spec.emb_scale:
            h = h * torch.tensor(h.shape[-1] ** 0.5, dtype=h.dtype)
        if self.spec.positions:
            h = h + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers:
            h = layer(h)
        logits = self.head(self.norm(h))
        if self.spec.softcap:
            logits = torch.tanh(logits / self.spec.softcap) * self.spec.softcap
        return self.loss(logits, targets)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """F.cross_entropy in one of its forms."""
        kind, flat, labels = self.loss_kind, logits.view(-1, VOCAB), targets.view(-1)
        if kind in ("flat", "default_ignore"):
            return F.cross_entropy(flat, labels)
        if kind == "ignore_index":
            return F.cross_entropy(flat, labels, ignore_index=IGNORE)
        if kind == "class_dim":
            return F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORE)
        if kind == "class_dim_extra":
            b, n, _ = logits.shape
            parts = logits.reshape(b, 2, n // 2, VOCAB).permute(0, 3, 1, 2)
            return F.cross_entropy(parts, targets.reshape(b, 2, n // 2))
        if kind == "module":
            return self.criterion(flat, labels)
        if kind == "nll":
            return F.nll_loss(F.log_softmax(flat, dim=-1), labels)
        if kind == "sum":
            return F.cross_entropy(flat, labels, reduction="sum")
        if kind == "smoothing":
            return F.cross_entropy(flat, labels, label_smoothing=0.1)
        if kind == "none_mean":
            return F.cross_entropy(flat, labels, reduction="none").mean()
        shift = logits[:, :-1, :].contiguous()
        return F.cross_entropy(shift.view(-1, VOCAB), targets[:, 1:].contiguous().view(-1))


def build(seed: int = 0, **kwargs):
    """The factory: the float64 model of `Spec(**kwargs)` and its `(tokens, targets)`."""
    spec = Spec(**kwargs)
    torch.manual_seed(seed)
    model = Model(spec).double()
    for name, p in model.named_parameters():  # norms off their identity, so the test sees them
        if "norm" in name:
            nn.init.normal_(p, 1.0 if spec.norm != "rms_gemma" else 0.0, 0.1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    targets = torch.randint(0, VOCAB, (BATCH, SEQ))
    if spec.loss == "default_ignore":
        targets[:, -1] = -100
    elif spec.loss in ("ignore_index", "class_dim", "module"):
        targets[:, -1] = IGNORE
    return model, (tokens, targets)
