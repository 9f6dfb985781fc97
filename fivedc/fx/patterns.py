"""Op patterns the fx frontend rewrites in the fx graph before lowering.

Each pattern becomes one call of an executable marker (`fivedc/fx/recognise.py`)
or of a torch function, so the rewritten graph still runs and keeps its values:
- `x * rsqrt(mean(x^2 | x*x, dim=-1, keepdim=True) + eps) * w` (also `/ sqrt(...)`,
  casts in between, w a 1-D parameter) -> `rms_norm(x, w, eps)`;
- `softmax(q @ k.transpose(-2, -1) * scale [masked_fill(mask, -inf)], -1) [dropout] @ v`
  with scale = 1/sqrt(head_dim) (also `/ sqrt(d)`), the mask checked on its example
  value to be exactly causal -> `F.scaled_dot_product_attention(q, k, v, is_causal=...,
  dropout_p=...)` (the lowering warns about an active dropout);
- `silu(a) * b` (either order, the silu used once) -> `swiglu(a, b)`.
A near miss (another mask, another scale) is left alone, and the lowering then
reports the softmax or matmul it cannot represent at the user's line.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fivedc.fx.recognise import CASTS, op_name, rms_norm, swiglu


# ---- graph patterns -------------------------------------------------------------------
class _Matcher:
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
        new.meta.update(node.meta)
        self.values[new] = self.values.get(node)
        node.replace_all_uses_with(new)
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

    # -- attention --
    def attention(self, node: fx.Node) -> bool:
        pair = self.operands(node, "matmul")
        if pair is None:
            return False
        probs, v = self.strip(pair[0], frozenset({"dropout"})), pair[1]
        if self.name(probs) != "softmax" or _softmax_dim(probs) not in (-1, 3):
            return False
        scores, causal = probs.args[0], False
        if self.name(scores) == "masked_fill":
            if not self._causal_fill(scores):
                return False
            scores, causal = scores.args[0], True
        found = self.scaled(scores)
        if found is None:
            return False
        q, k = found
        kwargs = {"is_causal": causal, "dropout_p": self.dropout_p(pair[0])}  # the lowering warns about dropout
        self.replace(node, F.scaled_dot_product_attention, (q, k, v), kwargs)
        return True

    def dropout_p(self, node) -> float:
        """The probability of an active dropout among the casts in front of `node`, else 0."""
        while isinstance(node, fx.Node) and self.name(node) in CASTS | {"dropout"} and node.args:
            if self.name(node) == "dropout":
                if node.op == "call_module":
                    m = self.gm.get_submodule(node.target)
                    p, training = m.p, m.training
                else:
                    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
                    training = node.args[2] if len(node.args) > 2 else node.kwargs.get("training", True)
                if p and training:
                    return float(p)
            node = node.args[0]
        return 0.0

    def scaled(self, node) -> tuple | None:
        for kind in ("mul", "div"):
            pair = self.operands(node, kind)
            if pair is None:
                continue
            for qk, c in ((pair, pair[::-1]) if kind == "mul" else (pair,)):
                scale = self.number(c)
                if scale is None or self.name(qk) != "matmul":
                    continue
                scale = scale if kind == "mul" else 1.0 / scale
                q, kt = qk.args[0], qk.args[1]
                if self.name(kt) != "transpose" or sorted(_transpose_dims(kt)) not in ([-2, -1], [2, 3]):
                    continue
                head_dim = self.values[q].shape[-1]
                if math.isclose(scale, 1.0 / math.sqrt(head_dim), rel_tol=1e-12):
                    return q, kt.args[0]
        return None

    def _causal_fill(self, node: fx.Node) -> bool:
        mask, fill = self.value(node.args[1]), self.number(node.args[2])
        scores = self.values.get(node.args[0])
        if fill is None or fill > -1e4 or not isinstance(mask, torch.Tensor) or scores is None:
            return False
        tq, tk = scores.shape[-2:]
        expected = torch.ones(tq, tk, dtype=torch.bool).triu(1)
        try:
            full = mask.to(torch.bool).expand(scores.shape)
        except RuntimeError:
            return False
        return bool((full == expected).all())

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


def _softmax_dim(node: fx.Node):
    return node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")


def _transpose_dims(node: fx.Node) -> list:
    dims = list(node.args[1:3])
    return dims if len(dims) == 2 else [node.kwargs.get("dim0"), node.kwargs.get("dim1")]


def rewrite(gm: fx.GraphModule, values: dict) -> None:
    """Apply the patterns of this file's docstring to `gm` in place (values follow)."""
    matcher = _Matcher(gm, values)
    for pattern in (matcher.rms, matcher.attention, matcher.swiglu):
        for node in list(gm.graph.nodes):
            if getattr(node, "_erased", False) or node.op not in ("call_function", "call_method", "call_module"):
                continue
            try:
                pattern(node)
            except (KeyError, IndexError, AttributeError, TypeError, ValueError):
                continue  # an unusual graph is no match: the lowering then names what it cannot represent
        gm.graph.eliminate_dead_code()
