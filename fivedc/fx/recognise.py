"""What the fx frontend recognises in single nodes: op names, and modules kept whole.

`op_name` gives every fx node a canonical name (`mul` for `*`, `torch.mul` and
`.mul()`), which both the pattern rewrites (`fivedc/fx/patterns.py`) and the
lowering's handler table (`fivedc/fx/ops.py`) use. `rms_norm` and `swiglu` are the
executable markers the rewrites insert.

Modules kept as one call (leaves of the trace), by class name *and* behaviour:
- `nn.RMSNorm`, and any module whose class name contains `RMSNorm` (any case, `_`
  allowed) with one 1-D weight and an `eps`/`variance_epsilon` attribute, if it
  computes `x * rsqrt(mean(x^2, -1) + eps) * weight` on a random probe (otherwise it
  is traced through like any module, where the pattern may still find it);
- a module whose class name contains `Rotary` or `RoPE` and has no parameters,
  called on one tensor `[..., seq, ..., head_dim]`: it is fivedc's `rope` (rotate
  the two halves, positions 0..seq-1) if a probe matches for theta taken from its
  `theta`/`base`/`rope_theta` attribute, its `inv_freq` buffer, 10000 or 500000;
  checked where it is called (`rope_theta`), an error naming the module otherwise;
- an MoE block: a module whose class sets `fivedc_moe = True`, or whose class name
  contains `MoE`/`Moe` (`SparseMoeBlock`, `MoELayer`), with one bias-free
  `nn.Linear(hidden, experts)` router child and three parameters of its own stacked
  over the experts (gate, up, down of SwiGLU experts; each [experts, out, in] as
  nn.Linear stores it, or already [experts, in, out]); `moe_spec` finds which
  parameter is which, their layouts, `top_k` (its `top_k`/`num_experts_per_tok`
  attribute, else 2 or 1), the score (softmax or sigmoid) and whether the gates are
  renormalised, by running the module with random weights on a random probe against
  the IR's `moe` (`reference_moe`). A module marked `fivedc_moe = True` that matches
  no such reading is an error naming it; one only named like an MoE is traced through.
"""

from __future__ import annotations

import itertools
import operator
import re
import weakref
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

_RMS_NAME = re.compile(r"rms_?norm", re.IGNORECASE)
_ROPE_NAME = re.compile(r"rotary|rope", re.IGNORECASE)
_EPS_ATTRS = ("eps", "variance_epsilon", "epsilon")
_THETA_ATTRS = ("theta", "base", "rope_theta")
_MOE_NAME = re.compile(r"moe", re.IGNORECASE)
_TOPK_ATTRS = ("top_k", "num_experts_per_tok", "n_activated_experts", "k")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


# ---- op names -----------------------------------------------------------------------------
_FUNCTIONS = {
    operator.add: "add", torch.add: "add", operator.iadd: "add",
    operator.sub: "sub", torch.sub: "sub", operator.isub: "sub",
    operator.mul: "mul", torch.mul: "mul", operator.imul: "mul",
    operator.truediv: "div", torch.div: "div", torch.true_divide: "div",
    operator.neg: "neg", torch.neg: "neg", operator.pow: "pow", torch.pow: "pow",
    operator.matmul: "matmul", torch.matmul: "matmul", torch.bmm: "matmul",
    operator.getitem: "getitem", getattr: "getattr",
    torch.rsqrt: "rsqrt", torch.sqrt: "sqrt", torch.mean: "mean", torch.exp: "exp",
    torch.tanh: "tanh", F.tanh: "tanh", torch.sigmoid: "sigmoid", F.sigmoid: "sigmoid",
    F.gelu: "gelu", F.silu: "silu", F.relu: "relu", torch.relu: "relu",
    F.softmax: "softmax", torch.softmax: "softmax", F.dropout: "dropout", torch.dropout: "dropout",
    torch.transpose: "transpose", torch.permute: "permute", torch.reshape: "reshape",
    torch.flatten: "flatten", torch.unsqueeze: "unsqueeze", torch.squeeze: "squeeze",
    torch.split: "split", torch.chunk: "chunk", torch.masked_fill: "masked_fill",
    torch.repeat_interleave: "repeat_interleave", torch.arange: "arange", torch.cat: "cat",
    F.linear: "linear", F.embedding: "embedding", F.layer_norm: "layer_norm", F.rms_norm: "rms_norm",
    F.scaled_dot_product_attention: "sdpa", F.cross_entropy: "cross_entropy",
    rms_norm: "rms_norm", swiglu: "swiglu",
}
_MODULES = {
    nn.SiLU: "silu", nn.GELU: "gelu", nn.ReLU: "relu", nn.Tanh: "tanh", nn.Sigmoid: "sigmoid",
    nn.Dropout: "dropout", nn.Identity: "identity", nn.Linear: "linear", nn.Embedding: "embedding",
    nn.LayerNorm: "layer_norm", nn.RMSNorm: "rms_norm", nn.CrossEntropyLoss: "cross_entropy",
}
CASTS = {"float", "double", "half", "bfloat16", "type_as", "to", "contiguous", "clone", "identity"}


