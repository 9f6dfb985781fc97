"""A model with a library's own operator that has no float64 kernel, for tests/test_fx_moe_generic.py:
in a file of its own, so that the workers (which load the factory by `file.py:factory`) register
the operator too, as a library's import would."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@torch.library.custom_op("fivedc_tests::twice_f32", mutates_args=())
def twice_f32(x: Tensor) -> Tensor:
    """2 x, with kernels for float32 and 16-bit floats only (as torch's grouped_mm on CPU)."""
    if x.dtype == torch.float64:
        raise RuntimeError("twice_f32: expected a Float32, BFloat16 or Float16 tensor, got Double")
    return x * 2


@twice_f32.register_fake
def _(x: Tensor) -> Tensor:
    return torch.empty_like(x)


twice_f32.register_autograd(lambda ctx, grad: grad * 2)


class Doubled(nn.Module):
    def __init__(self, vocab: int = 16, hidden: int = 8) -> None:
        super().__init__()
        self.emb, self.up = nn.Embedding(vocab, hidden), nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        h = self.emb(idx)
        h = h + twice_f32(F.silu(self.up(h)))
        logits = self.head(h)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def doubled(seed: int = 0):
    torch.manual_seed(seed)
    return Doubled().double(), (torch.randint(0, 16, (2, 4)), torch.randint(0, 16, (2, 4)))
