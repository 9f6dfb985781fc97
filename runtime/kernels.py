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
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from fivedc.errors import NotSupportedError
from fivedc.ir.graph import Graph, Op
from fivedc.ir.mesh import Mesh, MeshAxis
from fivedc.ir.ops import OP_SPECS, POINTWISE, OpFamily, parse_freqs
from fivedc.ir.pointwise import Pointwise, resolve
from fivedc.runtime import tp_overlap, tp_ring, weight_grads
from fivedc.runtime.linear_paths import LinearFeed
from fivedc.runtime.attention import Ring, blockwise_attention, ring_attention
from fivedc.runtime.loss import cross_entropy
from fivedc.runtime.precision import compute_dtype, for_matmul
from fivedc.runtime.fp8 import Fp8Linear, fp8_cast
from fivedc.passes.fp8 import is_fp8
from fivedc.ir.seq_layout import layout_order
from fivedc.passes.attention_kernel import kernel_of
from fivedc.ir.sharding import Sharding


def index_device(device: torch.device) -> torch.device:
    """Where positions and other indices whose values the runtime reads live: beside the data,
    except on the meta device (a rehearsal), which has no values: there on the CPU."""
    return torch.device("cpu") if torch.device(device).type == "meta" else device

Dims = tuple[str, ...]


@dataclass(frozen=True)
class KernelContext:
    graph: Graph
    mesh: Mesh
    coords: dict[MeshAxis, int]
    groups: object | None = None  # runtime.groups.MeshGroups; None on a single device
    fp8_blocks: int = 1  # float8 linears: blocks of batch rows scaled apart (the reference; runtime/fp8.py)
    _cache: dict = field(default_factory=dict, compare=False, repr=False)
    # cross-entropy op -> its count of targets for the whole step, set by a pipeline before its microbatches
    step_counts: dict = field(default_factory=dict, compare=False, repr=False)

    def shard_range(self, dim: str, sharding: Sharding, coords: dict[MeshAxis, int] | None = None) -> tuple[int, int]:
        """Global [start, stop) of this rank's (or `coords`') chunk of `dim` (axes major-first)."""
        coords = coords or self.coords
        index = 0
        axes = sharding.axes_of(dim)
        for axis in axes:
            index = index * self.mesh.size(axis) + coords[axis]
        size = self.graph.local_size(dim, sharding, self.mesh)
        return index * size, (index + 1) * size

    def group(self, axes: tuple[MeshAxis, ...]):
        return self.groups.group(axes) if self.groups is not None else None

    # ---- the sequence layout (fivedc/ir/seq_layout.py) ------------------------------------
    def seq_order(self) -> Tensor | None:
        """The global position at each index of a layout-ordered sequence; None when
        the layout is the identity (cp = 1 or contiguous)."""
        if "order" not in self._cache:
            seq, cp = self.graph.seq_dim, self.mesh.size(MeshAxis.CP)
            order = layout_order(self.graph.seq_layout, self.graph.dim(seq), cp) if seq else []
            identity = order == list(range(len(order)))
            self._cache["order"] = None if identity else torch.tensor(order)
        return self._cache["order"]

    def storage_order(self, dim: str, sharding: Sharding) -> Tensor | None:
        """How a full tensor's `dim` is reordered before its chunks are cut, or None:
        the sequence in layout order; an experts dim split over ep by the placement
        (strided or explicit: rank r's experts stored together, in its order)."""
        if dim == self.graph.seq_dim:
            return self.seq_order()
        if MeshAxis.EP in sharding.axes_of(dim):
            if "experts" not in self._cache:
                self._cache["experts"] = _expert_orders(self.graph, self.mesh)
            return self._cache["experts"].get(dim)
        return None

    def positions(self, dim: str, sharding: Sharding, coords: dict[MeshAxis, int] | None = None) -> Tensor:
        """Global positions of this rank's chunk of `dim` (the sequence in layout order)."""
        start, stop = self.shard_range(dim, sharding, coords)
        order = self.seq_order() if dim == self.graph.seq_dim else None
        return torch.arange(start, stop) if order is None else order[start:stop]

    def ring(self, sharding: Sharding, device: torch.device) -> Ring:
        """The cp ring for K/V blocks split like `sharding`: neighbours and block positions."""
        if "ring" not in self._cache:
            cp_axes = (MeshAxis.CP,)
            members = self.mesh.group_ranks(cp_axes, self.mesh.rank_of(self.coords))
            index, size = self.coords[MeshAxis.CP], len(members)
            blocks = tuple(
                self.positions(self.graph.seq_dim, sharding, {**self.coords, MeshAxis.CP: j}).to(index_device(device))
                for j in range(size)
            )
            self._cache["ring"] = Ring(
                group=self.group(cp_axes), index=index, size=size,
                prev_rank=members[(index - 1) % size], next_rank=members[(index + 1) % size],
                block_positions=blocks,
            )
        return self._cache["ring"]


