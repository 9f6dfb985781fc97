"""MoE blocks the fx frontend lowers to the IR's `moe` op: how a block is read, by its behaviour.

A candidate block is a module whose class sets `fivedc_moe = True`, whose class name
contains `MoE`/`Moe` (`MixtralSparseMoeBlock`, `DeepseekV3MoE`), or that has a child
named `experts`. It is read as

    out = scale * moe(x; router, w_gate, w_up, w_down) + sum of its shared children(x) [x sigmoid(gate(x))]

where, whatever the library calls them,
- the router is one 2-D parameter [experts, hidden] (as `nn.Linear` stores it, in a
  child such as Hugging Face's `TopKRouter` or an `nn.Linear`) or [hidden, experts];
- the experts are SwiGLU (gate, up, down), stacked over the experts in parameters
  [experts, out, in] or [experts, in, out], with gate and up fused in one (Hugging
  Face's `gate_up_proj`: the first half gate, the second up, or the reverse), or an
  `nn.ModuleList` of alike expert modules with two or three 2-D weights each;
- the shared children are its other children with parameters, each applied to the
  block's input and added (DeepSeek's `shared_experts`); a child giving one number per
  token may instead gate another: that one's output times its sigmoid (Qwen2-MoE's
  `shared_expert_gate`);
- `scale` multiplies the routed experts (DeepSeek's `routed_scaling_factor`); an
  attribute of the block or its modules holding that number gives its exact value.
The block may return `out` or `(out, router_logits)` (only `out` may then be used).
Which parameter is which, the layouts, `top_k` (a `top_k`/`num_experts_per_tok`
attribute, else 2 or 1), softmax or sigmoid scores, renormalised gates or not, and
the scale are found by running the block with random weights on a random probe
against `reference_moe`, the IR's dropless moe written densely. Buffers are read too
(`fivedc/frontends/fx/moe_states.py`): a floating buffer [experts] added to the scores to
choose the experts is the op's routing bias (`bias_state`; a non-zero one, as a trained
model holds, is read at zero first), one the forward adds its tokens per expert to is
its `count_state`; any other write of a buffer, or a buffer that changes the output
otherwise (group-limited routing), does not match, and the block is traced through. A block
marked `fivedc_moe = True` that matches no reading is an error naming it.
`fivedc_aux_loss = a` on a block sets the op's Switch balancing-loss coefficient.
"""

from __future__ import annotations

import itertools
import re
import weakref
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fivedc.errors import NotSupportedError
from fivedc.frontends.fx.moe_states import bias_candidates, choices, counts_of, probe_buffers, read_counts, written
from fivedc.frontends.fx.moe_weights import ExpertWeight, expert_lists, expert_sets, weight_readings

_MOE_NAME = re.compile(r"moe", re.IGNORECASE)
_TOPK_ATTRS = ("top_k", "num_experts_per_tok", "n_activated_experts", "k")
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_HINT = ("an MoE block has a router weight [experts, hidden] and SwiGLU experts (gate, up, down; gate and up may "
         "be fused), stacked over the experts or an nn.ModuleList of expert modules; it returns scale * (sum over "
         "its top_k experts of gate * w_down(silu(x w_gate) * x w_up)) with softmax (or sigmoid) scores, gates "
         "renormalised to sum 1 or not, plus its other children applied to x (shared experts), or that and the "
         "router logits as a tuple")


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """How an MoE module maps to the IR's `moe`: names relative to the module."""

    router: str  # the router weight's name: `gate.weight`
    router_transposed: bool  # stored [experts, hidden] (the IR's router is [hidden, experts])
    weights: tuple[ExpertWeight, ExpertWeight, ExpertWeight]  # gate, up, down
    top_k: int
    score: str
    normalize: bool
    scale: float = 1.0  # the routed experts' sum times this
    shared: tuple[str, ...] = ()  # children added to the output, each applied to the block's input
    logits: bool = False  # returns (out, router_logits)
    experts: str = ""  # the nn.ModuleList of separate experts; "" when stacked
    gates: tuple[tuple[str, str], ...] = ()  # (shared child, its gate): the child's output times sigmoid(gate(x))
    bias: str = ""  # a buffer [experts] added to the scores to choose the experts (fx/moe_states.py)
    counts: str = ""  # a buffer [experts] the forward adds its tokens per expert to

    def router_value(self, params: dict[str, Tensor]) -> Tensor:
        r = params[self.router]
        return r.t() if self.router_transposed else r

    def routed(self, params: dict[str, Tensor], x: Tensor, bias: Tensor | None = None) -> Tensor:
        """The routed experts' output (before `scale`) with these parameters (and the routing bias),
        as the IR computes it."""
        ws = [w.ir_value(params) for w in self.weights]
        return reference_moe(x, self.router_value(params), *ws, top_k=self.top_k, score=self.score,
                             normalize=self.normalize, bias=bias)


