"""Local kernels: one function per op kind, computing on this rank's shards. A pointwise op's
kernel calls the torch function its definition names (`_pointwise`, fivedc/ir/pointwise.py).

A kernel gets the op (its attrs, argument specs and output sharding), the local
argument tensors and their dim names, and a `KernelContext` that knows this rank's
coordinates, groups and the sequence layout (global positions of a local chunk,
for RoPE and the causal mask). Dims are matched by name: `align` permutes and
unsqueezes a tensor to another's dim order. The kernels whose sharded form needs
communication inside (vocab-parallel cross-entropy, ring attention) do it with
explicit autograd, and the plan lists those collectives on the op. The linear kernel
(`_linear`) also takes what the program hands it where the plan runs a linear beside
tensor-parallel collectives: a `LinearFeed` (`runtime/linear_paths.py`).

The context is `runtime/kernel_context.py`; the norms and swiglu are
`runtime/norm_kernels.py`, rope and attention `runtime/sequence_kernels.py`; the
table (`KERNELS`) and the other kernels are here.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from fivedc.ir.graph import Op
from fivedc.ir.ops import OP_SPECS, POINTWISE, OpFamily
from fivedc.ir.pointwise import Pointwise, resolve
from fivedc.runtime import tp_overlap, tp_ring, weight_grads
from fivedc.runtime.linear_paths import LinearFeed
from fivedc.runtime.loss import cross_entropy
from fivedc.runtime.precision import for_matmul
from fivedc.runtime.fp8 import Fp8Linear, fp8_cast
from fivedc.passes.fp8 import is_fp8
from fivedc.runtime.kernel_context import KernelContext, align
from fivedc.runtime.norm_kernels import layernorm, rmsnorm, swiglu
from fivedc.runtime.sequence_kernels import attention, rope


def _linear(ctx, op, args, dims, feed: LinearFeed | None = None):
    """`tensordot(x, w)` over x's dims the output drops, by one of these paths:

    - float8 (`runtime/fp8.py`): its own autograd (the program feeds it nothing);
    - with the program's `feed` (`runtime/linear_paths.py`), the product made chunk
      by chunk as `feed.gather`'s ring brings x, or into `feed.summing` as that sum needs
      them (collective matmul, `runtime/tp_ring.py`), entering autograd by one of:
    - put-off dW (`feed.put_off`, while grad is enabled): dX now, dW while x's gradient is
      summed over tp (`runtime/tp_overlap.py`);
    - zero-bubble (a weight-gradient store, while grad is enabled and w needs a gradient):
      dW may wait for W (`runtime/weight_grads.py`);
    - `tp_ring.Product` (a value made by chunks): a ring summing it can bring its gradient
      back by chunks;
    - plain `tensordot`.
    """
    x, w = args
    k = len([d for d in dims[0] if d not in op.type.dims])
    order = None
    if tuple(dims[1][:k]) != tuple(dims[0][-k:]):  # stored [out, in] (a tied embedding table): in first
        order = (*range(w.dim() - k, w.dim()), *range(w.dim() - k))
    oriented = w if order is None else w.permute(order)
    if is_fp8(op):
        x, oriented = for_matmul(x, oriented)
        return Fp8Linear.apply(x, oriented.to(x.dtype), k, fp8_cast(ctx, op, tuple(dims[0])))
    feed = feed if feed is not None else LinearFeed()
    value = None  # collective matmul: the product made as a ring brings x, or as a ring sums it
    if feed.summing is not None:
        value = tp_ring.summed_product(x, oriented, k, feed.summing)
    elif feed.gather is not None:
        value = tp_ring.product(x, oriented, k, feed.gather)
    if feed.put_off is not None and torch.is_grad_enabled():
        undo = None if order is None else tuple(sorted(range(len(order)), key=order.__getitem__))
        x, held = for_matmul(x, oriented.detach())
        return tp_overlap.PutOffLinear.apply(x, held, k, feed.put_off, feed.put_off_index, undo, value)
    w = oriented
    store = weight_grads.store_of(ctx)
    if store is not None and torch.is_grad_enabled() and w.requires_grad:
        return weight_grads.DeferrableLinear.apply(*for_matmul(x), w, k, store, value)  # casts the leaf w itself
    if value is not None:
        summing = feed.summing if isinstance(feed.summing, tp_ring.RingSum) else None
        return tp_ring.Product.apply(*for_matmul(x, w), k, value, summing)
    return torch.tensordot(*for_matmul(x, w), dims=k)


def _embedding(ctx, op, args, dims):
    """Rows of the table (vocab-parallel: each rank its rows, zeros elsewhere); with padding_idx,
    that row's tokens give the table no gradient (torch's F.embedding(padding_idx=))."""
    tokens, table = args
    vocab = dims[1][0]
    sharding = op.arg_sharding(1)
    if not sharding.axes_of(vocab):
        out = F.embedding(tokens, table)
    else:
        start, stop = ctx.shard_range(vocab, sharding)
        inside = (tokens >= start) & (tokens < stop)
        local = torch.where(inside, tokens - start, torch.zeros_like(tokens))
        out = F.embedding(local, table) * inside.unsqueeze(-1).to(table.dtype)
    padding = op.attr("padding_idx")
    if padding is not None:
        out = torch.where((tokens == padding).unsqueeze(-1), out.detach(), out)
    return out


def _binary(fn):
    def kernel(ctx, op, args, dims):
        a, b = args
        if not isinstance(b, Tensor):
            return fn(a, b)
        if len(dims[0]) >= len(dims[1]):
            return fn(a, align(b, dims[1], dims[0]))
        return fn(align(a, dims[0], dims[1]), b)

    return kernel


def _unary(fn, attrs):
    """fn(x) with the op's attributes as keywords (gelu: approximate=), each as its default's type."""
    def kernel(ctx, op, args, dims):
        return fn(args[0], **{name: type(default)(op.attr(name, default)) for name, default in attrs})

    return kernel


def _pointwise(kind: str, pointwise: Pointwise):
    """A pointwise op's kernel: its torch function (fivedc/ir/pointwise.py), on one operand or two."""
    fn, spec = resolve(pointwise.torch), OP_SPECS[kind]
    return _binary(fn) if spec.family == OpFamily.ELEMENTWISE else _unary(fn, spec.attrs)


