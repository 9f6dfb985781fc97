"""The buffers an MoE block reads and writes, read by behaviour as the block itself is.

A block's buffers are state (`fivedc/ir/states.py`), and two uses of them are read:

- a **routing bias** (the auxiliary-loss-free balancing of the DeepSeek-V3 report:
  torchtitan's `expert_bias_E`, Hugging Face's `e_score_correction_bias`): a floating
  buffer [experts] the block adds to its scores to choose its top-k experts, and to
  nothing else (the gates stay the scores). Probed by giving the buffer random values:
  the block must then compute the IR's moe with that bias in the choice;
- **tokens per expert** (torchtitan's `tokens_per_expert_E`): a floating buffer
  [experts] the block's forward adds its tokens' count of assignments per expert to
  (`buffer.add_(counts)` under `no_grad`). Probed by running the block on the probe:
  what the buffer gained must be the count of the probe's top-k choices per expert.

Any other write of a buffer is not read, and the block is then not an MoE block to the
frontend (traced through, where the write is refused at its line).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True, slots=True)
class StateReading:
    """The block's buffers by use, names relative to the block ("" where it has none)."""

    bias: str = ""
    counts: str = ""


def probe_buffers(m: nn.Module, dtype: torch.dtype, zeroed: bool = False) -> dict[str, Tensor]:
    """Copies of the block's floating buffers in the probe's dtype (the block's own are never written
    by a probe), and its other buffers as they are; `zeroed`: its floating 1-D buffers at zero (a
    routing bias that a trained model holds chooses other experts than the scores: read at zero)."""
    out = {}
    for n, b in m.named_buffers():
        copy = b.detach().clone().to(dtype) if b.is_floating_point() else b.detach().clone()
        out[n] = torch.zeros_like(copy) if zeroed and copy.is_floating_point() and copy.dim() == 1 else copy
    return out


def choices(x: Tensor, router: Tensor, *, top_k: int, score: str, bias: Tensor | None) -> Tensor:
    """[..., top_k]: each token's experts, chosen by score plus the routing bias."""
    logits = x @ router
    scores = logits.softmax(-1) if score == "softmax" else logits.sigmoid()
    select = scores if bias is None else scores + bias.to(scores.dtype)
    return select.topk(top_k, dim=-1).indices


def counts_of(chosen: Tensor, experts: int) -> Tensor:
    """Assignments per expert: tokens x top_k choices counted, [experts]."""
    return torch.bincount(chosen.reshape(-1), minlength=experts)


def written(before: dict[str, Tensor], after: dict[str, Tensor]) -> dict[str, Tensor]:
    """The buffers a run changed: name -> what it added."""
    return {n: after[n] - before[n] for n in before
            if after[n].shape == before[n].shape and not torch.equal(after[n], before[n])}


def read_counts(gains: dict[str, Tensor], want: Tensor) -> str | StateReading:
    """The buffer whose gain is the probe's tokens per expert, or why the writes are not read."""
    found = ""
    for name, gain in gains.items():
        if gain.shape == want.shape and gain.is_floating_point() and torch.equal(gain, want.to(gain.dtype)) \
                and not found:
            found = name
        else:
            return (f"its forward writes its buffer {name} otherwise than by adding its tokens per expert "
                    "(the only write of a buffer fivedc reads in an MoE block)")
    return StateReading(counts=found)


def bias_candidates(m: nn.Module, experts: int, exclude: str) -> list[str]:
    """Floating buffers [experts] of the block that its forward does not write."""
    return [n for n, b in m.named_buffers() if n != exclude and b.is_floating_point() and tuple(b.shape) == (experts,)]
