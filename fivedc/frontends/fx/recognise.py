"""What the fx frontend recognises in single nodes: op names, and modules kept whole.

`op_name` gives every fx node a canonical name (`mul` for `*`, `torch.mul` and
`.mul()`), which both the pattern rewrites (`fivedc/frontends/fx/patterns.py`) and the
lowering's handler table (`fivedc/frontends/fx/ops.py`) use. `rms_norm` and `swiglu` are the
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
MoE blocks are not leaves: while a model is traced each recognised block computes
through one `fivedc::moe_block` call (`fivedc/frontends/fx/moe_leaves.py`), named `moe` here.
"""

from __future__ import annotations

import operator
import re
import weakref

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fivedc.frontends.fx.moe_leaves import MOE_OPS
from fivedc.ir.ops import POINTWISE, parse_freqs
from fivedc.ir.pointwise import resolve

_RMS_NAME = re.compile(r"rms_?norm", re.IGNORECASE)
_ROPE_NAME = re.compile(r"rotary|rope", re.IGNORECASE)
_EPS_ATTRS = ("eps", "variance_epsilon", "epsilon")
_THETA_ATTRS = ("theta", "base", "rope_theta")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool, scale: float,
                     softcap: float, dropout_p: float = 0.0, window: int = 0) -> torch.Tensor:
    """softmax(softcap * tanh(q k^T * scale / softcap) [causal]) v: the marker eager attention with
    logit softcapping becomes (`fivedc/frontends/fx/patterns.py`; k, v already repeated to q's heads);
    `window` W > 0 (causal): the query at i sees the keys at i - W < j <= i."""
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    scores = softcap * torch.tanh(scores / softcap)
    if is_causal:
        sq, sk = scores.shape[-2:]
        scores = scores.masked_fill(~band(sq, sk, window, q.device), float("-inf"))
    return torch.matmul(scores.softmax(-1), v)


def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int, is_causal: bool = True,
                       dropout_p: float = 0.0, scale: float | None = None,
                       enable_gqa: bool = False) -> torch.Tensor:
    """SDPA through a causal sliding window of W keys (the query at i sees i - W < j <= i): the marker
    a mask recognised by value as that band becomes (`fivedc/frontends/fx/attention_patterns.py`)."""
    mask = band(q.shape[-2], k.shape[-2], window, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                          enable_gqa=enable_gqa)


def band(sq: int, sk: int, window: int, device=None) -> torch.Tensor:
    """[sq, sk] True where the query at i sees the key at j: j <= i, and i - window < j with a window."""
    seen = torch.ones(sq, sk, dtype=torch.bool, device=device).tril()
    return seen & ~torch.ones(sq, sk, dtype=torch.bool, device=device).tril(-window) if window else seen


def rope(x: torch.Tensor, *, theta: float, seq_axis: int, freqs: str = "") -> torch.Tensor:
    """fivedc's rope, as the marker a `x * cos + rotate_half(x) * sin` pattern with
    tables checked by value becomes (`fivedc/frontends/fx/patterns.py`)."""
    given = parse_freqs(freqs)
    return reference_rope(x, seq_axis, theta, torch.tensor(given, dtype=torch.float64) if given else None)


# ---- op names -----------------------------------------------------------------------------
# The pointwise ops' names come from their definitions (fivedc/ir/pointwise.py): the kernel's
# function and the other callables, nn modules and tensor methods each lists.
_FUNCTIONS = {
    **{resolve(name): kind for kind, pointwise in POINTWISE.items() for name in pointwise.callables},
    operator.neg: "neg", torch.neg: "neg", operator.pow: "pow", torch.pow: "pow",
    operator.matmul: "matmul", torch.matmul: "matmul", torch.bmm: "matmul", torch.addmm: "addmm",
    operator.getitem: "getitem", getattr: "getattr",
    torch.rsqrt: "rsqrt", torch.sqrt: "sqrt", torch.mean: "mean", torch.exp: "exp",
    F.softmax: "softmax", torch.softmax: "softmax", F.dropout: "dropout", torch.dropout: "dropout",
    torch.transpose: "transpose", torch.permute: "permute", torch.movedim: "movedim", torch.moveaxis: "movedim", torch.reshape: "reshape",
    torch.flatten: "flatten", torch.unsqueeze: "unsqueeze", torch.squeeze: "squeeze",
    torch.split: "split", torch.chunk: "chunk", torch.masked_fill: "masked_fill",
    torch.repeat_interleave: "repeat_interleave", torch.arange: "arange", torch.cat: "cat",
    F.linear: "linear", F.embedding: "embedding", F.layer_norm: "layer_norm", F.rms_norm: "rms_norm",
    F.scaled_dot_product_attention: "sdpa", capped_attention: "sdpa", windowed_attention: "sdpa",
    F.cross_entropy: "cross_entropy",
    rms_norm: "rms_norm", swiglu: "swiglu", rope: "rope", **dict.fromkeys(MOE_OPS, "moe"),
}
_MODULES = {
    **{resolve(name): kind for kind, pointwise in POINTWISE.items() for name in pointwise.modules},
    nn.Dropout: "dropout", nn.Identity: "identity", nn.Linear: "linear", nn.Embedding: "embedding",
    nn.LayerNorm: "layer_norm", nn.RMSNorm: "rms_norm", nn.CrossEntropyLoss: "cross_entropy",
}
_METHODS = {"__getitem__": "getitem", "moveaxis": "movedim",
            **{name: kind for kind, pointwise in POINTWISE.items() for name in pointwise.methods}}
