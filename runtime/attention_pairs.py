"""Attention as partials that merge, and the plan of which (q run, k/v run) pairs to compute.

Attention over a key set is kept as a partial result: the output normalised over
those keys and the log-sum-exp of their scaled scores, and two partials over
disjoint key sets merge exactly (`merge_partials`). Rows carry global positions;
maximal runs of consecutive positions (`position_runs`) are paired once
(`plan_pairs`): fully masked pairs are skipped, fully visible ones need no mask, and
runs are cut into tiles of at most TILE rows. Used by `runtime/attention.py` and
`runtime/attention_ring.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from fivedc.errors import ShapeError


def merge_partials(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Attention over the union of two disjoint key sets from the partials over each.

    out_* [..., sq, d] and lse_* [..., sq]; a row with lse = -inf saw no key in that
    part and contributes nothing (a row that saw none in either gets out 0, lse -inf).
    """
    lse = torch.logaddexp(lse_a, lse_b)
    finite = lse.masked_fill(lse == -math.inf, 0.0)
    weight_a = torch.exp(lse_a - finite).unsqueeze(-1)
    weight_b = torch.exp(lse_b - finite).unsqueeze(-1)
    return out_a * weight_a + out_b * weight_b, lse


def position_runs(pos: Tensor) -> tuple[tuple[int, int], ...]:
    """Maximal runs of consecutive positions (p, p+1, ...) in `pos`, as (offset, length)."""
    if pos.numel() == 0:
        return ()
    breaks = (torch.nonzero(pos[1:] - pos[:-1] != 1).flatten() + 1).tolist()
    starts = [0, *breaks]
    ends = [*breaks, pos.numel()]
    return tuple((s, e - s) for s, e in zip(starts, ends))


TILE = 256  # the longest run of q or k/v rows whose scores are formed at once


def _tiles(runs: tuple[tuple[int, int], ...]) -> list[tuple[int, int]]:
    """Runs cut into pieces of at most TILE rows, so a score matrix stays TILE x TILE."""
    tile = TILE
    return [(o + start, min(tile, n - start)) for o, n in runs for start in range(0, n, tile)]


@dataclass(frozen=True, slots=True)
class Pair:
    """A q run and a k/v run whose scores are computed together; `masked`: on the diagonal."""

    q: tuple[int, int]  # (offset, length) into the q rows
    kv: tuple[int, int]  # (offset, length) into the k/v rows
    masked: bool


def plan_pairs(q_pos: Tensor, kv_pos: Tensor, *, causal: bool, kv_blocks: int = 1,
               tiles: bool = True, window: int = 0) -> tuple[Pair, ...]:
    """The (q run, k/v run) pairs that see at least one key, k/v cut into `kv_blocks` blocks;
    with `tiles` every run is cut at TILE rows (a fused kernel takes whole runs); `window`
    W > 0 (causal only): a query at i sees the keys at i - W < j <= i."""
    _check_window(causal, window)
    cut = _tiles if tiles else (lambda runs: list(runs))
    sk = kv_pos.numel()
    if kv_blocks < 1 or sk % kv_blocks:
        divisors = [b for b in range(1, sk + 1) if sk % b == 0][:8]
        raise ShapeError(
            f"kv_blocks={kv_blocks} does not divide the {sk} k/v rows",
            hint=f"choose kv_blocks in {{{', '.join(map(str, divisors))}, ...}}",
        )
    q_runs = [(o, n, int(q_pos[o]), int(q_pos[o + n - 1])) for o, n in cut(position_runs(q_pos))]
    size = sk // kv_blocks
    kv_runs = []
    for start in range(0, sk, size):
        block = cut(position_runs(kv_pos[start:start + size]))
        kv_runs += [(start + o, n, int(kv_pos[start + o]), int(kv_pos[start + o + n - 1])) for o, n in block]
    pairs = []
    for qo, qn, q_first, q_last in q_runs:
        for ko, kn, k_first, k_last in kv_runs:
            if causal and k_first > q_last or window and k_last <= q_first - window:
                continue  # every key is after every query, or before every query's window
            cut_by_band = bool(window) and k_first <= q_last - window
            pairs.append(Pair((qo, qn), (ko, kn), masked=causal and k_last > q_first or cut_by_band))
    return tuple(pairs)


def _check_window(causal: bool, window: int) -> None:
    if window < 0 or window and not causal:
        raise ShapeError(f"attention window={window} with causal={causal}",
                         hint="a window is a number of keys >= 1 up to and including the query's own "
                              "position, so it needs causal attention; 0 means no window")