def is_marked_moe(m: nn.Module) -> bool:
    return getattr(type(m), "fivedc_moe", False) is True


def is_candidate(m: nn.Module) -> bool:
    """Whether a module may be an MoE block (then `moe_spec` probes it)."""
    return is_marked_moe(m) or bool(_MOE_NAME.search(type(m).__name__)) or "experts" in m._modules


def moe_spec(m: nn.Module) -> MoeSpec | None:
    """How `m` computes the IR's `moe`, or None (an error if `m` is marked `fivedc_moe = True`)."""
    if not is_candidate(m):
        return None
    if m not in _CACHE:
        _CACHE[m] = _probe(m)
    spec = _CACHE[m]
    if isinstance(spec, str):
        if not is_marked_moe(m):
            return None
        from fivedc.frontends.fx.locs import def_loc

        raise NotSupportedError(f"{type(m).__name__} is marked fivedc_moe = True but {spec}",
                                loc=def_loc(type(m).forward), hint=_HINT)
    return spec


# ---- the probe --------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Candidate:
    router: str
    transposed: bool
    experts: str  # "" or the ModuleList
    readings: tuple[tuple[ExpertWeight, ExpertWeight, ExpertWeight], ...]
    shared: tuple[str, ...]


def _probe(m: nn.Module) -> MoeSpec | str:
    params = dict(m.named_parameters())
    found = _candidates(m, params)
    if isinstance(found, str):
        return found
    hidden = found[0].readings[0][2].ir_value(params).shape[-1]
    spec = _probe_once(m, params, found, hidden, zeroed=False)
    # a routing bias that is not zero (a trained model) chooses other experts: read with it at zero
    return _probe_once(m, params, found, hidden, zeroed=True) if isinstance(spec, str) else spec


def _probe_once(m: nn.Module, params: dict[str, Tensor], found: list, hidden: int, *, zeroed: bool) -> MoeSpec | str:
    ran = _run_probe(m, params, hidden, zeroed)
    if isinstance(ran, str):
        return ran
    x, values, out, _ = ran
    top_ks = _top_ks(m)
    reason = "it does not compute the IR's moe on a probe for any reading of its weights, top_k, score and gates"
    for c in found:
        got, logits = _outputs(out, x, x @ _router(c, values))
        if got is None:
            reason = logits
            continue
        try:
            with torch.no_grad():
                outputs = {name: _call(m, name, values, x) for name in c.shared}
        except Exception as error:
            reason = f"its children {', '.join(c.shared)} do not each map its input to its output's shape ({error})"
            continue
        for shared, gates in _shared_readings(outputs, x):
            routed = got - with_shared(outputs.__getitem__, shared, gates, torch.zeros_like(got))
            spec = _match(m, c, values, x, routed, top_ks, logits)
            if spec is not None:
                spec = replace(spec, shared=shared, gates=gates)
                return _with_states(m, spec, ran, got - routed)
    return reason


def _with_states(m: nn.Module, spec: MoeSpec, ran, shared: Tensor) -> MoeSpec | str:
    """`spec` with the buffers the block reads as a routing bias and writes as tokens per expert
    (`fivedc/frontends/fx/moe_states.py`), or why its buffers are not read."""
    x, values, _, before = ran  # `before`: the buffers the block ran with
    r, experts = spec.router_value(values), spec.weights[2].ir_value(values).shape[0]
    gains = written(before, {n: values[n] for n in before})
    bias = ""
    for name in bias_candidates(m, experts, exclude=""):
        if name in gains:
            continue
        found = _bias_reading(m, spec, values, before, x, shared, name)
        if isinstance(found, str):
            return found
        if found:
            bias = name
            break
    stray = [n for n, b in m.named_buffers() if n != bias and not torch.equal(b.to(before[n]), before[n])]
    if stray:  # a buffer the reading set to zero, which is not the routing bias
        return f"it computes the IR's moe only with its buffer {stray[0]} at zero, which it does not read as a bias"
    chosen = choices(x, r, top_k=spec.top_k, score=spec.score, bias=before[bias] if bias else None)
    counts = read_counts(gains, counts_of(chosen, experts))
    return counts if isinstance(counts, str) else replace(spec, bias=bias, counts=counts.counts)


