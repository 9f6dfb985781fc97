"""Activation recomputation at run time: a region keeps its inputs, not what it computes.

`run_recomputed(ctx, fn, *args)` runs `fn` under `torch.utils.checkpoint` (the
non-reentrant kind): autograd keeps no tensor that `fn` saves, only the region's
inputs, and when backward first needs one of them the region's forward runs again
to rebuild them. The plan says which regions (`passes/recompute.py`): under
`selective` each attention op's kernel, under `full` each layer of a repeat.

A recomputed forward must do what the first one did, on every rank:

- The same collectives, in the same order. Recomputation happens at the same point
  of every rank's backward (the region's first saved tensor is unpacked by the same
  node of the same graph: the plan is SPMD), and `early_stop=False` makes it run the
  whole region. torch's default stops as soon as the last tensor backward needs is
  rebuilt, which could leave a rank with a region's later collectives (a ring hop, a
  reduce-scatter, an all-to-all) unissued while its peers issue them.
- The same numbers. The kernels draw no random numbers (a plan names only pure ops),
  and the RNG state is restored anyway (`preserve_rng_state`); torch checks that the
  recomputed tensors have the shapes and dtypes of the first ones.
- No second side effect: a MoE layer records its tokens per expert and its bias
  update counts once per forward, so it asks `recomputing(ctx)` and records nothing
  while its forward is being redone.

ZeRO-3's saved-tensor hook (`runtime/zero.py`) still applies outside the regions;
inside one, checkpoint's own hook is innermost, so a gathered parameter is not
saved there either, and the recomputation gathers it again (the same all-gather on
every rank, in the same place).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from fivedc.runtime.saved import held

KEY = "recomputing"  # in the KernelContext's cache: True while a region's forward is redone


def recomputing(ctx) -> bool:
    """Whether the kernel running now is a recomputation (backward redoing a forward)."""
    return bool(ctx._cache.get(KEY, False))


@contextlib.contextmanager
def _redoing(ctx):
    before = ctx._cache.get(KEY, False)
    ctx._cache[KEY] = True
    try:
        yield
    finally:
        ctx._cache[KEY] = before


def run_recomputed(ctx, fn: Callable, *args, holding: tuple = ()):
    """`fn(*args)`, its saved tensors dropped and rebuilt in backward; plainly `fn(*args)`
    when no graph is being recorded (under `torch.no_grad()`). `holding`: the tensors `fn`
    reads from outside (its closure), which checkpoint keeps like its arguments."""
    if not torch.is_grad_enabled():
        return fn(*args)
    held(t for a in (*args, *holding) for t in (a if isinstance(a, (list, tuple)) else (a,))
         if isinstance(t, torch.Tensor))  # kept for backward: count them (the recorder's)
    return checkpoint(fn, *args, use_reentrant=False, early_stop=False, preserve_rng_state=True,
                      context_fn=lambda: (contextlib.nullcontext(), _redoing(ctx)))
