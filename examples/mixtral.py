"""A Mixtral-style top-2 mixture-of-experts model written the usual PyTorch way.

The Llama of `examples/llama.py` (token embedding, pre-norm blocks in an
`nn.ModuleList` with RMSNorm, rotary embeddings and grouped-query attention, a
final RMSNorm and an untied output projection, no biases) whose feed-forward is a
sparse MoE block as in Mixtral: a router `nn.Linear(dim, n_experts)`, softmax over
the experts, each token sent to its top 2 with the two weights renormalised to sum
1, and SwiGLU experts whose weights are stacked over the experts (`w1`, `w3`:
[experts, ffn, dim] and `w2`: [experts, dim, ffn], each expert's slice laid out as
an `nn.Linear` weight). No capacity limit: every token reaches its experts.
`forward(tokens, targets)` returns the mean cross-entropy loss.

fivedc's fx frontend recognises `SparseMoeBlock` (its class sets `fivedc_moe =
True`) and lowers it to one IR `moe` op, so a plan can spread the experts over the
ep axis: `fivedc verify examples/mixtral.py:factory --mesh 1x1x2x1x2` trains it with
`fivedc.parallelize` (tp x ep) against the plain module.

`factory()` gives a tiny model and example inputs; run this file to print the graph
fivedc traces from it: `python examples/mixtral.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelArgs:
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 64
    n_experts: int = 4
    top_k: int = 2
    expert_ffn_dim: int = 48
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 8


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotates the two halves of each head (GPT-NeoX / Hugging Face convention)."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.theta = theta
        inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        freqs = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, seq, heads, head_dim)
        seqlen = x.shape[1]
        cos = self.cos[:seqlen, None, :].to(x.dtype)
        sin = self.sin[:seqlen, None, :].to(x.dtype)
        return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.n_rep = args.n_heads // args.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.rope = RotaryEmbedding(self.head_dim, args.max_seq_len, args.rope_theta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xq, xk = self.rope(xq), self.rope(xk)
        xq, xk, xv = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        xk = xk.repeat_interleave(self.n_rep, dim=1)  # grouped-query attention
        xv = xv.repeat_interleave(self.n_rep, dim=1)
        out = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        out = out.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(out)


class SparseMoeBlock(nn.Module):
    """Top-k routed SwiGLU experts; the token loop is the usual eager one (index by expert)."""

    fivedc_moe = True  # tells fivedc's fx frontend to lower this module to its `moe` op

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_experts, self.top_k = args.n_experts, args.top_k
        self.gate = nn.Linear(args.dim, args.n_experts, bias=False)  # the router
        std = args.dim ** -0.5
        self.w1 = nn.Parameter(torch.randn(args.n_experts, args.expert_ffn_dim, args.dim) * std)
        self.w3 = nn.Parameter(torch.randn(args.n_experts, args.expert_ffn_dim, args.dim) * std)
        self.w2 = nn.Parameter(torch.randn(args.n_experts, args.dim, args.expert_ffn_dim) * args.expert_ffn_dim ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = F.softmax(self.gate(x), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(self.n_experts):
            token, slot = torch.where(chosen == e)
            if token.numel() == 0:
                continue
            h = x[token]
            h = F.silu(h @ self.w1[e].t()) * (h @ self.w3[e].t())
            out.index_add_(0, token, (h @ self.w2[e].t()) * weights[token, slot, None])
        return out.reshape(shape)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.block_sparse_moe = SparseMoeBlock(args)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.block_sparse_moe(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        logits = self.output(self.norm(h))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def factory(*, batch: int = 2, args: ModelArgs | None = None, seed: int = 0, dtype=torch.float64):
    """A tiny Mixtral and `(tokens, targets)` of `max_seq_len` tokens."""
    args = args or ModelArgs()
    torch.manual_seed(seed)
    model = Transformer(args).to(dtype)
    for module in model.modules():  # non-trivial norm weights, so the test sees them
        if isinstance(module, RMSNorm):
            nn.init.normal_(module.weight, 1.0, 0.1)
    tokens = torch.randint(0, args.vocab_size, (batch, args.max_seq_len))
    targets = torch.randint(0, args.vocab_size, (batch, args.max_seq_len))
    return model, (tokens, targets)


if __name__ == "__main__":
    from fivedc.frontend_fx import trace_module

    module, inputs = factory()
    print(trace_module(module, inputs).summary())
