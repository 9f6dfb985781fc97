"""A float8 linear (`--fp8`, `passes/fp8.py`), emulated as torchao's tensorwise recipe computes it.

torchao's `matmul_with_hp_or_float8_args` (torchao/float8/float8_linear.py) with its default
`Float8LinearConfig()`: forward casts the input and the weight to float8 e4m3, backward the
output gradient to e5m2; dX = dY8 W8, dW = X8^T dY8; autograd keeps the input and weight at
the training dtype. A cast (torchao/float8/float8_utils.py, float8_scaling_utils.py):

    amax  = max |t|                          (over the whole tensor as the call sees it)
    scale = float32(finfo(fp8).max / max(amax, 1e-12))     (`amax_to_scale`, in float64)
    t8    = clamp(t * scale, -max, max).to(fp8)            (`_to_fp8_saturated`)

Here each operand is cast so and back (`t8 / scale` at the compute dtype), and the matmul runs
at the compute dtype on those values: the numbers a `torch._scaled_mm` multiplies, summed at
the compute dtype rather than its float32 accumulator, so a float64 run stays exact to
reassociation and one device and a layout agree as for any other op. The forward's scales of
x and w are kept for backward (two float32 scalars; torchao computes the same ones again).

The amax of a tensor split within a sample (tp, cp) is all-reduced (max) over those axes, as
torchao's DTensor does over tp; the rows of a data-parallel rank and of a pipeline microbatch
are scaled on their own (`blocks`: the single-device reference scales its batch in as many
blocks as the parallel plan has rows apart: dp x ep x microbatches, `reference_blocks`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from fivedc.ir.graph import Op
from fivedc.passes.fp8 import operand_amax_axes

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2  # torchao's e4m3_dtype, e5m2_dtype (not fnuz)
EPS = 1e-12  # torchao/float8/float8_utils.py EPS: the smallest amax a scale divides by


@dataclass(frozen=True)
class Operand:
    """How one operand of a float8 linear is scaled: its float8 dtype, the group its amax is
    all-reduced over (None: its own), and the position of its batch dim with the blocks of
    rows scaled apart (`blocks` 1: the whole tensor)."""

    dtype: torch.dtype
    group: object | None = None
    batch: int | None = None
    blocks: int = 1

    def scale(self, t: Tensor) -> Tensor:
        """float32 scale(s): a scalar, or one per block of rows shaped to broadcast over t."""
        with torch.no_grad():
            a = t.detach()
            if self.blocks > 1 and self.batch is not None:
                rows = a.movedim(self.batch, 0).reshape(self.blocks, -1)
                amax = torch.maximum(rows.amax(dim=1), -rows.amin(dim=1))  # max |t| without a copy of |t|
            else:
                amax = torch.maximum(a.max(), -a.min())
            if self.group is not None:
                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
            scale = (torch.finfo(self.dtype).max / torch.clamp(amax.to(torch.float64), min=EPS)).to(torch.float32)
            if scale.dim():  # one per block: repeated over its rows, along the batch dim
                scale = scale.repeat_interleave(a.shape[self.batch] // self.blocks)
                shape = [1] * a.dim()
                shape[self.batch] = a.shape[self.batch]
                scale = scale.reshape(shape)
            return scale

    def cast(self, t: Tensor, scale: Tensor) -> Tensor:
        """t through float8 and back, at t's dtype (what the float8 matmul multiplies). The
        float32 (float64) working copies are made a slab of rows at a time (rows: t's leading
        dims together), so the cast holds about its output beyond t, as a GPU's fused cast
        kernel holds its float8 output."""
        top, wide = torch.finfo(self.dtype).max, torch.promote_types(t.dtype, torch.float32)
        flat = t.reshape(-1, t.shape[-1]) if t.dim() >= 2 else t.reshape(1, -1)
        rows, step = flat.shape[0], max(1, CAST_SLAB // max(1, flat.shape[1]))
        if scale.dim():  # one per block of batch rows (a leading dim): one per row of `flat`
            scale = scale.expand(*t.shape[:-1], 1).reshape(-1, 1)
        out = torch.empty_like(flat)
        with torch.no_grad():  # torchao scales in float32 (`hp_tensor.to(torch.float32) * scale`); float64 stays
            # on the meta device (a rehearsal) the slabs are alike and have no values: the first
            # stands for all (the same storages live at once), so a full-scale rank stays quick
            for start in range(0, rows if t.device.type != "meta" else min(rows, step), step):
                s = scale[start:start + step] if scale.dim() else scale
                y = flat[start:start + step].to(wide, copy=True).mul_(s).clamp_(-top, top)
                out[start:start + step].copy_(y.to(self.dtype).to(wide).div_(s))
        return out.reshape(t.shape)


CAST_SLAB = 2**22  # elements a cast's working copies hold at once (16 MiB in float32)


@dataclass(frozen=True)
class Fp8Cast:
    x: Operand
    w: Operand
    dy: Operand


def fp8_cast(ctx, op: Op, x_dims: tuple[str, ...]) -> Fp8Cast:
    """The casts of one float8 linear on this rank (kept on the kernel context)."""
    key = ("fp8", op.out)
    if key not in ctx._cache:
        graph, mesh = ctx.graph, ctx.mesh
        blocks = getattr(ctx, "fp8_blocks", 1)

        def operand(which: str, dtype: torch.dtype, dims) -> Operand:
            axes = operand_amax_axes(op, graph, mesh, which)
            batch = dims.index(graph.batch_dim) if dims is not None and graph.batch_dim in dims else None
            return Operand(dtype, ctx.group(axes) if axes else None, batch, blocks if batch is not None else 1)

        ctx._cache[key] = Fp8Cast(operand("x", E4M3, tuple(x_dims)), operand("w", E4M3, None),
                                  operand("dy", E5M2, tuple(op.type.dims)))
    return ctx._cache[key]


class Fp8Linear(torch.autograd.Function):
    """`tensordot(x, w, dims=k)` in float8 (x's trailing k dims against w's leading k)."""

    @staticmethod
    def forward(fctx, x: Tensor, w: Tensor, k: int, cast: Fp8Cast) -> Tensor:
        sx, sw = cast.x.scale(x), cast.w.scale(w)
        fctx.k, fctx.cast = k, cast
        fctx.save_for_backward(x, w, sx, sw)
        return torch.tensordot(cast.x.cast(x, sx), cast.w.cast(w, sw).to(x.dtype), dims=k)

    @staticmethod
    def backward(fctx, dy: Tensor):
        x, w, sx, sw = fctx.saved_tensors
        k, cast = fctx.k, fctx.cast
        dy8 = cast.dy.cast(dy, cast.dy.scale(dy))
        out = w.dim() - k  # the output's trailing dims, made by w
        lead = x.dim() - k
        dx = dw = None
        if fctx.needs_input_grad[0]:
            w8 = cast.w.cast(w, sw).to(dy8.dtype)
            dx = torch.tensordot(dy8, w8, dims=(list(range(lead, lead + out)), list(range(k, k + out))))
        if fctx.needs_input_grad[1]:
            x8 = cast.x.cast(x, sx)
            dw = torch.tensordot(x8, dy8, dims=(list(range(lead)), list(range(lead)))).to(w.dtype)
        return dx, dw, None, None


def reference_blocks(plan) -> int:
    """Blocks of rows the single-device reference scales apart to meet `plan`: each data-parallel
    rank's rows (dp x ep) in each of its microbatches."""
    from fivedc.ir.mesh import MeshAxis

    m = plan.pipeline.microbatches if plan.pipeline is not None else 1
    return plan.mesh.size(MeshAxis.DP) * plan.mesh.size(MeshAxis.EP) * m