def _bias_reading(m: nn.Module, spec: MoeSpec, values, before, x: Tensor, shared: Tensor, name: str) -> bool | str:
    """Whether buffer `name` is the routing bias: with random values in it the block computes the IR's
    moe with them added to the scores in the choice (True), or it changes nothing (False)."""
    gen = torch.Generator().manual_seed(1)
    given = {**values, **{n: b.clone() for n, b in before.items()}}
    given[name] = torch.randn(before[name].shape, generator=gen, dtype=before[name].dtype) * 0.5
    try:
        out = _run(m, given, x)
    except Exception as error:
        return f"running it with another value in its buffer {name} failed ({type(error).__name__}: {error})"
    got, _ = _outputs(out, x, x @ spec.router_value(values))
    if got is None:
        return f"with another value in its buffer {name} it returns something else"
    want = spec.scale * spec.routed(values, x, given[name]) + shared
    if torch.allclose(got, want, rtol=1e-5, atol=1e-6):
        return True
    base = spec.scale * spec.routed(values, x, before[name] if before[name].abs().max() > 0 else None) + shared
    if torch.allclose(got, base, rtol=1e-5, atol=1e-6):
        return False
    return (f"its buffer {name} changes what it computes otherwise than as a bias added to the scores to "
            "choose the experts")


def _shared_readings(outputs: dict[str, Tensor], x: Tensor):
    """(added children, gates) the shared children may be read as: each added as it is; or,
    where some give one number per token (a last dim of 1), each of those the sigmoid gate
    of another (Qwen2-MoE's `shared_expert_gate`)."""
    names = tuple(outputs)
    yield names, ()
    gates = [n for n in names if outputs[n].shape[-1] == 1 != x.shape[-1]]
    gated = [n for n in names if n not in gates]
    for chosen in itertools.permutations(gated, len(gates)):
        yield tuple(gated), tuple(zip(chosen, gates))


def with_shared(output, shared: tuple[str, ...], gates: tuple[tuple[str, str], ...], base: Tensor) -> Tensor:
    """`base` plus the shared children, `output(name)` being a child's output: each added,
    times the sigmoid of its gate's output where it has one."""
    gate_of = dict(gates)
    total = base
    for name in shared:
        out = output(name)
        total = total + (torch.sigmoid(output(gate_of[name])) * out if name in gate_of else out)
    return total


def _run_probe(m: nn.Module, params: dict[str, Tensor], hidden: int, zeroed: bool = False):
    """(x, random parameters and copies of the buffers, the block's output, the buffers before it ran) at the
    parameters' dtype (float64 as fivedc's float64 mode computes it: `fivedc/frontends/fx/precision.py`), or in
    float32 where the block has no kernel for it; else what failed."""
    dtypes = dict.fromkeys((next(iter(params.values())).dtype, torch.float32))
    for dtype in dtypes:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(4, 6, hidden, generator=gen, dtype=dtype)
        values = {n: torch.randn(p.shape, generator=gen, dtype=dtype) * (p.shape[-1] ** -0.5)
                  for n, p in params.items()}
        buffers = probe_buffers(m, dtype, zeroed)  # copies: the block's own buffers are never written by a probe
        before = {n: b.clone() for n, b in buffers.items()}
        values.update(buffers)
        try:
            return x, values, _run(m, values, x), before
        except Exception as error:
            failure = f"running it on a probe failed ({type(error).__name__}: {error})"
    return failure


def _run(m: nn.Module, values: dict[str, Tensor], x: Tensor):
    """The block's output on x with these parameters and buffers (its writes land in `values`' buffers)."""
    from fivedc.frontends.fx.precision import float64_everywhere

    with torch.no_grad(), float64_everywhere(x.dtype == torch.float64):
        return torch.func.functional_call(m, values, (x,), tie_weights=False)


def _router(c: _Candidate, values: dict[str, Tensor]) -> Tensor:
    r = values[c.router]
    return r.t() if c.transposed else r


def _call(m: nn.Module, name: str, values: dict[str, Tensor], x: Tensor) -> Tensor:
    child = m.get_submodule(name)
    own = {k.removeprefix(name + "."): v for k, v in values.items() if k.startswith(name + ".")}
    return torch.func.functional_call(child, own, (x,))