def _expert_orders(graph: Graph, mesh: Mesh) -> dict[str, Tensor]:
    """Experts dim -> storage order, for MoE ops whose placement is not contiguous."""
    from fivedc.ir.graph import Repeat, walk_ops
    from fivedc.passes.experts import ExpertLayout

    ep = mesh.size(MeshAxis.EP)
    params = {p.name: p for p in graph.body.params}
    orders: dict[str, list[int]] = {}
    for node, _ in walk_ops(graph.body):
        if isinstance(node, Repeat):
            params.update({p.name: p for p in node.body.params})
        if not (isinstance(node, Op) and node.kind == "moe" and ep > 1):
            continue
        dim = params[node.args[2]].dims[0]
        layout = ExpertLayout.of(node, graph.dim(dim), ep)
        order = [e for r in range(ep) for e in layout.local_experts(r)]
        if orders.setdefault(dim, order) != order:
            raise NotSupportedError(
                f"two MoE layers place the experts of dim {dim!r} differently", loc=node.loc,
                hint="give every layer the same @ep placement, or name their experts dims apart",
            )
    return {dim: torch.tensor(order) for dim, order in orders.items() if order != sorted(order)}


def align(t: Tensor, dims: Dims, target: Dims) -> Tensor:
    """View `t` (dims a subset of `target`) in `target`'s dim order, size 1 where absent."""
    order = [d for d in target if d in dims]
    t = t.permute([dims.index(d) for d in order])  # a list: a scalar (no dims) permutes too
    shape = [t.shape[order.index(d)] if d in dims else 1 for d in target]
    return t.reshape(shape)


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


class _RMSNorm(torch.autograd.Function):
    """x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps) over the last dim, saving only x
    and rstd for backward (as the fused norms Megatron uses), not the normalised x:
    dx = rstd * (dn - n * mean(dn * n)), dn = dy * w, n = x * rstd; dw = sum(dy * n)."""

    @staticmethod
    def forward(fctx, x: Tensor, w: Tensor, eps: float) -> Tensor:
        dtype = compute_dtype(x.dtype)
        xc = x.to(dtype)
        rstd = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
        fctx.save_for_backward(x, rstd, w)
        return (xc * rstd * w.to(dtype)).to(x.dtype)

    @staticmethod
    def backward(fctx, grad: Tensor):
        x, rstd, w = fctx.saved_tensors
        dtype = rstd.dtype
        n = x.to(dtype) * rstd
        g = grad.to(dtype)
        grad_x = grad_w = None
        if fctx.needs_input_grad[0]:
            dn = g * w.to(dtype)
            grad_x = (rstd * (dn - n * (dn * n).mean(-1, keepdim=True))).to(x.dtype)
        if fctx.needs_input_grad[1]:
            grad_w = (g * n).reshape(-1, n.shape[-1]).sum(0).reshape(w.shape).to(w.dtype)
        return grad_x, grad_w, None


def _rmsnorm(ctx, op, args, dims):
    x, w = args
    eps = float(op.attr("eps", 1e-5))
    shape = x.shape  # over the trailing dims w has: as one dim
    x, w = x.reshape(*shape[: x.dim() - w.dim()], -1), w.reshape(-1)
    if torch.compiler.is_compiling():  # a compiled region (runtime/regions.py): plain ops, which
        xc = x.to(compute_dtype(x.dtype))  # the compiler fuses and differentiates itself
        out = (xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps) * w.to(xc.dtype)).to(x.dtype)
    else:
        out = _RMSNorm.apply(x, w, eps)
    return out.reshape(shape)


