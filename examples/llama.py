"""A Llama-style model written the usual PyTorch way (after Meta's reference code).

Token embedding, pre-norm blocks in an `nn.ModuleList` (RMSNorm, attention with
rotary position embedding on q and k and grouped-query attention: `n_kv_heads`
k/v heads shared by `n_heads` query heads; RMSNorm, a SwiGLU feed-forward), a final
RMSNorm and an untied output projection; no biases anywhere. `forward(tokens,
targets)` returns the mean cross-entropy loss.

`factory()` gives a tiny model and example inputs; run this file to print the graph
fivedc traces from it: `python examples/llama.py`.
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
    ffn_dim: int = 96
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


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    block = TransformerBlock  # a subclass may swap the block (examples/mixtral.py does)

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(self.block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        logits = self.output(self.norm(h))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def factory(*, batch: int = 2, args: ModelArgs | None = None, seed: int = 0, dtype=torch.float64,
            model_class: type[Transformer] = Transformer):
    """A tiny Llama (or `model_class`) and `(tokens, targets)` of `max_seq_len` tokens."""
    args = args or ModelArgs()
    torch.manual_seed(seed)
    model = model_class(args).to(dtype)
    for module in model.modules():  # non-trivial norm weights, so the test sees them
        if isinstance(module, RMSNorm):
            nn.init.normal_(module.weight, 1.0, 0.1)
    tokens = torch.randint(0, args.vocab_size, (batch, args.max_seq_len))
    targets = torch.randint(0, args.vocab_size, (batch, args.max_seq_len))
    return model, (tokens, targets)


if __name__ == "__main__":
    from fivedc.frontends.fx_module import trace_module

    module, inputs = factory()
    print(trace_module(module, inputs).summary())