def _match(m: nn.Module, c: _Candidate, values, x: Tensor, routed: Tensor, top_ks, logits: bool) -> MoeSpec | None:
    r = _router(c, values)
    for weights in c.readings:
        ws = [w.ir_value(values) for w in weights]
        for top_k, score, normalize in itertools.product(top_ks, ("softmax", "sigmoid"), (True, False)):
            want = reference_moe(x, r, *ws, top_k=top_k, score=score, normalize=normalize)
            scale = _scale(m, routed, want)
            if scale is not None and torch.allclose(routed, scale * want, rtol=1e-5, atol=1e-6):
                return MoeSpec(c.router, c.transposed, weights, top_k, score, normalize, scale, c.shared, logits,
                               c.experts)
    return None


def _scale(m: nn.Module, routed: Tensor, want: Tensor) -> float | None:
    """The number routed is of want (1.0 when it is close), exactly as an attribute of the block holds it."""
    norm = float((want * want).sum())
    fitted = float((routed * want).sum()) / norm if norm else 0.0
    if not fitted > 0:
        return None
    if abs(fitted - 1.0) < 1e-6:
        return 1.0
    for sub in m.modules():
        for value in vars(sub).values():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 \
                    and abs(value - fitted) <= 1e-6 * fitted:
                return float(value)
    return fitted


def _top_ks(m: nn.Module) -> list[int]:
    named = [getattr(sub, a) for sub in m.modules() for a in _TOPK_ATTRS
             if isinstance(getattr(sub, a, None), int) and not isinstance(getattr(sub, a), bool)]
    return [k for k in dict.fromkeys(named + [2, 1]) if k >= 1]


def _candidates(m: nn.Module, params: dict[str, Tensor]) -> list[_Candidate] | str:
    lists = expert_lists(m)
    in_lists = {n for name in lists for n in params if n.startswith(name + ".")}
    out: list[_Candidate] = []
    for name, p in params.items():
        if p.dim() != 2 or name in in_lists:
            continue
        for transposed, (experts, hidden) in ((True, tuple(p.shape)), (False, tuple(p.shape)[::-1])):
            for listed, names, shapes in expert_sets(params, lists, in_lists, experts):
                readings = weight_readings(listed, names, shapes, hidden, experts)
                covered = {name, *(n for n in params if n.startswith(listed + "."))} if listed else {name, *names}
                shared = _shared(m, params, covered)
                if readings and shared is not None:
                    out.append(_Candidate(name, transposed, listed, readings, shared))
    if not out:
        return ("it has no router weight [experts, hidden] with SwiGLU expert weights over as many experts "
                "(and nothing else but children added to its output)")
    return out


def _shared(m: nn.Module, params: dict[str, Tensor], covered: set[str]) -> tuple[str, ...] | None:
    """The children holding the parameters besides `covered` (each wholly), or None when some are elsewhere."""
    rest = set(params) - covered
    shared = []
    for name, child in m.named_children():
        own = {f"{name}.{n}" for n, _ in child.named_parameters()}
        if own and own <= rest:
            shared.append(name)
            rest -= own
    return tuple(shared) if not rest else None


def _outputs(out, x: Tensor, logits: Tensor) -> tuple[Tensor | None, bool | str]:
    """(the output, whether router logits come with it), or (None, what is wrong)."""
    if isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(o, Tensor) for o in out):
        second = out[1]
        if second.numel() != logits.numel() or not torch.allclose(second.reshape(logits.shape), logits,
                                                                   rtol=1e-5, atol=1e-6):
            return None, "it returns a tuple whose second element is not the router logits"
        out, with_logits = out[0], True
    else:
        with_logits = False
    if not isinstance(out, Tensor) or out.shape != x.shape:
        return None, "it does not return one tensor shaped like its input (or that and the router logits)"
    return out, with_logits


def reference_moe(x: Tensor, router: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, *, top_k: int = 2,
                  score: str = "softmax", normalize: bool = True, bias: Tensor | None = None) -> Tensor:
    """The IR's dropless `moe` with SwiGLU experts, densely: router [hidden, E], w_gate/w_up [E, hidden, ffn],
    w_down [E, ffn, hidden]; `bias` [E] (a routing bias) is added to the scores to choose, not to the gates."""
    logits = x @ router
    scores = logits.softmax(-1) if score == "softmax" else logits.sigmoid()
    chosen = choices(x, router, top_k=top_k, score=score, bias=bias)
    top = scores.gather(-1, chosen)
    if normalize:
        top = top / top.sum(-1, keepdim=True)
    gates = torch.zeros_like(scores).scatter(-1, chosen, top)  # [..., E]
    h = F.silu(torch.einsum("...h,ehf->...ef", x, w_gate)) * torch.einsum("...h,ehf->...ef", x, w_up)
    out = torch.einsum("...ef,efh->...eh", h, w_down)
    return (out * gates[..., None]).sum(-2)
