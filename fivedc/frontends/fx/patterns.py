"""Op patterns the fx frontend rewrites in the fx graph before lowering.

Each pattern becomes one call of an executable marker (`fivedc/frontends/fx/recognise.py`)
or of a torch function, so the rewritten graph still runs and keeps its values:
- `x * rsqrt(mean(x^2 | x*x, dim=-1, keepdim=True) + eps) * w` (also `/ sqrt(...)`,
  casts in between, w a 1-D parameter) -> `rms_norm(x, w, eps)`;
- `softmax(q @ k.transpose(-2, -1) * scale [softcap] [masked_fill(mask, -inf) | + mask],
  -1) [dropout] @ v` with any constant scale (also `/ sqrt(d)`), the mask checked on its
  example value to be exactly causal (a bool fill, or an additive constant: 0 where a key
  is seen, below -1e4 elsewhere) -> `F.scaled_dot_product_attention(q, k, v, is_causal=...,
  dropout_p=..., scale=...)` (the lowering warns about an active dropout); with a softcap
  `c * tanh(s / c)` of the scaled scores (Gemma 2's eager attention) -> `capped_attention`;
- `silu(a) * b` (either order, the silu used once) -> `swiglu(a, b)`;
- `x * cos + rotate_half(x) * sin` with constant tables (from buffers and shapes, as
  Hugging Face's rotary embeddings compute them), rotate_half(x) = cat(-x2, x1) of
  x's halves -> `rope(x, theta=, seq_axis=)`, theta read off the tables and the whole
  checked against fivedc's rope on x's example value;
- `reshape(expand(unsqueeze(x, d + 1)))` repeating x along d (Hugging Face's
  `repeat_kv`), checked on the example values -> `x.repeat_interleave(n, dim=d)`;
- `scaled_dot_product_attention(..., attn_mask=M)` with M a constant equal to the
  causal mask (bool or additive, checked on its value) -> `is_causal=True`.
A near miss (another mask, another scale) is left alone, and the lowering then
reports the softmax or matmul it cannot represent at the user's line. The attention
patterns are in `fivedc/frontends/fx/attention_patterns.py`.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx
from torch import nn

from fivedc.frontends.fx.attention_patterns import AttentionPatterns
from fivedc.frontends.fx.recognise import CASTS, depends_on, op_name, reference_rope, rms_norm, rope, swiglu
from fivedc.ir.ops import freqs_text


def _on_cpu(t: torch.Tensor) -> torch.Tensor:
    """`t` on the CPU, where the checks run (a meta tensor, without values, stays one)."""
    return t.detach() if t.device.type in ("cpu", "meta") else t.detach().cpu()


def _table_freqs(cos: torch.Tensor, sin: torch.Tensor, axis: int, half: int) -> torch.Tensor:
    """The rotary frequencies of cos/sin tables along `axis`: read at position 1, then refined at
    the last position P (its angle unwrapped by the first estimate: P times more digits, which
    a long float32 table needs, its position-1 row holding only float32's)."""
    def row(position: int) -> tuple:
        return tuple(position if a == axis else 0 for a in range(cos.dim() - 1))

    freqs = torch.atan2(sin[row(1)][:half].double(), cos[row(1)][:half].double())
    last = cos.shape[axis] - 1
    if last > 1:
        seen = torch.atan2(sin[row(last)][:half].double(), cos[row(last)][:half].double())
        turns = torch.round((last * freqs - seen) / (2 * math.pi))
        refined = (seen + 2 * math.pi * turns) / last
        # only where the first estimate's error, times P, cannot skip a turn
        freqs = torch.where((refined - freqs).abs() * last < 1.0, refined, freqs)
    return freqs


# ---- graph patterns -------------------------------------------------------------------
class _Matcher(AttentionPatterns):
    def __init__(self, gm: fx.GraphModule, values: dict) -> None:
        self.gm, self.values = gm, values

    def name(self, node) -> str | None:
        return op_name(node, self.gm) if isinstance(node, fx.Node) else None

    def strip(self, node, also: frozenset = frozenset()):
        """Skip casts, copies (and `also`, e.g. dropout) in front of a node."""
        while isinstance(node, fx.Node) and (self.name(node) in CASTS or self.name(node) in also) and node.args:
            node = node.args[0]
        return node

    def value(self, arg) -> object:
        return self.values.get(arg) if isinstance(arg, fx.Node) else arg

    def number(self, arg) -> float | None:
        value = self.value(arg)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    def operands(self, node, kind: str) -> tuple | None:
        if self.name(node) == kind and len(node.args) >= 2:
            return node.args[0], node.args[1]
        return None

    def param_1d(self, node) -> bool:
        value = self.value(self.strip(node))
        return isinstance(value, nn.Parameter) and value.dim() == 1

    def replace(self, node: fx.Node, fn, args: tuple, kwargs: dict) -> None:
        graph = self.gm.graph
        with graph.inserting_after(node):
            new = graph.call_function(fn, args, kwargs)
        new.meta.update({k: v for k, v in node.meta.items() if k != "aten"})  # no longer that ATen call
        self.values[new] = self.values.get(node)
        node.replace_all_uses_with(new)
        for user in new.users:  # a user kept as its ATen call (fx/generic.py) reads the same value from `new`
            if "aten" in user.meta:
                user.meta["aten"] = fx.node.map_arg(user.meta["aten"], lambda n: new if n is node else n)
        graph.erase_node(node)

    # -- rms norm --
    def rms(self, node: fx.Node) -> bool:
        pair = self.operands(node, "mul")
        if pair is None:
            return False
        for a, w in (pair, pair[::-1]):
            if isinstance(w, fx.Node) and self.param_1d(w):
                found = self.normalized(self.strip(a))
                if found is not None:
                    self.replace(node, rms_norm, (found[0], self.strip(w)), {"eps": found[1]})
                    return True
        return False

    def normalized(self, node) -> tuple[fx.Node, float] | None:
        """x * rsqrt(mean(x^2) + eps) or x / sqrt(mean(x^2) + eps): (x, eps)."""
        for kind, root in (("mul", "rsqrt"), ("div", "sqrt")):
            pair = self.operands(node, kind)
            for x, r in ((pair, pair[::-1]) if kind == "mul" else (pair,)) if pair else ():
                if self.name(r) == root and (found := self.mean_square(r.args[0], self.strip(x))) is not None:
                    return self.strip(x), found
        return None

    def mean_square(self, node, x) -> float | None:
        pair = self.operands(node, "add")
        if pair is None:
            return None
        mean, eps = pair if self.number(pair[1]) is not None else pair[::-1]
        if self.name(mean) != "mean" or self.number(eps) is None:
            return None
        dim = mean.args[1] if len(mean.args) > 1 else mean.kwargs.get("dim")
        if dim not in (-1, [-1], (-1,)) or not mean.kwargs.get("keepdim", len(mean.args) > 2 and mean.args[2]):
            return None
        square = mean.args[0]
        if self.name(square) == "pow" and self.number(square.args[1]) == 2.0 and self.strip(square.args[0]) is x:
            return self.number(eps)
        if self.name(square) == "mul" and self.strip(square.args[0]) is x and self.strip(square.args[1]) is x:
            return self.number(eps)
        return None

    # -- rope from tables --
    def rope(self, node: fx.Node) -> bool:
        """`x * cos + rotate_half(x) * sin` (either order), rotate_half(x) = cat(-x2, x1)
        of x's halves, cos and sin constant tables: rope at the theta their values give,
        checked against fivedc's rope on x's example value."""
        pair = self.operands(node, "add")
        for first, second in (pair, pair[::-1]) if pair else ():
            a, b = self.operands(first, "mul"), self.operands(second, "mul")
            for x, cos in (a, a[::-1]) if a else ():
                for rot, sin in (b, b[::-1]) if b else ():
                    x = self.strip(x)
                    if self.rotated_half(rot) is x and self.constant(cos) and self.constant(sin):
                        found = self.rope_theta(x, self.value(cos), self.value(sin))
                        if found is not None:
                            self.replace(node, rope, (x,), {"theta": found[0], "seq_axis": found[1],
                                                            "freqs": found[2]})
                            return True
        return False

    def rotated_half(self, node):
        """x when `node` is cat((-x[..., h:], x[..., :h]), -1), else None."""
        if self.name(node) != "cat" or len(node.args[0]) != 2 or node.args[1:] not in ((-1,), ()):
            return None
        neg, low = node.args[0]
        if self.name(neg) != "neg":
            return None
        high = neg.args[0]
        if self.name(high) != "getitem" or self.name(low) != "getitem" or high.args[0] is not low.args[0]:
            return None
        x = high.args[0]
        half = self.values[x].shape[-1] // 2
        if _last_slice(high.args[1]) != (half, None) or _last_slice(low.args[1]) != (0, half):
            return None
        return self.strip(x)

    def constant(self, node) -> bool:
        """Whether `node` depends on neither the inputs nor a parameter (a table from buffers and shapes)."""
        return not depends_on(node, lambda n: n.op == "placeholder" or (
            n.op == "get_attr" and isinstance(self.value(n), nn.Parameter)))

    def rope_theta(self, x: fx.Node, cos, sin) -> tuple[float, int, str] | None:
        """(theta, the sequence axis, the frequencies) for which x * cos + rotate_half(x) * sin is
        fivedc's rope. The frequencies are the tables' own angles at position 1 ("" when
        theta ** (-i / half) gives them to float64 precision): a library that computes its
        `inv_freq` in float32 has frequencies a theta does not reproduce exactly."""
        value = self.values[x]
        half = value.shape[-1] // 2
        if not isinstance(cos, torch.Tensor) or cos.dim() != value.dim() or half < 2:
            return None
        value, cos, sin = (_on_cpu(t) for t in (value, cos, sin))  # a model traced on a GPU
        seq_axes = [a for a in range(value.dim() - 1) if cos.shape[a] == value.shape[a] > 1]
        if len(seq_axes) != 1:
            return None
        axis = seq_axes[0]
        for a in range(value.dim() - 1):  # the tables decide: one row of x along the dims they broadcast over
            if a != axis and cos.shape[a] == 1 and sin.shape[a] == 1:
                value = value.narrow(a, 0, 1)
        value = _probe(value)  # x's own values where it has them
        at_one = [0] * (value.dim() - 1)
        at_one[axis] = 1
        angle = math.atan2(float(sin[(*at_one, 1)]), float(cos[(*at_one, 1)]))  # theta ** (-1 / half)
        if not 0 < angle < 1:
            return None
        theta = angle ** (-half)
        rotated = torch.cat((-value[..., half:], value[..., :half]), dim=-1)
        computed = value * cos + rotated * sin
        freqs = _table_freqs(cos, sin, axis, half)
        exact = theta ** (-torch.arange(0, half, dtype=torch.float64) / half)
        # tables in x's dtype round their angles to its precision: equal to theta's frequencies up to
        # that rounding is theta's; tables rounded further (a float32 cache in a float64 model) are
        # not fivedc's rope, which would not compute what the model does: they stay ops on the tables
        eps = torch.finfo(value.dtype).eps if value.is_floating_point() else 0.0
        close = 1e-13 if value.dtype == torch.float64 else 4 * eps
        given = None if torch.allclose(freqs, exact, rtol=close, atol=0) else freqs
        # the tables' own rounding grows with the angle (position x frequency): allowed, no more
        largest = (cos.shape[axis] - 1) * float(freqs.max())
        atol = 4 * eps * (1 + largest) * float(value.abs().max())
        if torch.allclose(computed, reference_rope(value, axis, theta, given), rtol=0, atol=atol):
            return theta, axis, freqs_text(given.tolist()) if given is not None else ""
        return None

    # -- repeat_kv by expand --
    def repeat_kv(self, node: fx.Node) -> bool:
        """reshape(expand(unsqueeze(x, d + 1), ...), ...) (or a flatten of the two dims, as
        torchtune writes it) that repeats each of x's entries along dim d n times
        (grouped-query attention's `repeat_kv`, checked on the example values) ->
        `x.repeat_interleave(n, dim=d)`."""
        if self.name(node) not in ("reshape", "flatten"):
            return False
        grown = self.strip(node.args[0])
        if self.name(grown) != "expand" or self.name(grown.args[0]) != "unsqueeze":
            return False
        x, axis = grown.args[0].args[0], grown.args[0].args[1]
        value, out = self.values[x], self.values[node]
        if not isinstance(axis, int) or not 0 < axis <= value.dim():
            return False
        if value.is_meta:  # a model without weights: the same views of data of x's shape
            value = _probe(value)
            out = value.unsqueeze(axis).expand(self.values[grown].shape).reshape(out.shape)
        n = out.shape[axis - 1] // value.shape[axis - 1] if value.shape[axis - 1] else 0
        if n < 1 or not torch.equal(value.repeat_interleave(n, dim=axis - 1), out):
            return False
        self.replace(node, torch.repeat_interleave, (x, n), {"dim": axis - 1})
        return True

    # -- swiglu --
    def swiglu(self, node: fx.Node) -> bool:
        pair = self.operands(node, "mul")
        if pair is None:
            return False
        for act, up in (pair, pair[::-1]):
            if self.name(act) == "silu" and len(act.users) == 1 and not act.kwargs.get("inplace"):
                self.replace(node, swiglu, (act.args[0], up), {})
                return True
        return False


def _probe(value: torch.Tensor) -> torch.Tensor:
    """`value`, or seeded random data of its shape and dtype where it has no values (computed from a
    parameter on the meta device: a model without weights, `fivedc/frontends/weightless.py`)."""
    if not value.is_meta:
        return value
    return torch.randn(value.shape, generator=torch.Generator().manual_seed(0), dtype=value.dtype)


def _last_slice(index) -> tuple | None:
    """(start, stop) of an index that slices only the last dim (step 1), else None."""
    if not isinstance(index, tuple) or not index or not isinstance(index[-1], slice):
        return None
    if any(i != slice(None) for i in index[:-1]) or index[-1].step not in (None, 1):
        return None
    stop = index[-1].stop
    return (index[-1].start or 0, None if stop is None or stop >= 2**62 else stop)


def rewrite(gm: fx.GraphModule, values: dict) -> None:
    """Apply the patterns of this file's docstring to `gm` in place (values follow)."""
    matcher = _Matcher(gm, values)
    for pattern in (matcher.rms, matcher.rope, matcher.repeat_kv, matcher.causal_mask, matcher.attention,
                    matcher.swiglu):
        for node in list(gm.graph.nodes):
            if getattr(node, "_erased", False) or node.op not in ("call_function", "call_method", "call_module"):
                continue
            try:
                pattern(node)
            except (KeyError, IndexError, AttributeError, TypeError, ValueError):
                continue  # an unusual graph is no match: the lowering then names what it cannot represent
        gm.graph.eliminate_dead_code()
