"""A Mixtral-style top-2 mixture-of-experts model written the usual PyTorch way.

The Llama of `examples/llama.py`, whose pieces it imports (token embedding,
pre-norm blocks in an `nn.ModuleList` with RMSNorm, rotary embeddings and
grouped-query attention, a final RMSNorm and an untied output projection, no
biases), with a feed-forward that is a sparse MoE block as in Mixtral: a router `nn.Linear(dim, n_experts)`, softmax over
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

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama  # noqa: E402  (the shared building blocks)
from llama import Attention, RMSNorm  # noqa: E402


@dataclass
class ModelArgs(llama.ModelArgs):
    n_experts: int = 4
    top_k: int = 2
    expert_ffn_dim: int = 48  # each expert's SwiGLU width (llama's `ffn_dim` is unused)


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


class Transformer(llama.Transformer):
    block = TransformerBlock


def factory(*, batch: int = 2, args: ModelArgs | None = None, seed: int = 0, dtype=torch.float64):
    """A tiny Mixtral and `(tokens, targets)` of `max_seq_len` tokens."""
    return llama.factory(batch=batch, args=args or ModelArgs(), seed=seed, dtype=dtype, model_class=Transformer)


if __name__ == "__main__":
    from fivedc.frontend_fx import trace_module

    module, inputs = factory()
    print(trace_module(module, inputs).summary())
