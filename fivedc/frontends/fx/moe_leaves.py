"""MoE blocks kept whole while a model is traced: one `fivedc::moe_block` call per block.

A library's MoE block loops over its experts, indexes tokens by the routing and calls
kernels of its own (Hugging Face's `transformers::grouped_mm_fallback`); traced
through, it is a graph of data-dependent ops with no expert parallelism in it. While
`moe_leaves(module)` is active, every block `fivedc/frontends/fx/moe.py` recognises (the
outermost ones) computes instead

    out = scale * fivedc::moe_block(x, key) + sum of its shared children(x)

so torch.fx and torch.export both see one call of the custom op (its routed
experts), a multiplication by the scale, and the shared experts traced as ordinary
modules. The op computes the routed experts as the IR's `moe` does
(`MoeSpec.routed`, on the block's live parameters), so the example run of the
traced graph gives the values the frontend reads; its fake kernel gives the shape.
`leaf(key)` tells the lowering which block and reading a call is
(`fivedc/frontends/fx/moe_lower.py` makes the IR `moe` op of it). The blocks' `forward`s are
restored when the context ends.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from fivedc.frontends.fx.moe import MoeSpec, moe_spec, with_shared


@dataclass(frozen=True, slots=True)
class Leaf:
    block: nn.Module
    path: str  # the block's module path in the traced model: `model.layers.0.mlp`
    spec: MoeSpec
    experts: int

    def routed(self, x: Tensor) -> Tensor:
        bias = self.block.get_buffer(self.spec.bias) if self.spec.bias else None
        return self.spec.routed(dict(self.block.named_parameters()), x, bias)

    def logits(self, x: Tensor) -> Tensor:
        router = self.spec.router_value(dict(self.block.named_parameters()))
        return x.reshape(-1, x.shape[-1]) @ router


_LEAVES: dict[int, Leaf] = {}
_KEYS = itertools.count()


@torch.library.custom_op("fivedc::moe_block", mutates_args=())
def moe_block(x: Tensor, key: int) -> Tensor:
    """The routed experts of MoE block `key` (see the module docstring)."""
    return _LEAVES[key].routed(x)


@moe_block.register_fake
def _moe_block_fake(x: Tensor, key: int) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("fivedc::moe_block_logits", mutates_args=())
def moe_block_logits(x: Tensor, key: int) -> tuple[Tensor, Tensor]:
    """The routed experts of MoE block `key` and its router logits [tokens, experts]."""
    leaf = _LEAVES[key]
    return leaf.routed(x), leaf.logits(x)


@moe_block_logits.register_fake
def _moe_block_logits_fake(x: Tensor, key: int) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), x.new_empty(x.numel() // x.shape[-1], _LEAVES[key].experts)


MOE_OPS = (moe_block._opoverload, moe_block_logits._opoverload)


def leaf(key: int) -> Leaf:
    return _LEAVES[key]


def _forward(key: int, x: Tensor, *rest, **kwargs):
    this = _LEAVES[key]
    if rest or kwargs:
        raise TypeError(f"{type(this.block).__name__} is called with more than its tokens")
    if this.spec.logits:
        out, logits = moe_block_logits._opoverload(x, key)
    else:
        out = moe_block._opoverload(x, key)
    if this.spec.scale != 1.0:
        out = out * this.spec.scale
    out = with_shared(lambda name: this.block.get_submodule(name)(x), this.spec.shared, this.spec.gates, out)
    return (out, logits) if this.spec.logits else out


def blocks(module: nn.Module) -> list[tuple[str, nn.Module, MoeSpec]]:
    """The outermost recognised MoE blocks of `module`, with their readings."""
    found: list[tuple[str, nn.Module, MoeSpec]] = []
    for path, sub in module.named_modules():
        if not path or any(path.startswith(p + ".") for p, _, _ in found):
            continue
        spec = moe_spec(sub)
        if spec is not None:
            found.append((path, sub, spec))
    return found


@contextlib.contextmanager
def moe_leaves(module: nn.Module, *, on: bool = True):
    """While active, each recognised MoE block of `module` computes through `fivedc::moe_block`."""
    patched: list[tuple[nn.Module, object, int]] = []
    try:
        for path, block, spec in blocks(module) if on else ():
            key = next(_KEYS)
            experts = spec.weights[2].ir_value(dict(block.named_parameters())).shape[0]
            _LEAVES[key] = Leaf(block, path, spec, experts)
            patched.append((block, block.__dict__.get("forward"), key))

            def forward(*args, _key=key, **kwargs):
                return _forward(_key, *args, **kwargs)

            block.forward = forward
        yield
    finally:
        for block, before, key in patched:
            if before is None:
                del block.forward
            else:
                block.forward = before
            _LEAVES.pop(key, None)
