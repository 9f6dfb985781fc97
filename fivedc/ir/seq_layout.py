"""How the sequence is laid out over the context-parallel (cp) axis.

With `contiguous`, cp rank r holds positions [r*S/cp, (r+1)*S/cp). Under a causal
mask that gives the last rank the most attention work, so the default for causal
models is `balanced`: the sequence is cut into 2*cp chunks and rank r holds chunks
r and 2*cp-1-r, one early and one late, so every rank does the same work.

The runtime stores every tensor with the sequence dim in *layout order*: the
full sequence permuted so that each rank's share is one contiguous range. Then
every position-wise op, collective and slice is oblivious to the layout; only the
ops that care about positions (RoPE, the causal mask) ask for `layout_order`, and
the boundaries (sharding inputs and parameters, gathering results) permute.
"""

from __future__ import annotations

from enum import StrEnum


class SeqLayout(StrEnum):
    CONTIGUOUS = "contiguous"
    BALANCED = "balanced"


def chunks_per_rank(layout: SeqLayout) -> int:
    return 2 if layout == SeqLayout.BALANCED else 1


def layout_order(layout: SeqLayout, seq: int, cp: int) -> list[int]:
    """The global position stored at each index of the layout-ordered sequence."""
    if layout == SeqLayout.CONTIGUOUS or cp == 1:
        return list(range(seq))
    n = seq // (2 * cp)
    order: list[int] = []
    for rank in range(cp):
        for chunk in (rank, 2 * cp - 1 - rank):
            order.extend(range(chunk * n, (chunk + 1) * n))
    return order


def describe(layout: SeqLayout, cp: int) -> str:
    if layout == SeqLayout.BALANCED:
        return f"balanced: the sequence in {2 * cp} chunks, cp rank r holds chunks r and {2 * cp - 1}-r"
    return f"contiguous: the sequence in {cp} chunks, cp rank r holds chunk r"
