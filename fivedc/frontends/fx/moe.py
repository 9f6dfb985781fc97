"""MoE blocks the fx frontend keeps whole and lowers to the IR's `moe` op: how a block is read.

A block is a module whose class sets `fivedc_moe = True`, or whose class name
contains `MoE`/`Moe` (`SparseMoeBlock`, Hugging Face's `MixtralSparseMoeBlock`),
holding one bias-free `nn.Linear(hidden, experts)` router child and SwiGLU experts
(gate, up, down), either
- stacked: three parameters of the block's own, [experts, out, in] as `nn.Linear`
  stores each expert's weight, or already [experts, in, out]; or
- separate: an `nn.ModuleList` of `experts` identical modules, each with three 2-D
  weights (Hugging Face's `w1`, `w3`, `w2` as bias-free `nn.Linear`s), which the IR
  stacks into [experts, ...] parameters (`fivedc/frontends/fx/params.py` maps each expert's
  weight to its slice).
It takes one tensor [..., hidden] and returns the same shape, or a tuple
`(out, router_logits)` with the logits `[tokens, experts]` (Hugging Face's
convention; only the output may then be used: the IR's moe does not give its
logits out). `moe_spec` finds which weight is which, their layouts, `top_k` (the
block's `top_k`/`num_experts_per_tok` attribute, else 2 or 1), softmax or sigmoid
scores and renormalised gates or not, by running the block with random weights on
a random probe against `reference_moe`, the IR's dropless moe written densely. A
block marked `fivedc_moe = True` that matches no reading is an error naming it; one
only named like an MoE is traced through. `fivedc_aux_loss = a` on a block (class or
instance) sets the IR op's Switch balancing-loss coefficient (the DSL's
`moe(..., aux_loss=a)`).
"""

from __future__ import annotations

import itertools
import re
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fivedc.errors import NotSupportedError

_MOE_NAME = re.compile(r"moe", re.IGNORECASE)
_TOPK_ATTRS = ("top_k", "num_experts_per_tok", "n_activated_experts", "k")
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """How an MoE module maps to the IR's `moe`: names relative to the module."""

    router: str  # the router nn.Linear child: its weight is [experts, hidden]
    weights: tuple[str, str, str]  # gate, up, down: the block's stacked parameters, or each expert's (`w1.weight`)
    transposed: tuple[bool, bool, bool]  # stored [.., out, in] (IR: [experts, in, out])
    top_k: int
    score: str
    normalize: bool
    experts: str = ""  # the nn.ModuleList of separate experts (`experts`); "" when the weights are stacked
    logits: bool = False  # returns (out, router_logits)

    def keys(self, i: int, count: int) -> tuple[str, ...]:
        """The parameter names (relative to the block) of weight i: one stacked, or one per expert."""
        if not self.experts:
            return (self.weights[i],)
        return tuple(f"{self.experts}.{e}.{self.weights[i]}" for e in range(count))


def is_marked_moe(m: nn.Module) -> bool:
    return getattr(type(m), "fivedc_moe", False) is True


def moe_spec(m: nn.Module) -> MoeSpec | None:
    """How `m` computes the IR's `moe`, or None (an error if `m` is marked `fivedc_moe = True`)."""
    marked = is_marked_moe(m)
    if not marked and not _MOE_NAME.search(type(m).__name__):
        return None
    if m not in _CACHE:
        _CACHE[m] = _probe(m)
    spec = _CACHE[m]
    if isinstance(spec, str):
        if not marked:
            return None
        from fivedc.frontends.fx.locs import def_loc

        raise NotSupportedError(
            f"{type(m).__name__} is marked fivedc_moe = True but {spec}",
            loc=def_loc(type(m).forward),
            hint="an MoE block has a bias-free nn.Linear(hidden, experts) router and SwiGLU experts (gate, up, down), "
            "as three parameters stacked over the experts or an nn.ModuleList of expert modules with three weights "
            "each; it returns sum over its top_k experts of gate * w_down(silu(x w_gate) * x w_up) with softmax (or "
            "sigmoid) scores, gates renormalised to sum 1 or not (or that and the router logits, as a tuple)",
        )
    return spec


