"""A decoder whose attention is written out (eager, as Hugging Face's Gemma 2 writes it) for
tests/test_fx_eager_attention.py: grouped-query k/v repeated by expand + reshape, scores scaled by a
scale of its own and capped by c * tanh(s / c), an additive causal mask, softmax in float32, then v.
In a file of its own: the workers load the factory by `file.py:factory` spec."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 16, 16, 4, 2, 4


def repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)


class EagerAttention(nn.Module):
    def __init__(self, softcap: float = 2.0, scale: float = 0.3) -> None:
        super().__init__()
        self.q = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.k = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.v = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.o = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.softcap, self.scale = softcap, scale

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        k = repeat_kv(self.k(x).view(b, s, KV_HEADS, HEAD_DIM).transpose(1, 2), HEADS // KV_HEADS)
        v = repeat_kv(self.v(x).view(b, s, KV_HEADS, HEAD_DIM).transpose(1, 2), HEADS // KV_HEADS)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scale
        scores = torch.tanh(scores / self.softcap) * self.softcap
        probs = F.softmax(scores + mask, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v).transpose(1, 2).contiguous()
        return self.o(out.reshape(b, s, -1))


class Decoder(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.attn = nn.ModuleList(EagerAttention() for _ in range(layers))
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        s = idx.shape[1]
        mask = torch.full((s, s), torch.finfo(torch.float32).min).triu(1)  # additive, as the libraries build it
        h = self.emb(idx)
        for layer in self.attn:
            h = h + layer(h, mask)
        logits = self.head(h)
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def decoder(seed: int = 0):
    torch.manual_seed(seed)
    return Decoder().double(), (torch.randint(0, VOCAB, (2, 8)), torch.randint(0, VOCAB, (2, 8)))
