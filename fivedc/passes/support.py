"""Refuse, clearly, what this version does not implement yet, before any planning.

An axis > 1 whose pass has not landed gets a "not yet supported" error naming the
axis and the mesh to use instead, never a silently wrong plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fivedc.errors import NotSupportedError
from fivedc.ir.graph import Graph
from fivedc.ir.mesh import MeshAxis
from fivedc.passes.base import CompileOptions

NOT_YET: dict[MeshAxis, str] = {}  # every axis's pass has landed (pp, ep were the last)


@dataclass(frozen=True, slots=True)
class CheckSupportedAxes:
    name: ClassVar[str] = "check-supported-axes"

    def run(self, graph: Graph, options: CompileOptions) -> Graph:
        mesh = options.mesh
        for axis, what in NOT_YET.items():
            if mesh.size(axis) > 1:
                sizes = dict(mesh.as_dict(), **{str(axis): 1})
                raise NotSupportedError(
                    f"{what} ({axis}={mesh.size(axis)}) is not supported yet",
                    hint="compile with " + axis + "=1, e.g. --mesh " + "x".join(str(v) for v in sizes.values()),
                )
        return graph
