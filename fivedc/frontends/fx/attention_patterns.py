"""The attention patterns of the fx rewrites (`fivedc/frontends/fx/patterns.py`, which lists them all).

- `softmax(q @ k.transpose(-2, -1) * scale [softcap] [masked_fill(mask, -inf) | + mask],
  -1) [dropout] @ v`, the mask checked on its example value to be exactly causal ->
  `F.scaled_dot_product_attention(q, k, v, is_causal=..., dropout_p=..., scale=...)`, or
  with a softcap `c * tanh(s / c)` of the scaled scores -> `capped_attention`;
- `scaled_dot_product_attention(..., attn_mask=M)` with M a constant equal to the causal
  mask -> `is_causal=True`.

A mixin of the pattern matcher: it uses its helpers (`name`, `strip`, `operands`,
`number`, `value`, `constant`, `replace`) and its example values.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx
import torch.nn.functional as F

from fivedc.frontends.fx.recognise import CASTS, capped_attention


class AttentionPatterns:
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
        elif self.name(scores) == "add":
            scores = self._causal_added(scores)
            if scores is None:
                return False
            causal = True
        scores, softcap = self.capped(scores)
        found = self.scaled(scores)
        if found is None:
            return False
        q, k, scale = found
        kwargs = {"is_causal": causal, "dropout_p": self.dropout_p(pair[0])}  # the lowering warns about dropout
        if softcap is not None:
            self.replace(node, capped_attention, (q, k, v), kwargs | {"scale": scale, "softcap": softcap})
            return True
        if not math.isclose(scale, 1.0 / math.sqrt(self.values[q].shape[-1]), rel_tol=1e-12):
            kwargs["scale"] = scale
        self.replace(node, F.scaled_dot_product_attention, (q, k, v), kwargs)
        return True

    def capped(self, node) -> tuple:
        """(s, c) when `node` is c * tanh(s / c) (or s * (1 / c)), else (node, None)."""
        pair = self.operands(node, "mul")
        for tanh, c in (pair, pair[::-1]) if pair else ():
            cap = self.number(c)
            if cap is None or cap <= 0 or self.name(tanh) != "tanh":
                continue
            inner = tanh.args[0]
            for kind, factor in (("div", cap), ("mul", 1.0 / cap)):
                operands = self.operands(inner, kind)
                if operands is not None and self.number(operands[1]) is not None and \
                        math.isclose(self.number(operands[1]), factor, rel_tol=1e-12):
                    return operands[0], cap
        return node, None

    def _causal_added(self, node: fx.Node):
        """The scores of `scores + M` with M a constant additive causal mask (0 where a key is seen,
        below -1e4 elsewhere, checked on its value), else None."""
        for scores, mask in (node.args[:2], node.args[1::-1]):
            value, shape = self.values.get(mask), getattr(self.values.get(scores), "shape", None)
            if not isinstance(mask, fx.Node) or not self.constant(mask) or not isinstance(value, torch.Tensor) \
                    or shape is None or value.dtype == torch.bool:
                continue
            causal = torch.ones(shape[-2], shape[-1], dtype=torch.bool).tril()
            try:
                full = value.expand(shape)
            except RuntimeError:
                continue
            if bool((full[..., causal] == 0).all()) and bool((full[..., ~causal] < -1e4).all()):
                return scores
        return None

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
                if scale > 0:
                    return q, kt.args[0], scale
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

    def causal_mask(self, node: fx.Node) -> bool:
        """scaled_dot_product_attention(q, k, v, attn_mask=M) with M a constant that is
        exactly the causal mask (bool: True where j <= i; or additive: 0 there and
        -inf or below -1e4 elsewhere), checked on its value -> `is_causal=True`."""
        if self.name(node) != "sdpa" or node.kwargs.get("is_causal") or (len(node.args) > 5 and node.args[5]):
            return False
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
        given = dict(zip(names, node.args)) | dict(node.kwargs)
        mask, q, k = given.get("attn_mask"), self.values.get(node.args[0]), self.values.get(node.args[1])
        if not isinstance(mask, fx.Node) or not self.constant(mask) or q is None or k is None:
            return False
        value = self.values.get(mask)
        causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        try:
            attend = value if value.dtype == torch.bool else value == 0
            if value.dtype != torch.bool and not bool((value[~causal.expand(value.shape)] < -1e4).all()):
                return False
            if not bool((attend.expand(*q.shape[:-2], *causal.shape) == causal).all()):
                return False
        except (RuntimeError, AttributeError):
            return False
        kwargs = {k: v for k, v in given.items() if k not in ("query", "key", "value", "attn_mask")}
        self.replace(node, F.scaled_dot_product_attention, tuple(node.args[:3]), kwargs | {"is_causal": True})
        return True


def _softmax_dim(node: fx.Node):
    return node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")


def _transpose_dims(node: fx.Node) -> list:
    dims = list(node.args[1:3])
    return dims if len(dims) == 2 else [node.kwargs.get("dim0"), node.kwargs.get("dim1")]
