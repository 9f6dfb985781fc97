"""Local kernels: one function per op kind, computing on this rank's shards.

A kernel gets the op (its attrs, argument specs and output sharding), the local
argument tensors and their dim names, and a `KernelContext` that knows this rank's
coordinates and groups. Dims are matched by name: `align` permutes and unsqueezes
a tensor to another's dim order. The few kernels whose sharded form needs
communication inside (vocab-parallel cross-entropy) do it here with explicit
autograd, and the plan lists those collectives on the op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from fivedc.errors import NotSupportedError
from fivedc.ir import Graph, Op
from fivedc.mesh import Mesh, MeshAxis
from fivedc.sharding import Sharding

Dims = tuple[str, ...]


@dataclass(frozen=True)
class KernelContext:
    graph: Graph
    mesh: Mesh
    coords: dict[MeshAxis, int]
    groups: object | None = None  # runtime.groups.MeshGroups; None on a single device

    def shard_range(self, dim: str, sharding: Sharding) -> tuple[int, int]:
        """Global [start, stop) of this rank's chunk of `dim` (axes major-first)."""
        index = 0
        axes = sharding.axes_of(dim)
        for axis in axes:
            index = index * self.mesh.size(axis) + self.coords[axis]
        size = self.graph.local_size(dim, sharding, self.mesh)
        return index * size, (index + 1) * size

    def group(self, axes: tuple[MeshAxis, ...]):
        return self.groups.group(axes) if self.groups is not None else None


def align(t: Tensor, dims: Dims, target: Dims) -> Tensor:
    """View `t` (dims a subset of `target`) in `target`'s dim order, size 1 where absent."""
    order = [d for d in target if d in dims]
    t = t.permute(*[dims.index(d) for d in order])
    shape = [t.shape[order.index(d)] if d in dims else 1 for d in target]
    return t.reshape(shape)


def _arg_sharding(op: Op, index: int) -> Sharding:
    return op.arg_specs[index].sharding if op.arg_specs and op.arg_specs[index] else Sharding()


def _linear(ctx, op, args, dims):
    x, w = args
    k = len([d for d in dims[0] if d not in op.type.dims])
    return torch.tensordot(x, w, dims=k)


def _embedding(ctx, op, args, dims):
    tokens, table = args
    vocab = dims[1][0]
    sharding = _arg_sharding(op, 1)
    if not sharding.axes_of(vocab):
        return F.embedding(tokens, table)
    start, stop = ctx.shard_range(vocab, sharding)
    inside = (tokens >= start) & (tokens < stop)
    local = torch.where(inside, tokens - start, torch.zeros_like(tokens))
    return F.embedding(local, table) * inside.unsqueeze(-1).to(table.dtype)


def _binary(fn):
    def kernel(ctx, op, args, dims):
        a, b = args
        if not isinstance(b, Tensor):
            return fn(a, b)
        if len(dims[0]) >= len(dims[1]):
            return fn(a, align(b, dims[1], dims[0]))
        return fn(align(a, dims[0], dims[1]), b)

    return kernel


def _unary(fn):
    return lambda ctx, op, args, dims: fn(args[0])


def _gelu(ctx, op, args, dims):
    return F.gelu(args[0], approximate=str(op.attr("approximate", "none")))


def _rmsnorm(ctx, op, args, dims):
    x, w = args
    eps = float(op.attr("eps", 1e-5))
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _layernorm(ctx, op, args, dims):
    x, w = args[0], args[1]
    b = args[2] if len(args) > 2 else None
    return F.layer_norm(x, x.shape[-1:], w, b, float(op.attr("eps", 1e-5)))


def _rope(ctx, op, args, dims):
    (x,), (x_dims,) = args, dims
    seq = ctx.graph.seq_dim
    start, stop = ctx.shard_range(seq, _arg_sharding(op, 0))
    half = x.shape[-1] // 2
    theta = float(op.attr("theta", 10000.0))
    freqs = theta ** (-torch.arange(0, half, dtype=x.dtype, device=x.device) / half)
    angles = torch.arange(start, stop, dtype=x.dtype, device=x.device)[:, None] * freqs[None, :]
    cos = align(torch.cos(angles), (seq, x_dims[-1]), x_dims)
    sin = align(torch.sin(angles), (seq, x_dims[-1]), x_dims)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _attention(ctx, op, args, dims):
    q, k, v = (t.transpose(1, 2) for t in args)  # [batch, heads, seq, head_dim]
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=bool(op.attr("causal", True)))
    return out.transpose(1, 2)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Sum over local tokens of (logsumexp - target logit), with the vocab split over
    a group: max, sum of exponentials and target logit are all-reduced (3 collectives)."""

    @staticmethod
    def forward(fctx, logits, targets, start, group):
        local_max = logits.max(dim=-1).values
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - local_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        inside = (targets >= start) & (targets < start + logits.shape[-1])
        index = torch.where(inside, targets - start, torch.zeros_like(targets))
        target_logit = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1) * inside.to(logits.dtype)
        dist.all_reduce(target_logit, group=group)
        fctx.save_for_backward(exp / sum_exp.unsqueeze(-1), index, inside)
        return (sum_exp.log() - target_logit).sum()

    @staticmethod
    def backward(fctx, grad):
        softmax, index, inside = fctx.saved_tensors
        grad_logits = softmax.clone()
        grad_logits.scatter_add_(-1, index.unsqueeze(-1), -inside.to(softmax.dtype).unsqueeze(-1))
        return grad_logits * grad, None, None, None


def _cross_entropy(ctx, op, args, dims):
    logits, targets = args
    tokens = 1
    for dim in dims[1]:
        tokens *= ctx.graph.dim(dim)  # global count: the loss is a mean over all tokens
    vocab = dims[0][-1]
    sharding = _arg_sharding(op, 0)
    axes = sharding.axes_of(vocab)
    if axes and ctx.mesh.size(*axes) > 1:
        start, _ = ctx.shard_range(vocab, sharding)
        total = _VocabParallelCrossEntropy.apply(logits, targets, start, ctx.group(axes))
    else:
        total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
    return total / tokens


def _moe(ctx, op, args, dims):
    raise NotSupportedError(
        "executing MoE layers is not supported yet (they compile to a plan)", loc=op.loc,
        hint="verify a dense model, e.g. examples/gpt.5d",
    )


Kernel = Callable[[KernelContext, Op, list, list], Tensor]

KERNELS: dict[str, Kernel] = {
    "embedding": _embedding,
    "linear": _linear,
    "matmul": _linear,
    "add": _binary(torch.add),
    "sub": _binary(torch.sub),
    "mul": _binary(torch.mul),
    "div": _binary(torch.div),
    "gelu": _gelu,
    "silu": _unary(F.silu),
    "relu": _unary(F.relu),
    "tanh": _unary(torch.tanh),
    "sigmoid": _unary(torch.sigmoid),
    "swiglu": lambda ctx, op, args, dims: F.silu(args[0]) * args[1],
    "rmsnorm": _rmsnorm,
    "layernorm": _layernorm,
    "rope": _rope,
    "attention": _attention,
    "cross_entropy": _cross_entropy,
    "moe": _moe,
}
