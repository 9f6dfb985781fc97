"""Small models whose forward writes module buffers in traced code, for tests/test_module_states.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, FFN = 16, 8, 12


class Counting(nn.Module):
    """A layer that keeps statistics of its input: the sum of |x| per feature over the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, FFN), nn.Linear(FFN, DIM)
        self.register_buffer("seen", torch.zeros(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.seen.add_(x.abs().sum(dim=(0, 1)))
        return x + self.down(torch.tanh(self.up(x)))


class Moving(nn.Module):
    """An exponential moving average of its input's mean: read and written in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, FFN), nn.Linear(FFN, DIM)
        self.register_buffer("average", torch.zeros(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.average.mul_(0.9).add_(0.1 * x.mean(dim=(0, 1)))
        return x + self.down(torch.tanh(self.up(x))) + self.average


class Net(nn.Module):
    def __init__(self, layer, histogram: bool) -> None:
        super().__init__()
        self.histogram = histogram
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(layer() for _ in range(2))
        self.register_buffer("hist", torch.zeros(VOCAB))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.training and self.histogram:  # one_hot runs replicated: no pipeline of microbatches
            with torch.no_grad():
                self.hist.add_(F.one_hot(ids, VOCAB).sum(dim=(0, 1)).to(self.hist.dtype))
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def build(*, layer: str = "counting", histogram: bool = True, seed: int = 0):
    torch.manual_seed(seed)
    ids = torch.randint(0, VOCAB, (4, 6))
    model = Net({"counting": Counting, "moving": Moving}[layer], histogram).double()
    return model, (ids, torch.roll(ids, -1, 1))
