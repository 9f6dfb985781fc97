"""How `layer_export` names what an ATen call reads: a tensor by its origin in the eager run
(`Input`, `State`, `Result`, `Constant`, `Outside`), then, to compare two layers' calls, in a
form relative to the layer reading it (`LayerResult`, `LayerOutput`, `LayerState`;
`SegmentResult` for the calls before and after the layers)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Input:
    name: str  # the model's keyword input


@dataclass(frozen=True, slots=True)
class State:
    name: str  # a parameter or buffer, by its qualified name


@dataclass(frozen=True, slots=True)
class Result:
    call: int  # the index of the ATen call that returned it
    position: int  # of that call's tensors


@dataclass(frozen=True, slots=True)
class Constant:
    """A small tensor made outside ATen (a Python constant), named by its values."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    values: tuple


@dataclass(frozen=True, slots=True)
class Outside:
    key: int  # any other tensor: only itself is itself


# ---- ... and in canonical form, relative to the layer that reads it ----------------------
@dataclass(frozen=True, slots=True)
class SegmentResult:
    segment: str  # "before" or "after" the layers
    position: int  # of the call in its segment
    output: int


@dataclass(frozen=True, slots=True)
class LayerResult:
    offset: int  # the layer that made it, less the one reading it
    position: int
    output: int


@dataclass(frozen=True, slots=True)
class LayerOutput:
    offset: int
    index: int  # of the tensors that layer returned


@dataclass(frozen=True, slots=True)
class LayerState:
    offset: int
    name: str  # in its layer