CASTS = {"float", "double", "half", "bfloat16", "type_as", "to", "contiguous", "clone", "identity"}


def op_name(node: fx.Node, root: nn.Module) -> str | None:
    """A canonical name for what a node computes: `mul` for `*`, `torch.mul` and `.mul()`."""
    if node.op == "call_method":
        return _METHODS.get(node.target, node.target)
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
    return None


def depends_on(node, hit) -> bool:
    """Whether `node`, or any node it is computed from, satisfies `hit(node)`."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if not isinstance(n, fx.Node) or n in seen:
            continue
        seen.add(n)
        if hit(n):
            return True
        todo.extend(n.all_input_nodes)
    return False


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
    weight = 1 + 0.1 * torch.randn(params[0].shape, generator=gen, dtype=params[0].dtype)  # a model without weights too
    name = next(n for n, _ in m.named_parameters())
    try:
        with torch.no_grad():
            got = torch.func.functional_call(m, {name: weight}, (x,))
            ok = torch.allclose(got, rms_norm(x, weight, eps), rtol=1e-5, atol=1e-6)
    except Exception:
        return None
    return eps if ok else None


def is_rope(m: nn.Module) -> bool:
    return bool(_ROPE_NAME.search(type(m).__name__)) and not any(True for _ in m.parameters())


def is_recognised_leaf(m: nn.Module) -> bool:
    return rms_eps(m) is not None or is_rope(m)


def rope_theta(m: nn.Module, x: torch.Tensor, seq_axis: int) -> float | None:
    """The theta for which `m(x)` is fivedc's rope along `seq_axis`, or None."""
    candidates = [float(getattr(m, a)) for a in _THETA_ATTRS if isinstance(getattr(m, a, None), (int, float))]
    inv_freq = getattr(m, "inv_freq", None)
    half = x.shape[-1] // 2
    if isinstance(inv_freq, torch.Tensor) and inv_freq.numel() > 1:
        candidates.append(float(inv_freq[1].double() ** (-half)))
    candidates += [10000.0, 500000.0]
    gen = torch.Generator().manual_seed(0)
    device = x.device if x.device.type != "meta" else "cpu"  # without weights, the tables are real ones
    probe = torch.randn(x.shape, generator=gen, dtype=x.dtype).to(device)
    try:
        with torch.no_grad():
            out = m(probe)
    except Exception:
        return None
    if not isinstance(out, torch.Tensor) or out.shape != probe.shape:
        return None
    # a table in x's dtype rounds its angles (up to the last position, frequency 1): allowed, no more
    # (tables rounded further, a float32 cache in a float64 model, are not fivedc's rope)
    atol = 4 * torch.finfo(x.dtype).eps * x.shape[seq_axis] * float(probe.abs().max())
    for theta in candidates:
        if torch.allclose(out, reference_rope(probe, seq_axis, theta), rtol=0, atol=atol):
            return theta
    return None


def reference_rope(x: torch.Tensor, seq_axis: int, theta: float, freqs: torch.Tensor | None = None) -> torch.Tensor:
    """fivedc's rope (`runtime/sequence_kernels.py`) on a tensor whose sequence is `seq_axis`: frequencies
    theta ** (-i / half), or the ones given."""
    half = x.shape[-1] // 2
    if freqs is None:
        freqs = theta ** (-torch.arange(0, half, dtype=torch.float64) / half)
    freqs = freqs.to(x.device)  # a model traced on a GPU checks its tables there
    angles = torch.arange(x.shape[seq_axis], dtype=torch.float64, device=x.device)[:, None] * freqs[None, :]
    shape = [1] * x.dim()
    shape[seq_axis], shape[-1] = x.shape[seq_axis], half
    cos, sin = angles.cos().to(x.dtype).reshape(shape), angles.sin().to(x.dtype).reshape(shape)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
