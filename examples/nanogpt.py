"""A GPT-2-style model written the usual PyTorch way (after Karpathy's nanoGPT).

Learned token and position embeddings (`wte`, `wpe`), pre-norm blocks in an
`nn.ModuleList` (LayerNorm, causal self-attention with a fused `c_attn` projection
split into q, k, v, `c_proj`; LayerNorm, a tanh-GELU MLP), a final LayerNorm and an
untied `lm_head`. `forward(idx, targets)` returns the mean cross-entropy loss.
Biases are off by default (nanoGPT's `bias=False`); `GPTConfig(bias=True)` gives
GPT-2's. (With biases, k's bias has an identically zero gradient, since softmax
ignores a shift per query; a training comparison then sees only rounding noise in
it, which AdamW's normalised step blows up to the size of the learning rate.)

`factory()` gives a tiny model and example inputs; run this file to print the graph
fivedc traces from it: `python examples/nanogpt.py`. `examples/nanogpt.5d` is the
same model written in the DSL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    block_size: int = 8
    vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32
    bias: bool = False  # nanoGPT's option; True gives GPT-2's biases on every linear and LayerNorm
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)  # untied from wte

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        b, t = idx.size()
        assert t <= self.config.block_size, f"sequence of length {t}, block size is {self.config.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def factory(*, batch: int = 2, config: GPTConfig | None = None, seed: int = 0, dtype=torch.float64):
    """A tiny GPT and `(idx, targets)`; the sequence is the full block size."""
    config = config or GPTConfig()
    torch.manual_seed(seed)
    model = GPT(config).to(dtype)
    idx = torch.randint(0, config.vocab_size, (batch, config.block_size))
    targets = torch.randint(0, config.vocab_size, (batch, config.block_size))
    return model, (idx, targets)


if __name__ == "__main__":
    from fivedc.frontends.fx_module import trace_module

    module, inputs = factory()
    print(trace_module(module, inputs).summary())