def op_name(node: fx.Node, root: nn.Module) -> str | None:
    """A canonical name for what a node computes: `mul` for `*`, `torch.mul` and `.mul()`."""
    if node.op == "call_method":
        return {"__getitem__": "getitem", "divide": "div", "multiply": "mul", "true_divide": "div"}.get(
            node.target, node.target)
    if node.op == "call_function":
        return _FUNCTIONS.get(node.target)
    if node.op == "call_module":
        module = root.get_submodule(node.target)
        if type(module) in _MODULES:
            return _MODULES[type(module)]
        if rms_eps(module) is not None:
            return "rms_norm"
        if is_rope(module):
            return "rope"
        if moe_spec(module) is not None:
            return "moe"
    return None


# ---- modules recognised by name (and checked by value) --------------------------------
_RMS_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def rms_eps(m: nn.Module) -> float | None:
    """eps of an RMSNorm module fivedc can represent, else None."""
    if isinstance(m, nn.RMSNorm):
        if m.weight is None or len(m.normalized_shape) != 1:
            return None
        return m.eps if m.eps is not None else torch.finfo(m.weight.dtype).eps
    if not _RMS_NAME.search(type(m).__name__):
        return None
    if m not in _RMS_CACHE:
        _RMS_CACHE[m] = _probe_rms(m)
    return _RMS_CACHE[m]


def _probe_rms(m: nn.Module) -> float | None:
    params = list(m.parameters())
    eps = next((getattr(m, a) for a in _EPS_ATTRS if isinstance(getattr(m, a, None), float)), None)
    if len(params) != 1 or params[0].dim() != 1 or eps is None or list(m.children()):
        return None
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, params[0].shape[0], generator=gen, dtype=params[0].dtype)
    try:
        with torch.no_grad():
            ok = torch.allclose(m(x), rms_norm(x, params[0], eps), rtol=1e-5, atol=1e-6)
    except Exception:
        return None
    return eps if ok else None


def is_rope(m: nn.Module) -> bool:
    return bool(_ROPE_NAME.search(type(m).__name__)) and not any(True for _ in m.parameters())


def is_recognised_leaf(m: nn.Module) -> bool:
    return rms_eps(m) is not None or is_rope(m) or moe_spec(m) is not None


def rope_theta(m: nn.Module, x: torch.Tensor, seq_axis: int) -> float | None:
    """The theta for which `m(x)` is fivedc's rope along `seq_axis`, or None."""
    candidates = [float(getattr(m, a)) for a in _THETA_ATTRS if isinstance(getattr(m, a, None), (int, float))]
    inv_freq = getattr(m, "inv_freq", None)
    half = x.shape[-1] // 2
    if isinstance(inv_freq, torch.Tensor) and inv_freq.numel() > 1:
        candidates.append(float(inv_freq[1].double() ** (-half)))
    candidates += [10000.0, 500000.0]
    gen = torch.Generator().manual_seed(0)
    probe = torch.randn(x.shape, generator=gen, dtype=x.dtype)
    try:
        with torch.no_grad():
            out = m(probe)
    except Exception:
        return None
    if not isinstance(out, torch.Tensor) or out.shape != probe.shape:
        return None
    for theta in candidates:
        if torch.allclose(out, reference_rope(probe, seq_axis, theta), rtol=1e-5, atol=1e-6):
            return theta
    return None


def reference_rope(x: torch.Tensor, seq_axis: int, theta: float) -> torch.Tensor:
    """fivedc's rope (`runtime/kernels.py`) on a tensor whose sequence is `seq_axis`."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(0, half, dtype=torch.float64) / half)
    angles = torch.arange(x.shape[seq_axis], dtype=torch.float64)[:, None] * freqs[None, :]
    shape = [1] * x.dim()
    shape[seq_axis], shape[-1] = x.shape[seq_axis], half
    cos, sin = angles.cos().to(x.dtype).reshape(shape), angles.sin().to(x.dtype).reshape(shape)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


# ---- MoE blocks ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class MoeSpec:
    """How an MoE module maps to the IR's `moe`: attribute names relative to the module."""

    router: str  # the router nn.Linear child: its weight is [experts, hidden]
    weights: tuple[str, str, str]  # gate, up, down: parameters of the module, [experts, ...]
    transposed: tuple[bool, bool, bool]  # stored [experts, out, in] (IR: [experts, in, out])
    top_k: int
    score: str
    normalize: bool


