"""A small decoder whose MoE layers balance as the DeepSeek-V3 report does (auxiliary-loss-free),
written the way torchtitan writes it, for tests/test_module_states.py: each MoE block chooses its
experts by score plus a bias buffer, counts its tokens per expert into another buffer in the
forward (`tokens.add_(counts)` under no_grad, in training), and the training loop updates the bias
from the counts after each optimizer step (`after_step`, the module's `fivedc_after_step`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, EXPERTS, FFN, TOP_K, LAYERS = 32, 16, 4, 24, 2, 2


class BalancedMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.w1 = nn.Parameter(torch.randn(EXPERTS, FFN, DIM) * DIM ** -0.5)
        self.w3 = nn.Parameter(torch.randn(EXPERTS, FFN, DIM) * DIM ** -0.5)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, DIM, FFN) * FFN ** -0.5)
        self.coeff = 0.05
        self.register_buffer("expert_bias", torch.zeros(EXPERTS))
        self.register_buffer("tokens_per_expert", torch.zeros(EXPERTS), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.router(x).softmax(-1)
        chosen = (scores + self.expert_bias).topk(TOP_K, dim=-1).indices
        gates = scores.gather(-1, chosen)
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert.add_(F.one_hot(chosen, EXPERTS).sum(dim=(0, 1, 2)))
        out = torch.zeros_like(x)
        for e in range(EXPERTS):
            h = F.silu(x @ self.w1[e].t()) * (x @ self.w3[e].t())
            weight = (gates * (chosen == e)).sum(-1, keepdim=True)
            out = out + weight * (h @ self.w2[e].t())
        return out


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.moe = BalancedMoE()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def update_bias(model: nn.Module) -> None:
    """The trainer's update: bias += coeff * sign(mean - tokens), centred; the counts start again."""
    buffers = dict(model.named_buffers())
    for key, tokens in buffers.items():
        if key.endswith(".tokens_per_expert"):
            bias = buffers[key.removesuffix("tokens_per_expert") + "expert_bias"]
            delta = 0.05 * torch.sign(tokens.mean() - tokens)
            bias.add_(delta - delta.mean())
            tokens.zero_()


def build(*, seed: int = 0, batch: int = 4, seq: int = 8, after_step: bool = True):
    """(Decoder, (ids, labels)) in float64; with the bias update as its after-step hook, or without
    (then the counts accumulate over the steps)."""
    torch.manual_seed(seed)
    model = Decoder().double()
    if after_step:
        model.fivedc_after_step = update_bias
    ids = torch.randint(0, VOCAB, (batch, seq))
    return model, (ids, torch.roll(ids, -1, dims=1))