def _swiglu(ctx, op, args, dims):
    if torch.compiler.is_compiling():
        return F.silu(args[0]) * args[1]
    return _SwiGLU.apply(args[0], args[1])


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up, saving only gate and up (silu(gate) is recomputed in backward, as
    Megatron's fused SwiGLU does): d_up = dy * silu(gate), d_gate = dy * up * s * (1 + gate
    * (1 - s)) with s = sigmoid(gate)."""

    @staticmethod
    def forward(fctx, gate: Tensor, up: Tensor) -> Tensor:
        fctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(fctx, grad: Tensor):
        gate, up = fctx.saved_tensors
        s = torch.sigmoid(gate)
        grad_up = grad * gate * s if fctx.needs_input_grad[1] else None
        grad_gate = grad * up * s * (1 + gate * (1 - s)) if fctx.needs_input_grad[0] else None
        return grad_gate, grad_up


def _layernorm(ctx, op, args, dims):
    x, w = args[0], args[1]
    b = args[2] if len(args) > 2 else None
    return F.layer_norm(x, x.shape[x.dim() - w.dim():], w, b, float(op.attr("eps", 1e-5)))


def _rope(ctx, op, args, dims):
    (x,), (x_dims,) = args, dims
    half = x.shape[-1] // 2
    cos, sin = _rope_table(ctx, op, x, x_dims)
    xc = x.to(cos.dtype)  # rotated in float32 at least, rounded once at the end (as a float32 table does)
    x1, x2 = xc[..., :half], xc[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def _rope_table(ctx, op, x: Tensor, x_dims: Dims) -> tuple[Tensor, Tensor]:
    """cos and sin of this rank's global positions times the frequencies, aligned to x;
    computed once per layout, dtype and device (every layer and step reuses them)."""
    seq, sharding = ctx.graph.seq_dim, op.arg_sharding(0)
    theta = float(op.attr("theta", 10000.0))
    given = str(op.attr("freqs", "") or "")
    key = ("rope", str(sharding), theta, given, x.shape[-1], x_dims, compute_dtype(x.dtype), x.device)
    if key not in ctx._cache:  # angles in float32 at least: bfloat16 cannot count positions past 256
        dtype = compute_dtype(x.dtype)
        positions = ctx.positions(seq, sharding).to(device=x.device, dtype=dtype)
        half = x.shape[-1] // 2
        if given:
            freqs = torch.tensor(parse_freqs(given), dtype=dtype, device=x.device)
        else:
            freqs = theta ** (-torch.arange(0, half, dtype=dtype, device=x.device) / half)
        angles = positions[:, None] * freqs[None, :]
        ctx._cache[key] = tuple(align(f(angles), (seq, x_dims[-1]), x_dims) for f in (torch.cos, torch.sin))
    return ctx._cache[key]


def _attention(ctx, op, args, dims):
    """SDPA on one device; across cp, blockwise attention at global positions: ring
    attention, or over the gathered K/V (one block per cp rank) for @cp(allgather).
    Scores capped by a `softcap` (which SDPA has not) take the blockwise kernel on one device too, and
    so does a sliding `window` (its pairs outside the band skipped, as across cp).
    The op's kernel (`passes/attention_kernel.py`): `math` runs SDPA's math backend
    (the scores materialised), and across cp the blocks by explicit matmuls."""
    q, k, v = [t.transpose(1, 2) for t in for_matmul(*args)]  # [batch, heads, seq, head_dim]
    causal, softcap = bool(op.attr("causal", True)), float(op.attr("softcap", 0.0) or 0.0)
    window = int(op.attr("window", 0) or 0)
    fused = kernel_of(op) != "math"
    cp = ctx.mesh.size(MeshAxis.CP)
    if cp == 1 and (softcap or window):
        pos = torch.arange(q.shape[2], device=index_device(q.device))
        return blockwise_attention(q, k, v, pos, pos, causal=causal, softcap=softcap, fused=fused,
                                   window=window).transpose(1, 2)
    if cp == 1 and fused and q.is_meta:  # a rehearsal: the fused kernel a GPU runs (meta would take SDPA's math)
        return _fused_on_meta(q, k, v, causal).transpose(1, 2)
    if cp == 1:  # grouped-query heads share K/V inside the kernel: no repeated copies are kept
        with contextlib.nullcontext() if fused else sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                  enable_gqa=q.shape[1] != k.shape[1]).transpose(1, 2)
    seq = ctx.graph.seq_dim
    q_pos = ctx.positions(seq, op.arg_sharding(0)).to(index_device(q.device))
    if op.annotation("cp").args[0] == "ring":
        out = ring_attention(q, k, v, q_pos, ctx.ring(op.arg_sharding(1), q.device), causal=causal, softcap=softcap,
                             fused=fused, window=window)
    else:
        kv_pos = ctx.positions(seq, op.arg_sharding(1)).to(index_device(q.device))
        out = blockwise_attention(q, k, v, q_pos, kv_pos, causal=causal, kv_blocks=cp, softcap=softcap, fused=fused,
                                  window=window)
    return out.transpose(1, 2)


def _fused_on_meta(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
    """The output of the kernel SDPA runs on a GPU, on meta tensors: flash attention (it shares
    K/V among grouped-query heads), or memory-efficient attention where v's head dim is not q's."""
    if q.shape[-1] == v.shape[-1]:
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[0]
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)[0]


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
    "swiglu": _swiglu,
    "rmsnorm": _rmsnorm,
    "layernorm": _layernorm,
    "rope": _rope,
    "attention": _attention,
    "cross_entropy": cross_entropy,
    "moe": _moe,
    "aten": _aten,
}
