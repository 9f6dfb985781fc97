"""A module buffer the forward adds to, in traced code: `self.counts.add_(value)` under no_grad.

Such a buffer is a state of the plan (`fivedc/ir/states.py`): the write becomes a `state_add`
op of the value, which its rule wants whole on every rank (a sum over the batch is computed
whole, as any reduction along the batch, so every rank adds the whole batch's value, as one
device does). Only an addition is read (`add_`, with alpha 1, of a value of the buffer's
shape); the buffer must be read nowhere else in the forward (a read would be a constant of
the plan, fixed when traced), and the write's result must not be used. Anything else stays
refused at its line. Under a pipeline of several microbatches each adds its rows' part: only a
sum over the batch that nothing else reads adds up to the one-device value; any other value is
refused there (`passes/microbatch_checks.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from fivedc.errors import NotSupportedError
from fivedc.frontends.fx.locs import node_loc
from fivedc.frontends.fx.values import DYNAMIC, Frame

if TYPE_CHECKING:  # the walk that calls this handler (it imports this module)
    from fivedc.frontends.fx.lower import Lowering

_ADDS = (torch.ops.aten.add_.Tensor, "add_", "__iadd__")


class BufferWritten:
    """The result of a buffer's write: no tensor the plan can read (a use is refused at its line)."""

    def __init__(self, key: str) -> None:
        self.key = key


def is_buffer_write(node: fx.Node) -> bool:
    """An in-place op whose first argument, which it writes, is a buffer read by `get_attr`."""
    if node.op not in ("call_function", "call_method") or not node.args:
        return False
    target = node.args[0]
    return isinstance(target, fx.Node) and target.op == "get_attr" and _writes_first(node)


def _writes_first(node: fx.Node) -> bool:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        first = t._schema.arguments[:1]
        return bool(first) and first[0].alias_info is not None and first[0].alias_info.is_write
    name = t if isinstance(t, str) else getattr(t, "__name__", "")
    return name in ("__iadd__", "__isub__", "__imul__", "__itruediv__") or \
        (name.endswith("_") and not name.startswith("_"))


def buffer_write(lw: Lowering, frame: Frame, node: fx.Node, args, kwargs):
    """The `state_add` op of `buffer.add_(value)` (see the module docstring)."""
    key = str(node.args[0].target)
    gm = frame.traced.gm
    try:
        buffer = gm.get_buffer(key)
    except AttributeError:
        raise lw.unsupported(node, f"an in-place addition to {key}, which is not a buffer of the module") from None
    if node.target not in _ADDS:
        raise NotSupportedError(
            f"a write of the buffer {key} other than an addition ({_name(node)}, fx node {node.name})",
            loc=node_loc(node), hint="the plan keeps a buffer the forward adds to (buffer.add_(value)); update "
            "it otherwise in an after-step hook (fivedc.parallelize(..., after_step=fn))")
    if frame.traced.path:  # a layer stack's body, traced once for every layer: torch.export keeps each
        raise lw.unsupported(node, f"a write of the buffer {key} in a layer stack traced once")
    if len(args) != 2 or kwargs.get("alpha", 1) != 1:
        raise lw.unsupported(node, f"{key}.add_ with alpha", "write buffer.add_(value) (value scaled first)")
    reads = [u for n in gm.graph.nodes if n.op == "get_attr" and n.target == key for u in n.users if u is not node]
    if reads:
        raise lw.unsupported(node, f"a write of the buffer {key}, which the forward also reads ({reads[0].name}): "
                             "the plan would read it as a constant fixed when traced")
    if not isinstance(args[1], DYNAMIC):  # a step counter: no IR value to add (never dropped silently)
        raise NotSupportedError(
            f"a write of the buffer {key} by a value computed from neither the inputs nor the parameters "
            f"(fx node {node.name})", loc=node_loc(node),
            hint="update it in an after-step hook (fivedc.parallelize(..., after_step=fn))")
    value = lw.tensor(frame, args[1], node)
    if tuple(frame.traced.values.get(node.args[1]).shape) != tuple(buffer.shape):
        raise lw.unsupported(node, f"{key}.add_ of a value broadcast to its shape {tuple(buffer.shape)}")
    lw.emit(frame, node, "state_add", (lw.value_of(frame, value, node),), value.ir, (("state", key),))
    return BufferWritten(key)


def _name(node: fx.Node) -> str:
    t = node.target
    return str(t) if isinstance(t, (str, torch._ops.OpOverload)) else getattr(t, "__name__", str(t))