def _probe(m: nn.Module) -> MoeSpec | str:
    routers = [(n, c) for n, c in m.named_children() if isinstance(c, nn.Linear) and c.bias is None]
    if len(routers) != 1:
        return "it has no single bias-free nn.Linear child to be the router"
    rname, router = routers[0]
    experts, hidden = router.weight.shape
    found = _expert_weights(m, rname, experts)
    if isinstance(found, str):
        return found
    listed, names, shapes = found
    candidates = []
    for order in itertools.permutations(range(3)):
        for flips in itertools.product((False, True), repeat=3):
            laid = [(shapes[i][0], shapes[i][2], shapes[i][1]) if flip else shapes[i] for i, flip in zip(order, flips)]
            g, u, d = laid
            if g == u and g[1] == hidden and d == (experts, g[2], hidden):
                candidates.append((order, flips))
    if not candidates:
        return f"no three of its expert weights are [experts, hidden, ffn] twice and [experts, ffn, hidden] (hidden={hidden})"
    named = [getattr(m, a) for a in _TOPK_ATTRS if isinstance(getattr(m, a, None), int) and not isinstance(getattr(m, a), bool)]
    top_ks = [k for k in dict.fromkeys(named + [2, 1]) if 1 <= k <= experts]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, hidden, generator=gen, dtype=router.weight.dtype)
    values = {n: torch.randn(p.shape, generator=gen, dtype=p.dtype) * (p.shape[-1] ** -0.5)
              for n, p in m.named_parameters()}
    try:
        with torch.no_grad():
            out = torch.func.functional_call(m, values, (x,))
    except Exception as error:
        return f"running it on a probe failed ({type(error).__name__}: {error})"
    r = values[f"{rname}.weight"].t()
    out, logits = _outputs(out, x, x @ r)
    if out is None:
        return logits
    stacked = [torch.stack([values[f"{listed}.{e}.{n}"] for e in range(experts)]) if listed else values[n] for n in names]
    for order, flips in candidates:
        ws = [stacked[i].transpose(-2, -1) if flip else stacked[i] for i, flip in zip(order, flips)]
        for top_k in top_ks:
            for score in ("softmax", "sigmoid"):
                for normalize in (True, False):
                    want = reference_moe(x, r, *ws, top_k=top_k, score=score, normalize=normalize)
                    if torch.allclose(out, want, rtol=1e-5, atol=1e-6):
                        return MoeSpec(rname, tuple(names[i] for i in order), flips, top_k, score, normalize,
                                       listed, logits)
    return "it does not compute the IR's moe on a probe for any reading of its weights, top_k, score and gates"


def _expert_weights(m: nn.Module, rname: str, experts: int) -> tuple[str, list[str], list[tuple]] | str:
    """(ModuleList name or "", the three weights' names, their stacked shapes [experts, ...])."""
    own = list(m.named_parameters(recurse=False))
    lists = [(n, c) for n, c in m.named_children() if isinstance(c, nn.ModuleList)]
    others = [n for n, _ in m.named_parameters() if not n.startswith(rname + ".")]
    if own:
        if len(own) != 3 or any(p.dim() != 3 or p.shape[0] != experts for _, p in own):
            return f"it does not hold exactly three parameters of its own stacked over its {experts} experts"
        if len(others) != 3:
            return "it holds parameters besides the router and the three stacked expert weights"
        return "", [n for n, _ in own], [tuple(p.shape) for _, p in own]
    if len(lists) != 1 or len(lists[0][1]) != experts:
        return f"it has neither three parameters stacked over its {experts} experts nor one nn.ModuleList of {experts} experts"
    listed, modules = lists[0]
    params = [[(n, tuple(p.shape)) for n, p in e.named_parameters()] for e in modules]
    if any(p != params[0] for p in params[1:]) or len(params[0]) != 3 or any(len(s) != 2 for _, s in params[0]):
        return f"its experts ({listed}) are not alike with three 2-D weights each (SwiGLU: gate, up, down)"
    if len(others) != 3 * experts:
        return f"it holds parameters besides the router and its experts ({listed})"
    return listed, [n for n, _ in params[0]], [(experts, *s) for _, s in params[0]]


def _outputs(out, x: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor | None, bool | str]:
    """(the output, whether router logits come with it), or (None, what is wrong)."""
    if isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(o, torch.Tensor) for o in out):
        second = out[1]
        if second.numel() != logits.numel() or not torch.allclose(second.reshape(logits.shape), logits,
                                                                   rtol=1e-5, atol=1e-6):
            return None, "it returns a tuple whose second element is not the router logits"
        out, with_logits = out[0], True
    else:
        with_logits = False
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        return None, "it does not return one tensor shaped like its input (or that and the router logits)"
    return out, with_logits


def reference_moe(x: torch.Tensor, router: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                  w_down: torch.Tensor, *, top_k: int = 2, score: str = "softmax", normalize: bool = True) -> torch.Tensor:
    """The IR's dropless `moe` with SwiGLU experts, densely: router [hidden, E], w_gate/w_up [E, hidden, ffn],
    w_down [E, ffn, hidden]."""
    logits = x @ router
    scores = logits.softmax(-1) if score == "softmax" else logits.sigmoid()
    top, chosen = scores.topk(top_k, dim=-1)
    if normalize:
        top = top / top.sum(-1, keepdim=True)
    gates = torch.zeros_like(scores).scatter(-1, chosen, top)  # [..., E]
    h = F.silu(torch.einsum("...h,ehf->...ef", x, w_gate)) * torch.einsum("...h,ehf->...ef", x, w_up)
    out = torch.einsum("...ef,efh->...eh", h, w_down)
    return (out * gates[..., None]).sum(-2)
