"""The attention patterns of the fx rewrites (`fivedc/frontends/fx/patterns.py`, which lists them all).

- `softmax(q @ k.transpose(-2, -1) * scale [softcap] [masked_fill(mask, -inf) | + mask],
  -1) [dropout] @ v`, the mask checked on its example value to be exactly causal ->
  `F.scaled_dot_product_attention(q, k, v, is_causal=..., dropout_p=..., scale=...)`, or
  with a softcap `c * tanh(s / c)` of the scaled scores -> `capped_attention`;
- `scaled_dot_product_attention(..., attn_mask=M)` with M a constant equal to the causal
  mask -> `is_causal=True`.

A mask that is, by value, a causal sliding window of W keys (the query at i sees the
keys at i - W < j <= i: Mistral's, Gemma 2's and Gemma 3's `sliding_window` as their
mask functions build it from positions) is the same attention with `window=W`
(`capped_attention` or the `windowed_attention` marker); W is read off the mask's last
row and the whole mask checked against the band, so any other mask lowers as before.

A mixin of the pattern matcher: it uses its helpers (`name`, `strip`, `operands`,
`number`, `value`, `constant`, `replace`) and its example values.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx
import torch.nn.functional as F

from fivedc.frontends.fx.recognise import CASTS, band, capped_attention, windowed_attention


class AttentionPatterns:
    def attention(self, node: fx.Node) -> bool:
        pair = self.operands(node, "matmul")
        if pair is None:
            return False
        probs, v = self.strip(pair[0], frozenset({"dropout"})), pair[1]
        if self.name(probs) != "softmax" or _softmax_dim(probs) not in (-1, 3):
            return False
        found = self._masked(probs.args[0])
        if found is None:
            return False
        scores, causal, window = found
        scores, softcap = self.capped(scores)
        found = self.scaled(scores)
        if found is None:
            return False
        q, k, scale = found
        kwargs = {"is_causal": causal, "dropout_p": self.dropout_p(pair[0])}  # the lowering warns about dropout
        kwargs |= {"window": window} if window else {}
        if softcap is not None:
            self.replace(node, capped_attention, (q, k, v), kwargs | {"scale": scale, "softcap": softcap})
            return True
        if not math.isclose(scale, 1.0 / math.sqrt(self.values[q].shape[-1]), rel_tol=1e-12):
            kwargs["scale"] = scale
        self.replace(node, windowed_attention if window else F.scaled_dot_product_attention, (q, k, v), kwargs)
        return True

    def _masked(self, scores: fx.Node) -> tuple | None:
        """(the scores before the mask, causal, window) of masked scores (no mask: not causal),
        or None where the mask is neither causal nor a causal sliding window."""
        if self.name(scores) == "masked_fill":
            window = self._fill_window(scores)
            return None if window is None else (scores.args[0], True, window)
        if self.name(scores) == "add":
            found = self._causal_added(scores)
            return None if found is None else (found[0], True, found[1])
        return scores, False, 0

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
        """(the scores, window) of `scores + M` with M a constant additive causal mask, or a sliding
        window's (0 where a key is seen, below -1e4 elsewhere, checked on its value), else None."""
        for scores, mask in (node.args[:2], node.args[1::-1]):
            value, shape = self.values.get(mask), getattr(self.values.get(scores), "shape", None)
            if not isinstance(mask, fx.Node) or not self.constant(mask) or not isinstance(value, torch.Tensor) \
                    or shape is None or value.dtype == torch.bool:
                continue
            try:
                full = value.expand(shape)
            except RuntimeError:
                continue
            window = band_window(full == 0)
            if window is not None and bool((full[..., ~band(shape[-2], shape[-1], window)] < -1e4).all()):
                return scores, window
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

    def _fill_window(self, node: fx.Node) -> int | None:
        """The window of `masked_fill(scores, M, fill)` with M True exactly where a causal mask hides
        a key (0), or a sliding window's (W), and fill below -1e4; else None."""
        mask, fill = self.value(node.args[1]), self.number(node.args[2])
        scores = self.values.get(node.args[0])
        if fill is None or fill > -1e4 or not isinstance(mask, torch.Tensor) or scores is None:
            return None
        try:
            full = mask.to(torch.bool).expand(scores.shape)
        except RuntimeError:
            return None
        return band_window(~full)

    def causal_mask(self, node: fx.Node) -> bool:
        """scaled_dot_product_attention(q, k, v, attn_mask=M) with M a constant that is
        exactly the causal mask (bool: True where j <= i; or additive: 0 there and
        -inf or below -1e4 elsewhere), checked on its value -> `is_causal=True`; with M
        a causal sliding window's band of W keys -> `windowed_attention(..., window=W)`."""
        if self.name(node) != "sdpa" or node.kwargs.get("is_causal") or (len(node.args) > 5 and node.args[5]):
            return False
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
        given = dict(zip(names, node.args)) | dict(node.kwargs)
        mask, q, k = given.get("attn_mask"), self.values.get(node.args[0]), self.values.get(node.args[1])
        if not isinstance(mask, fx.Node) or not self.constant(mask) or q is None or k is None:
            return False
        window = _mask_window(self.values.get(mask), (*q.shape[:-2], q.shape[-2], k.shape[-2]))
        if window is None:
            return False
        kwargs = {k: v for k, v in given.items() if k not in ("query", "key", "value", "attn_mask")}
        kwargs |= {"is_causal": True} | ({"window": window} if window else {})
        self.replace(node, windowed_attention if window else F.scaled_dot_product_attention, tuple(node.args[:3]),
                     kwargs)
        return True


def _mask_window(value, shape: tuple) -> int | None:
    """0 where an SDPA mask (bool: True where a key is seen; additive: 0 there, below -1e4
    elsewhere) is causal, W where it is a causal sliding window of W keys, else None."""
    try:
        attend = (value if value.dtype == torch.bool else value == 0).expand(shape)
        window = band_window(attend)
        if window is None:
            return None
        if value.dtype != torch.bool and not bool((value.expand(shape)[..., ~band(*shape[-2:], window)] < -1e4).all()):
            return None
    except (RuntimeError, AttributeError):
        return None
    return window


def band_window(attend: torch.Tensor) -> int | None:
    """attend [..., tq, tk] (True where a query sees a key): 0 where it is exactly the causal
    mask, W where it is the causal band of W keys (i - W < j <= i; W read off the last query,
    the whole mask checked), else None."""
    tq, tk = attend.shape[-2:]
    if tq == 0 or tk == 0:
        return None
    seen = int(attend.reshape(-1, tq, tk)[0, -1].sum()) if tq == tk else tk
    if seen == 0:
        return None
    window = 0 if seen >= tk else seen
    return window if bool((attend == band(tq, tk, window)).all()) else None


def _softmax_dim(node: fx.Node):
    return node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")


def _transpose_dims(node: fx.Node) -> list:
    dims = list(node.args[1:3])
    return dims if len(dims) == 2 else [node.kwargs.get("dim0"), node.kwargs.get("dim1")]
