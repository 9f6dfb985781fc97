"""Which keys a query sees, by their global positions: the causal band, with a sliding window."""

from __future__ import annotations

from torch import Tensor


def visible(q_pos: Tensor, kv_pos: Tensor, window: int) -> Tensor:
    """[len(q_pos), len(kv_pos)] True where a query sees a key: j <= i, and i - W < j with a window W."""
    seen = kv_pos[None, :] <= q_pos[:, None]
    return seen & (kv_pos[None, :] > q_pos[:, None] - window) if window else seen