_MOE_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def is_marked_moe(m: nn.Module) -> bool:
    return getattr(type(m), "fivedc_moe", False) is True


def moe_spec(m: nn.Module) -> MoeSpec | None:
    """How `m` computes the IR's `moe`, or None (an error if `m` is marked `fivedc_moe = True`)."""
    marked = is_marked_moe(m)
    if not marked and not _MOE_NAME.search(type(m).__name__):
        return None
    if m not in _MOE_CACHE:
        _MOE_CACHE[m] = _probe_moe(m)
    spec = _MOE_CACHE[m]
    if isinstance(spec, str):
        if not marked:
            return None
        from fivedc.errors import NotSupportedError
        from fivedc.fx.locs import def_loc

        raise NotSupportedError(
            f"{type(m).__name__} is marked fivedc_moe = True but {spec}",
            loc=def_loc(type(m).forward),
            hint="an MoE block has a bias-free nn.Linear(hidden, experts) router and three parameters stacked over "
            "the experts (SwiGLU gate, up, down); it returns sum over its top_k experts of gate * "
            "w_down(silu(x w_gate) * x w_up) with softmax (or sigmoid) scores, gates renormalised to sum 1 or not",
        )
    return spec


def _probe_moe(m: nn.Module) -> MoeSpec | str:
    routers = [(n, c) for n, c in m.named_children() if isinstance(c, nn.Linear) and c.bias is None]
    if len(routers) != 1:
        return "it has no single bias-free nn.Linear child to be the router"
    rname, router = routers[0]
    experts, hidden = router.weight.shape
    own = [(n, p) for n, p in m.named_parameters(recurse=False)]
    if len(own) != 3 or any(p.dim() != 3 or p.shape[0] != experts for _, p in own):
        return f"it does not hold exactly three parameters of its own stacked over its {experts} experts"
    if any(True for n, _ in m.named_parameters() if not n.startswith(rname + ".") and "." in n):
        return "it holds parameters besides the router and the three stacked expert weights"
    candidates = []
    for order in itertools.permutations(range(3)):
        for flips in itertools.product((False, True), repeat=3):
            shapes = []
            for i, flip in zip(order, flips):
                shape = tuple(own[i][1].shape)
                shapes.append((shape[0], shape[2], shape[1]) if flip else shape)
            g, u, d = shapes
            if g == u and g[1] == hidden and d == (experts, g[2], hidden):
                candidates.append((order, flips))
    if not candidates:
        return f"no three of its parameters are [experts, hidden, ffn] twice and [experts, ffn, hidden] (hidden={hidden})"
    named = [getattr(m, a) for a in _TOPK_ATTRS if isinstance(getattr(m, a, None), int) and not isinstance(getattr(m, a), bool)]
    top_ks = [k for k in dict.fromkeys(named + [2, 1]) if 1 <= k <= experts]
    dtype = router.weight.dtype
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, hidden, generator=gen, dtype=dtype)
    values = {n: torch.randn(p.shape, generator=gen, dtype=p.dtype) * (p.shape[-1] ** -0.5)
              for n, p in m.named_parameters()}
    try:
        with torch.no_grad():
            out = torch.func.functional_call(m, values, (x,))
    except Exception as error:
        return f"running it on a probe failed ({type(error).__name__}: {error})"
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        return "it does not return one tensor shaped like its input"
    r = values[f"{rname}.weight"].t()
    for order, flips in candidates:
        ws = []
        for i, flip in zip(order, flips):
            w = values[own[i][0]]
            ws.append(w.transpose(-2, -1) if flip else w)
        for top_k in top_ks:
            for score in ("softmax", "sigmoid"):
                for normalize in (True, False):
                    want = reference_moe(x, r, *ws, top_k=top_k, score=score, normalize=normalize)
                    if torch.allclose(out, want, rtol=1e-5, atol=1e-6):
                        return MoeSpec(rname, tuple(own[i][0] for i in order), flips, top_k, score, normalize)
    return "it does not compute the IR's moe on a probe for any reading of its weights, top_k, score and gates"


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
