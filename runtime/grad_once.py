"""A parameter use whose gradient must count once over some mesh axes (`ArgSpec.grad_once`).

A tied table read by two ops that split their work differently (an embedding split
over the tokens, a linear after an op that runs whole) has one gradient, summed over
every axis one of its uses splits. The use whose work is whole over such an axis
computes the same gradient on each of its ranks; summed, it would count once per
rank. Its gradient is kept on the axes' first rank and is zero on the others.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fivedc.ir.mesh import MeshAxis


class _CountedOnce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, keep: bool) -> Tensor:
        ctx.keep = keep
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return (grad if ctx.keep else torch.zeros_like(grad)), None


def counted_once(x: Tensor, axes: tuple[MeshAxis, ...], coords: dict[MeshAxis, int]) -> Tensor:
    """`x`, whose gradient passes on the first rank of `axes` (coordinate 0 on each) and is
    zero on the others."""
    return _CountedOnce.apply(x, all(coords.get(axis, 0) == 0 for axis in axes))
