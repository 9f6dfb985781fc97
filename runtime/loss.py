"""The cross-entropy kernel: mean over the global token count (or the sum over tokens),
with label smoothing and class weights, vocab-parallel under tp.

Logits of a 16-bit dtype are computed in float32 (as autocast and Megatron do; the
memory estimate counts it: fivedc/estimates/saved._cross_entropy). With the vocab split,
max, sum of exponentials and target logit are all-reduced; with ignore_index or class
weights the count of targets (their weights' sum) is all-reduced over the token shards
(or set for the whole step by a pipeline).

Each token's loss, as torch's: with eps = label_smoothing, C classes, w the class weights
(all 1 without) and W their sum, `(1 - eps) w_t (lse - z_t) + eps / C sum_c w_c (lse - z_c)`,
that is `a_t lse - b_t` with `a_t = (1 - eps) w_t + eps W / C` and `b_t = (1 - eps) w_t z_t +
eps / C sum_c w_c z_c`: b_t is a sum over the classes, so one all-reduce over the vocab
shards (the target logit's) carries it. The weights are a constant every rank holds whole.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from fivedc.ir.ops import parse_freqs
from fivedc.runtime.precision import compute_dtype


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Sum over local tokens of (a_t x logsumexp - b_t) x counted (0 for an ignored target),
    with the vocab split over a group: max, sum of exponentials and b_t (the target logit
    with smoothing and weights folded in) are all-reduced (3 collectives)."""

    @staticmethod
    def forward(fctx, logits, targets, counted, start, group, smoothing, weight):
        """One logits-sized buffer beside the logits: shifted, then its exponentials, then the
        softmax kept for backward, each in place (as Megatron's vocab-parallel loss)."""
        local_max = logits.max(dim=-1).values
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
        softmax = logits - local_max.unsqueeze(-1)
        inside = (targets >= start) & (targets < start + logits.shape[-1])
        index = torch.where(inside, targets - start, torch.zeros_like(targets))
        hit = (1 - smoothing) * weight[targets.clamp(min=0)] * inside  # (1 - eps) w_t where this rank holds t
        local_w = weight[start:start + logits.shape[-1]] * (smoothing / weight.numel())  # eps w_c / C
        target_logit = softmax.gather(-1, index.unsqueeze(-1)).squeeze(-1) * hit
        if smoothing:
            target_logit += softmax @ local_w
        sum_exp = softmax.exp_().sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        dist.all_reduce(target_logit, group=group)
        scale = (1 - smoothing) * weight[targets.clamp(min=0)] + smoothing * weight.mean()
        fctx.save_for_backward(softmax.div_(sum_exp.unsqueeze(-1)), index, hit, counted, scale, local_w)
        fctx.smoothing = smoothing
        return ((scale * sum_exp.log() - target_logit) * counted).sum()

    @staticmethod
    def backward(fctx, grad):
        """The gradient in the saved softmax's own buffer (backward runs once; nothing reads it again):
        a_t softmax - (1 - eps) w_t one-hot(t) - eps w / C."""
        softmax, index, hit, counted, scale, local_w = fctx.saved_tensors
        softmax.mul_(scale.unsqueeze(-1)).scatter_add_(-1, index.unsqueeze(-1), -hit.unsqueeze(-1))
        if fctx.smoothing:
            softmax.sub_(local_w)
        return softmax.mul_((grad * counted).unsqueeze(-1)), None, None, None, None, None, None


def cross_entropy(ctx, op, args, dims):
    """The sum over this rank's tokens (reduction='sum'), or that divided by the global count
    (mean): every token (no ignore_index, no weights), or the targets other than ignore_index
    (their weights' sum), counted over the token shards (an all-reduce, or the count of the
    whole step a pipeline set beforehand)."""
    logits, targets = args
    logits = logits.to(compute_dtype(logits.dtype))  # as autocast runs cross_entropy: float32 at least
    ignore = op.attr("ignore_index")
    counted = torch.ones_like(targets, dtype=logits.dtype) if ignore is None else (targets != ignore).to(logits.dtype)
    total = _token_sum(ctx, op, logits, targets, counted, dims)
    if op.attr("reduction", "mean") == "sum":
        return total
    if ignore is None and not op.attr("weight", ""):
        tokens = 1
        for dim in dims[1]:
            tokens *= ctx.graph.dim(dim)  # global count: the loss is a mean over all tokens
        return total / tokens
    count = ctx.step_counts.get(op.out)
    if count is None:
        count = counted_targets(ctx, op, targets)
    return total / count.to(total.dtype)  # counted in float64 (exact), the loss in the logits' dtype


def _token_sum(ctx, op, logits: Tensor, targets: Tensor, counted: Tensor, dims) -> Tensor:
    """The sum over this rank's tokens of each counted token's loss (vocab-parallel where the
    logits' last dim is split)."""
    vocab = dims[0][-1]
    sharding = op.arg_sharding(0)
    smoothing = float(op.attr("label_smoothing", 0.0))
    weight = class_weights(op, ctx.graph.dim(vocab), logits.dtype, logits.device)
    axes = sharding.axes_of(vocab)
    if axes and ctx.mesh.size(*axes) > 1:
        start, _ = ctx.shard_range(vocab, sharding)
        return _VocabParallelCrossEntropy.apply(logits, targets, counted, start, ctx.group(axes), smoothing, weight)
    flat = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).clamp(min=0), reduction="none",
                           label_smoothing=smoothing, weight=weight if op.attr("weight", "") else None)
    return (flat * counted.reshape(-1)).sum()


def class_weights(op, classes: int, dtype: torch.dtype, device) -> Tensor:
    """The op's class weights (its `weight` attr), all 1 when it has none."""
    text = op.attr("weight", "")
    if not text:
        return torch.ones(classes, dtype=dtype, device=device)
    return _weights(text).to(dtype=dtype, device=device)


@lru_cache(maxsize=8)
def _weights(text: str) -> Tensor:
    return torch.tensor(parse_freqs(text), dtype=torch.float64)


def counted_targets(ctx, op, targets: Tensor) -> Tensor:
    """How many targets of a cross-entropy with ignore_index count (with class weights: the sum
    of their weights), over all its token shards (the plan lists the all-reduce)."""
    ignore = op.attr("ignore_index")
    counted = torch.ones_like(targets, dtype=torch.bool) if ignore is None else targets != ignore
    if op.attr("weight", ""):
        weight = class_weights(op, 0, torch.float64, targets.device)
        count = (weight[targets.clamp(min=0)] * counted).sum()
    else:
        count = counted.sum().to(torch.float64)
    split = op.arg_sharding(1).split_axes()
    if split and ctx.mesh.size(*split) > 1:
        dist.all_reduce(count, group=ctx.group(split))
    return count
