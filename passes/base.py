"""What every pass shares: the compile options, and the `Pass` protocol.

A pass is a small frozen dataclass with a `name` and a `run(graph, options)` that
returns a new graph; it never mutates its input and never imports
`torch.distributed`. `fivedc/pipeline.py` lists the passes in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

from fivedc.errors import FivedcError
from fivedc.ir import Graph
from fivedc.mesh import Mesh, MeshAxis

DTYPE_BYTES = {"fp64": 8, "fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True, slots=True)
class CompileOptions:
    """Everything that changes a plan besides the model itself."""

    mesh: Mesh
    sequence_parallel: bool | None = None  # None: the model's @sp annotation decides
    dtype: str = "bf16"  # training precision of parameters and activations

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise FivedcError(
                f"unknown dtype {self.dtype!r}", hint=f"choose one of {', '.join(DTYPE_BYTES)}"
            )

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def sp_enabled(self, graph: Graph) -> bool:
        if self.sequence_parallel is not None:
            return self.sequence_parallel
        return graph.annotation("sp") is not None

    @property
    def data_axes(self) -> tuple[MeshAxis, ...]:
        """Axes that split the batch of every non-expert layer (DESIGN.md: dp and ep)."""
        return (MeshAxis.DP, MeshAxis.EP)


class Pass(Protocol):
    name: ClassVar[str]

    def run(self, graph: Graph, options: CompileOptions) -> Graph: ...
