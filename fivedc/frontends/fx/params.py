"""The two-way map between a module's `state_dict` and the IR's qualified parameters.

Each IR parameter instance (`layers.0.c_attn_q`) is one `ParamMapping`: a
state-dict entry (`transformer.h.0.attn.c_attn.weight`), optionally a range of its
rows (one of q, k, v of a fused projection), optionally transposed (torch keeps a
linear's weight as [out, in], the IR as [in..., out...]; an MoE block's stacked
expert weights [experts, out, in] swap their last two dims), then reshaped to the IR
dims. Experts kept as separate modules (`experts.3.w1.weight`, an `nn.ModuleList`)
are one IR parameter stacked over the experts: one mapping per expert, each with the
`index` of its slice of the IR parameter's first dim. A range of rows is of dim 0 (one
of q, k, v of a fused projection) or of another dim `axis` (the gate or up half of an MoE
block's fused gate-up, stacked over the experts [experts, 2 ffn, hidden]). Only slicing, transposing,
reshaping, stacking and concatenating happen, so `to_ir_params` and
`from_ir_params` are exact inverses. `module_path` and `pattern`
(`transformer.h.*.attn.c_attn`) keep the user's names, so shardings can be pinned
by module-path pattern.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from fivedc.errors import FivedcError


@dataclass(frozen=True, slots=True)
class ParamMapping:
    ir_name: str  # qualified: `layers.0.c_attn_q`, `wte`
    param: str  # the IR Param's own name: `c_attn_q`
    repeat: str | None  # the Repeat it belongs to: `layers`
    key: str  # state_dict key: `transformer.h.0.attn.c_attn.weight`
    module_path: str  # `transformer.h.0.attn.c_attn`
    pattern: str  # the module path with the layer index as `*`: `transformer.h.*.attn.c_attn`
    ir_shape: tuple[int, ...]
    key_shape: tuple[int, ...]  # of the whole state_dict entry
    rows: tuple[int, int] | None = None  # the slice of dim `axis` this parameter is
    transpose: bool = False  # the entry's last two dims swapped: stored [..., out, in] by torch
    index: int | None = None  # the entry is this slice of the IR parameter's first dim (separate experts)
    axis: int = 0  # the dim of the entry `rows` is a range of

    def matches(self, pattern: str) -> bool:
        """Module-path pattern, dot-separated, `*` matching one path element (`blocks.*.attn.qkv`)."""
        want, have = pattern.split("."), self.module_path.split(".")
        return len(want) == len(have) and all(fnmatch.fnmatchcase(h, w) for h, w in zip(have, want))

    def to_ir(self, entry: Tensor) -> Tensor:
        """The IR parameter (its slice `index`, for one of separate experts) from the state-dict entry."""
        if self.rows is not None:
            entry = entry.narrow(self.axis, self.rows[0], self.rows[1] - self.rows[0])
        if self.transpose:
            entry = entry.transpose(-2, -1)
        return entry.reshape(self.ir_shape if self.index is None else self.ir_shape[1:])

    def torch_part(self, value: Tensor) -> Tensor:
        """The inverse of `to_ir`: this parameter (the whole IR value) as (its rows of) the state-dict entry."""
        if self.index is not None:
            value = value.reshape(self.ir_shape)[self.index]
        rows = list(self.key_shape)
        if self.rows is not None:
            rows[self.axis] = self.rows[1] - self.rows[0]
        if self.transpose:
            return value.reshape(*rows[:-2], rows[-1], rows[-2]).transpose(-2, -1)
        return value.reshape(rows)


def fetch_attr(root: torch.nn.Module, key: str) -> object:
    """The attribute a dotted key names (`layers.3.attn.wq.weight`): a parameter, buffer or constant."""
    owner, _, attr = key.rpartition(".")
    return getattr(root.get_submodule(owner) if owner else root, attr)


def module_state(module: torch.nn.Module) -> dict[str, Tensor]:
    """The module's parameters and persistent buffers under the names the tracer saw them by, in
    `state_dict()`'s order, without the state-dict hooks a library registers: torchtitan's
    `FusedQKVLinear` holds one `wqkv` parameter and writes it into its state dict as `wq`, `wk`
    and `wv` for its checkpoints, which name no parameter of the module."""
    out: dict[str, Tensor] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        out.update({dot + name: p for name, p in sub._parameters.items() if p is not None})
        out.update({dot + name: b for name, b in sub._buffers.items()
                    if b is not None and name not in sub._non_persistent_buffers_set})
    return out


def to_ir_params(mappings: tuple[ParamMapping, ...], state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    stacks: dict[str, dict[int, Tensor]] = {}
    for m in mappings:
        if m.key not in state_dict:
            raise FivedcError(f"the state dict has no entry {m.key!r} (IR parameter {m.ir_name})")
        entry = state_dict[m.key]
        if tuple(entry.shape) != m.key_shape:
            raise FivedcError(f"{m.key} has shape {tuple(entry.shape)}; the traced model had {m.key_shape}")
        if m.index is None:
            out[m.ir_name] = m.to_ir(entry)
        else:
            stacks.setdefault(m.ir_name, {})[m.index] = m.to_ir(entry)
    for name, slices in stacks.items():
        if sorted(slices) != list(range(len(slices))):
            raise FivedcError(f"the entries stacked into {name} do not cover it: slices {sorted(slices)}")
        out[name] = torch.stack([slices[i] for i in range(len(slices))])
    return out


def from_ir_params(mappings: tuple[ParamMapping, ...], ir_params: dict[str, Tensor]) -> dict[str, Tensor]:
    parts: dict[str, list[tuple[int, Tensor]]] = {}
    axes: dict[str, int] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for m in mappings:
        if m.ir_name not in ir_params:
            raise FivedcError(f"no value for the IR parameter {m.ir_name!r} ({m.key})")
        value = ir_params[m.ir_name]
        if math.prod(value.shape) != math.prod(m.ir_shape):
            raise FivedcError(f"{m.ir_name} has shape {tuple(value.shape)}; the IR has {m.ir_shape}")
        parts.setdefault(m.key, []).append((m.rows[0] if m.rows else 0, m.torch_part(value)))
        shapes[m.key] = m.key_shape
        axes[m.key] = m.axis
    out = {}
    for key, pieces in parts.items():
        pieces.sort(key=lambda p: p[0])
        whole = pieces[0][1] if len(pieces) == 1 else torch.cat([p for _, p in pieces], dim=axes[key])
        if tuple(whole.shape) != shapes[key]:
            raise FivedcError(f"the IR parameters of {key} do not cover it: {tuple(whole.shape)} of {shapes[key]}")
        out[key] = whole
    return out
