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

`hf_factory()` builds the same model with the MoE block written as Hugging Face's
`MixtralSparseMoeBlock`: each expert its own module (`experts.3.w1`, `w3`, `w2`:
bias-free `nn.Linear`s), the usual loop over experts with `index_add_`, and
`(out, router_logits)` returned, of which the layer uses only `out`. The frontend
recognises it by its name and stacks the experts' weights into the same `moe` op.

`factory()` gives a tiny model and example inputs; run this file to print the graph
fivedc traces from it: `python examples/mixtral.py` (`--hf` for `hf_factory`).
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


class MixtralBlockSparseTop2MLP(nn.Module):
    """One expert, as Hugging Face writes it: w1 (gate), w3 (up), w2 (down)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.expert_ffn_dim, bias=False)
        self.w2 = nn.Linear(args.expert_ffn_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.expert_ffn_dim, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act_fn(self.w1(x)) * self.w3(x))


class MixtralSparseMoeBlock(nn.Module):
    """Hugging Face's block: experts as separate modules; returns (out, router_logits)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.num_experts, self.top_k = args.n_experts, args.top_k
        self.gate = nn.Linear(args.dim, args.n_experts, bias=False)
        self.experts = nn.ModuleList(MixtralBlockSparseTop2MLP(args) for _ in range(args.n_experts))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights = routing_weights / routing_weights.sum(dim=-1, keepdim=True)
        final = torch.zeros_like(hidden_states)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            idx, top_x = torch.where(expert_mask[expert_idx])
            out = self.experts[expert_idx](hidden_states[top_x]) * routing_weights[top_x, idx, None]
            final.index_add_(0, top_x, out)
        return final.reshape(batch_size, sequence_length, hidden_dim), router_logits


class TransformerBlock(nn.Module):
    moe_block = SparseMoeBlock

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.block_sparse_moe = self.moe_block(args)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.block_sparse_moe(self.ffn_norm(h))


class HFTransformerBlock(TransformerBlock):
    moe_block = MixtralSparseMoeBlock

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        moe_out, _ = self.block_sparse_moe(self.ffn_norm(h))  # the router logits are not used
        return h + moe_out


class Transformer(llama.Transformer):
    block = TransformerBlock


class HFTransformer(llama.Transformer):
    block = HFTransformerBlock


def factory(*, batch: int = 2, args: ModelArgs | None = None, seed: int = 0, dtype=torch.float64):
    """A tiny Mixtral and `(tokens, targets)` of `max_seq_len` tokens."""
    return llama.factory(batch=batch, args=args or ModelArgs(), seed=seed, dtype=dtype, model_class=Transformer)


def hf_factory(*, batch: int = 2, args: ModelArgs | None = None, seed: int = 0, dtype=torch.float64):
    """The same with Hugging Face's MoE block (separate experts, a tuple returned)."""
    return llama.factory(batch=batch, args=args or ModelArgs(), seed=seed, dtype=dtype, model_class=HFTransformer)


if __name__ == "__main__":
    from fivedc.frontends.fx_module import trace_module

    module, inputs = (hf_factory if "--hf" in sys.argv else factory)()
    print(trace_module(module, inputs).summary())
