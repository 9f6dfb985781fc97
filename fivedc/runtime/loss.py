"""The cross-entropy kernel: mean over the global token count (or the sum over tokens),
with label smoothing, vocab-parallel under tp.

Logits of a 16-bit dtype are computed in float32 (as autocast and Megatron do; the
memory estimate counts it: fivedc/estimates/saved._cross_entropy). With the vocab split,
max, sum of exponentials and target logit are all-reduced; with ignore_index the count
of targets is all-reduced over the token shards (or set for the whole step by a pipeline).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from fivedc.runtime.precision import compute_dtype


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Sum over local tokens of (logsumexp - target logit) x counted (0 for an ignored
    target), with the vocab split over a group: max, sum of exponentials and target
    logit are all-reduced (3 collectives)."""

    @staticmethod
    def forward(fctx, logits, targets, counted, start, group, smoothing, classes):
        """One logits-sized buffer beside the logits: shifted, then its exponentials, then the
        softmax kept for backward, each in place (as Megatron's vocab-parallel loss). Label
        smoothing eps rides on the target logit's all-reduce: (1 - eps) x the target's shifted
        logit + eps x the mean of the shifted logits is a sum over the vocab shards too."""
        local_max = logits.max(dim=-1).values
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
        softmax = logits - local_max.unsqueeze(-1)
        inside = (targets >= start) & (targets < start + logits.shape[-1])
        index = torch.where(inside, targets - start, torch.zeros_like(targets))
        target_logit = softmax.gather(-1, index.unsqueeze(-1)).squeeze(-1) * inside.to(logits.dtype)
        if smoothing:
            target_logit = (1 - smoothing) * target_logit + smoothing / classes * softmax.sum(dim=-1)
        sum_exp = softmax.exp_().sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        dist.all_reduce(target_logit, group=group)
        fctx.save_for_backward(softmax.div_(sum_exp.unsqueeze(-1)), index, inside, counted)
        fctx.smoothing, fctx.classes = smoothing, classes
        return ((sum_exp.log() - target_logit) * counted).sum()

    @staticmethod
    def backward(fctx, grad):
        """The gradient in the saved softmax's own buffer (backward runs once; nothing reads it again):
        softmax - (1 - eps) x one-hot(target) - eps / classes."""
        softmax, index, inside, counted = fctx.saved_tensors
        hit = -(1 - fctx.smoothing) * inside.to(softmax.dtype).unsqueeze(-1)
        softmax.scatter_add_(-1, index.unsqueeze(-1), hit)
        if fctx.smoothing:
            softmax.sub_(fctx.smoothing / fctx.classes)
        return softmax.mul_((grad * counted).unsqueeze(-1)), None, None, None, None, None, None


def cross_entropy(ctx, op, args, dims):
    """The sum over this rank's tokens (reduction='sum'), or that divided by the global count
    (mean): every token (no ignore_index), or the targets other than ignore_index, counted over
    the token shards (an all-reduce, or the count of the whole step a pipeline set beforehand)."""
    logits, targets = args
    logits = logits.to(compute_dtype(logits.dtype))  # as autocast runs cross_entropy: float32 at least
    ignore = op.attr("ignore_index")
    counted = torch.ones_like(targets, dtype=logits.dtype) if ignore is None else (targets != ignore).to(logits.dtype)
    total = _token_sum(ctx, op, logits, targets, counted, dims)
    if op.attr("reduction", "mean") == "sum":
        return total
    if ignore is None:
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
    axes = sharding.axes_of(vocab)
    if axes and ctx.mesh.size(*axes) > 1:
        start, _ = ctx.shard_range(vocab, sharding)
        return _VocabParallelCrossEntropy.apply(logits, targets, counted, start, ctx.group(axes), smoothing,
                                                ctx.graph.dim(vocab))
    flat = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).clamp(min=0), reduction="none",
                           label_smoothing=smoothing)
    return (flat * counted.reshape(-1)).sum()


def counted_targets(ctx, op, targets: Tensor) -> Tensor:
    """How many targets of a cross-entropy with ignore_index count, over all its token
    shards (the plan lists the all-reduce)."""
    count = (targets != op.attr("ignore_index")).sum().to(torch.float64)
    split = op.arg_sharding(1).split_axes()
    if split and ctx.mesh.size(*split) > 1:
        dist.all_reduce(count, group=ctx.group(split))
    return count
