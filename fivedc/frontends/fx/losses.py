"""The loss by its value: torch's cross-entropy in each form it accepts, as the IR's one op.

`F.cross_entropy` / `nn.CrossEntropyLoss` over logits `[N, C]` or `[N, C, d1, ...]` (the
class dim second; the transpose is a layout), with `ignore_index` (torch's -100 unless
given), `label_smoothing` and `reduction` 'mean' or 'sum', is the IR's `cross_entropy`
with those attrs (a default is left out, so plans that use none of them read as before);
class weights (`weight=`, a buffer or a constant) are the op's `weight` attr, by value.
`reduction='none'` whose one use is the whole tensor's `.sum()` or `.mean()` is the same
loss: the sum is reduction='sum', the mean that sum divided by the number of tokens (torch's
mean of the per-token losses counts the ignored ones, as zeros). Trained or computed class
weights and a per-token loss used any other way are refused at their line with the fix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from fivedc.errors import NotSupportedError
from fivedc.frontends.fx.layers import _module, arg
from fivedc.frontends.fx.locs import node_loc
from fivedc.frontends.fx.values import Const, Frame, ParamRef, Pending, T
from fivedc.ir.ops import freqs_text

if TYPE_CHECKING:  # the walk that calls this handler (it imports this module)
    from fivedc.frontends.fx.lower import Lowering

_WHOLE = {torch.sum: "sum", torch.mean: "mean"}  # torch.sum(loss), as loss.sum()
_NAMES = ("weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")


def cross_entropy(lw: Lowering, frame: Frame, node: fx.Node, args, kwargs) -> T:
    opts = _options(frame, node, args, kwargs)
    reduction, then = opts["reduction"], None
    if reduction == "none":
        reduction, then = _reduced_after(lw, frame, node)
    attrs = (("ignore_index", int(opts["ignore_index"])),)
    attrs += (("reduction", "sum"),) if reduction == "sum" else ()
    attrs += (("label_smoothing", float(opts["label_smoothing"])),) if opts["label_smoothing"] else ()
    attrs += (("weight", _weights(node, opts["weight"])),) if opts["weight"] is not None else ()
    logits = lw.tensor(frame, arg(args, kwargs, 0, "input"), node)
    targets = lw.tensor(frame, arg(args, kwargs, 1, "target"), node)
    vocab = _class_dim(lw, node, logits, targets)
    lw.dims.hint(vocab, "vocab", 90)
    loss = T(lw.emit(frame, node, "cross_entropy", (logits.ref, targets.ref), (), attrs), (), ())
    if then is None:
        return loss
    user, divide = then
    if divide:
        tokens = frame.traced.values[arg(node.args, node.kwargs, 1, "target")].numel()
        loss = T(lw.emit(frame, user, "div", (loss.ref, float(tokens)), ()), (), ())
    lw.ahead[user] = loss
    return loss


def _options(frame: Frame, node: fx.Node, args, kwargs) -> dict:
    """weight, ignore_index (torch's -100 unless given), reduction and label_smoothing as torch reads
    them, the legacy size_average/reduce flags included."""
    if node.op == "call_module":
        m = _module(frame, node)
        opts = {"weight": m.weight, "ignore_index": m.ignore_index, "reduction": m.reduction,
                "label_smoothing": m.label_smoothing}
    else:
        opts = {n: arg(args, kwargs, i + 2, n) for i, n in enumerate(_NAMES)}
        size_average, reduce = opts.pop("size_average"), opts.pop("reduce")
        if size_average is not None or reduce is not None:  # torch's legacy flags win over reduction
            opts["reduction"] = torch.nn._reduction.legacy_get_string(size_average, reduce, emit_warning=False)
    opts["ignore_index"] = -100 if opts.get("ignore_index") is None else opts["ignore_index"]
    opts["reduction"] = opts.get("reduction") or "mean"
    opts["label_smoothing"] = float(opts.get("label_smoothing") or 0.0)
    return opts


def _weights(node: fx.Node, weight) -> str:
    """Class weights by value (the op's `weight` attr): a module buffer or a constant tensor, read at
    capture; weights that are trained or computed from the inputs are refused at their line."""
    if isinstance(weight, Const):
        weight = weight.value
    if isinstance(weight, torch.nn.Parameter) and weight.requires_grad or isinstance(weight, (ParamRef, T, Pending)):
        raise _refuse(node, "cross_entropy with class weights that are trained or computed from the inputs",
                      "the plan reads class weights as constants: register them as a buffer "
                      "(self.register_buffer('class_weight', w)) or a tensor fixed before the forward")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        raise _refuse(node, f"cross_entropy with class weights {type(weight).__name__} (not a 1-D tensor)",
                      "give weight= one number per class, as torch requires")
    return freqs_text(weight.detach().to(torch.float64).tolist())


def _reduced_after(lw: Lowering, frame: Frame, node: fx.Node) -> tuple[str, tuple[fx.Node, bool]]:
    """reduction='none' whose one use is `.sum()` or `.mean()` of the whole tensor: the reduction
    it computes, the user node and whether it divides by the number of tokens."""
    users = list(node.users)
    name = lw.op_name(frame, users[0]) if len(users) == 1 else None
    name = _WHOLE.get(users[0].target, name) if len(users) == 1 and users[0].op == "call_function" else name
    if name in ("sum", "mean") and len(users[0].args) == 1 and not users[0].kwargs.get("dim"):
        return "sum", (users[0], name == "mean")
    raise _refuse(node, "cross_entropy(reduction='none') used other than by one .sum() or .mean() of all of it",
                  "the plan's loss is one scalar: take F.cross_entropy(..., reduction='sum') or 'mean' (ignored "
                  "targets are left out of both), or .sum()/.mean() of the per-token losses directly")


def _class_dim(lw: Lowering, node: fx.Node, logits: T, targets: T) -> int:
    """The vocabulary atom: the class dim (1 when the logits have 2 dims or more, as torch reads
    them), unified with the targets' dims for the others."""
    groups = lw.groups(logits)
    c = 1 if len(groups) >= 2 else 0
    if len(groups[c]) != 1:
        raise lw.unsupported(node, "cross_entropy over a class dim made of several dims")
    vocab = groups[c][0]
    rest = tuple(a for i, g in enumerate(groups) if i != c for a in g)
    lw.unify(rest, tuple(a for g in lw.groups(targets) for a in g), node, "cross_entropy: logits and targets disagree")
    if lw.ir(logits) != lw.ir(targets) + (vocab,):
        raise lw.unsupported(node, "cross_entropy whose logits are not [tokens..., vocab] in the targets' order")
    return vocab


def _refuse(node: fx.Node, what: str, hint: str) -> NotSupportedError:
    """A form of the loss the plan does not compute: refused at its line (not kept replicated)."""
    return NotSupportedError(f"not supported by the fx frontend: {what} (fx node {node.name})", loc=node_loc(node),
                             hint=hint)
