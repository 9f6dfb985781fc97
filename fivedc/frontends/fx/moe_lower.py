"""Lowering a `fivedc::moe_block` call (`fivedc/frontends/fx/moe_leaves.py`) to the IR's `moe` op.

The call stands for the routed experts of one recognised MoE block; its reading
(`fivedc/frontends/fx/moe.py`: `MoeSpec`) says which of the block's parameters is the router
and which the gate, up and down weights, and how they are stored. The IR's router is
[hidden, experts], its expert weights [experts, hidden, ffn] (gate, up) and
[experts, ffn, hidden] (down); every IR parameter maps back to the module's own by
a transpose, a half of a fused gate-up (`rows` along its output dim), or, for
experts kept as separate modules, a stack of their weights (`fivedc/frontends/fx/params.py`).
The block's scale and shared experts are outside the call, traced as ordinary ops. Its
routing bias and tokens-per-expert buffers (`fivedc/frontends/fx/moe_states.py`) are the op's
`bias_state` and `count_state`, by their module keys (`fivedc/ir/states.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.fx as fx

from fivedc.frontends.fx.moe_weights import ExpertWeight
from fivedc.frontends.fx.moe_leaves import leaf
from fivedc.frontends.fx.values import Frame, RouterLogits, T

if TYPE_CHECKING:  # the walk that calls this handler (it imports this module)
    from fivedc.frontends.fx.lower import Lowering

_PARTS = ("gate", "up", "down")


def moe_block(lw: Lowering, frame: Frame, node: fx.Node, args, kwargs):
    """One IR `moe` op for the block's routed experts; with the router logits beside it when the
    block returns them (`RouterLogits`: they may not be used)."""
    this = leaf(args[1])
    prefix = _relative(frame, this.path)
    spec, params = this.spec, dict(this.block.named_parameters())
    x = lw.tensor(frame, args[0], node)
    g, ir = lw.groups(x)[-1], lw.ir(x)
    if len(g) != 1 or ir[-1] != g[0]:
        raise lw.unsupported(node, "an MoE block over a dim that is not the tensor's last")
    hidden = g[0]
    down = spec.weights[2].ir_value(params)
    experts = lw.dims.new(down.shape[0], "experts", 60)
    ffn = lw.dims.new(down.shape[1], "expert_ffn", 60)
    lw.unify((hidden,), (lw.dims.new(down.shape[2]),), node, "the MoE block's hidden dim is not the tokens' last dim")
    key = prefix + spec.router
    router = lw.param(frame, node, key=key, module=key.rpartition(".")[0], attr=key.rpartition(".")[2],
                      atoms=(hidden, experts), init="normal", shape=tuple(params[spec.router].shape),
                      transpose=spec.router_transposed, role="an MoE router")
    atoms = ((experts, hidden, ffn), (experts, hidden, ffn), (experts, ffn, hidden))
    ws = [_weight(lw, frame, node, prefix, spec.experts, w, params, a, part)
          for w, a, part in zip(spec.weights, atoms, _PARTS)]
    attrs = (("top_k", spec.top_k), ("score", spec.score), ("normalize", spec.normalize))
    aux = getattr(this.block, "fivedc_aux_loss", 0.0)
    if isinstance(aux, bool) or not isinstance(aux, (int, float)) or aux < 0:
        raise lw.unsupported(node, f"{type(this.block).__name__}.fivedc_aux_loss = {aux!r}",
                             "fivedc_aux_loss is the Switch balancing loss coefficient: a number >= 0 (0.01)")
    if aux:
        attrs += (("aux_loss", float(aux)),)
    attrs += _states(lw, node, this, prefix)
    base = this.path.rpartition(".")[2]  # the block's own name: `moe`, `mlp`, `block_sparse_moe`
    out = T(lw.emit(frame, node, "moe", (x.ref, router, *ws), ir, attrs, base=base), x.ir, x.layout)
    if spec.logits:
        return out, RouterLogits(this.path, type(this.block).__name__, node)
    return out


def _states(lw: Lowering, node: fx.Node, this, prefix: str) -> tuple:
    """The block's routing bias and tokens-per-expert buffers as the op's states (their module keys:
    `fivedc/ir/states.py`); not in a layer stack's body, whose one op stands for every layer's."""
    spec = this.spec
    if not (spec.bias or spec.counts):
        return ()
    if prefix != this.path + ".":  # Unrecognised: the model is captured again with torch.export (no stack)
        raise lw.unsupported(node, f"an MoE block with state (its buffer {spec.bias or spec.counts}) in a layer "
                             "stack traced once", "trace without the stack (torch.export keeps every layer)")
    return tuple((attr, f"{this.path}.{name}") for attr, name in (("bias_state", spec.bias),
                                                                  ("count_state", spec.counts)) if name)


def _relative(frame: Frame, path: str) -> str:
    """The block's path relative to the frame's module (a repeat body is traced from its layer 0), with a dot."""
    base = frame.traced.path
    if base and not path.startswith(base + "."):
        raise AssertionError(f"MoE block {path} traced in {base}")
    return (path[len(base) + 1:] if base else path) + "."


def _weight(lw: Lowering, frame: Frame, node: fx.Node, prefix: str, listed: str, w: ExpertWeight, params, atoms,
            part: str):
    """The IR parameter of one expert weight: stacked, a half of a fused one, or the experts' own stacked."""
    shape = tuple(params[w.keys[0]].shape)
    rows = axis = None
    if w.half is not None:  # the output dim: [.., out, in] when stored transposed, [.., in, out] otherwise
        axis = len(shape) - (2 if w.transposed else 1)
        n = shape[axis] // 2
        rows = (w.half * n, (w.half + 1) * n)
    common = dict(atoms=atoms, init="normal", shape=shape, rows=rows, axis=axis or 0, transpose=w.transposed,
                  part=part if w.half is not None else "", role="an MoE expert weight")
    if w.per_expert:  # separate experts: `experts.{e}.w1.weight`, stacked
        name = w.keys[0].removeprefix(f"{listed}.0.").removesuffix(".weight").replace(".", "_")
        return lw.param(frame, node, key="", stack=tuple(prefix + k for k in w.keys),
                        module=prefix + listed, attr=name, **common)
    key = prefix + w.keys[0]
    return lw.param(frame, node, key=key, module=key.rpartition(".")[0], attr=key.rpartition(".")[2], **common)