def _state_add(ctx, op, args, dims):
    """The module buffer `state` gains the value (a recomputed forward adds nothing): runtime/states.py."""
    from fivedc.runtime.recompute import recomputing
    from fivedc.runtime.states import add_to_state

    if not recomputing(ctx):
        add_to_state(ctx, str(op.attr("state")), args[0].detach())
    return args[0]


def _aten(ctx, op, args, dims):
    """An ATen operator (fivedc/ir/aten_call.py): runtime/aten_kernel.py."""
    from fivedc.runtime.aten_kernel import aten_kernel

    return aten_kernel(ctx, op, args, dims)


def _moe(ctx, op, args, dims):
    """Routing, dispatch over ep, the local experts as batched matmuls, combine: runtime/moe.py."""
    from fivedc.runtime.moe import moe_kernel

    return moe_kernel(ctx, op, args, dims)


Kernel = Callable[[KernelContext, Op, list, list], Tensor]

KERNELS: dict[str, Kernel] = {
    "embedding": _embedding,
    "linear": _linear,
    "matmul": _linear,
    **{kind: _pointwise(kind, pointwise) for kind, pointwise in POINTWISE.items()},
    "state_add": _state_add,
    "swiglu": swiglu,
    "rmsnorm": rmsnorm,
    "layernorm": layernorm,
    "rope": rope,
    "attention": attention,
    "cross_entropy": cross_entropy,
    "moe": _moe,
    "aten": _aten,
}
