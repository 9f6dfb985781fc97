"""Models for tests/test_replicated_ops.py, in a file of their own: workers load the factories
by `file.py:factory` spec, and a test module imported again would nest its hypothesis tests."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import llama  # noqa: E402  examples/llama.py


class RunningSum(nn.Module):
    """A small LM whose block mixes the sequence with a running sum: no sharding rule."""

    def __init__(self, vocab: int = 32, hidden: int = 16, ffn: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        h = h + self.down(F.gelu(self.up(h)))
        h = h + torch.cumsum(h, dim=1) * 0.25
        logits = self.head(h)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def running_sum(seed: int = 0):
    """The factory `fivedc verify` and the workers load: targets with -100 in uneven places."""
    torch.manual_seed(seed)
    module = RunningSum().double()
    idx = torch.randint(0, 32, (4, 8))
    targets = torch.randint(0, 32, (4, 8))
    targets[0, :5] = -100
    targets[3, 7] = -100
    return module, (idx, targets)


def llama_ignoring():
    """examples/llama.py with some targets of -100, all in the first microbatch's rows."""
    module, (idx, targets) = llama.factory(batch=4)
    targets = targets.clone()
    targets[0, 1:] = -100
    return module, (idx, targets)


class SortsFeatures(RunningSum):
    """An operator with two results (values, indices) of which the model uses one."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        h = h + torch.sort(self.down(F.gelu(self.up(h))), dim=-1).values
        logits = self.head(h)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
