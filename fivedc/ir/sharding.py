"""Sharding of one tensor: which mesh axes split which named dims, and pending sums.

Tensors in fivedc have named dims, unique within a tensor, so a sharding maps dim
names to mesh axes rather than positions: `Sharding.of(batch=("dp",), seq=("tp",))`.
A dim split over several axes takes them major-first (`seq:cp*tp` puts cp outside).
`partial` lists the axes over which the local values are summands of the true value.
Every axis that neither splits a dim nor is partial replicates the tensor.

The text form, used in plans and error messages, is `batch:dp seq:tp +partial(tp)`,
or `replicated`; `Sharding.parse` reads it back.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivedc.errors import PlanError
from fivedc.ir.mesh import MeshAxis


@dataclass(frozen=True, slots=True)
class Sharding:
    split: tuple[tuple[str, tuple[MeshAxis, ...]], ...] = ()  # (dim, axes) sorted by dim
    partial: tuple[MeshAxis, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "split", tuple(sorted((d, tuple(a)) for d, a in self.split if a)))
        object.__setattr__(self, "partial", tuple(sorted(set(self.partial))))
        used = [a for _, axes in self.split for a in axes] + list(self.partial)
        if len(used) != len(set(used)):
            raise ValueError(f"an axis is used twice in {self}")

    @staticmethod
    def of(partial: tuple[MeshAxis, ...] = (), **split: tuple[MeshAxis, ...]) -> Sharding:
        return Sharding(tuple(split.items()), partial)

    # ---- queries --------------------------------------------------------------------
    def axes_of(self, dim: str) -> tuple[MeshAxis, ...]:
        for d, axes in self.split:
            if d == dim:
                return axes
        return ()

    def split_axes(self) -> tuple[MeshAxis, ...]:
        return tuple(a for _, axes in self.split for a in axes)

    def dim_of(self, axis: MeshAxis) -> str | None:
        for d, axes in self.split:
            if axis in axes:
                return d
        return None

    def uses(self, axis: MeshAxis) -> bool:
        return axis in self.partial or self.dim_of(axis) is not None

    @property
    def is_replicated(self) -> bool:
        return not self.split and not self.partial

    # ---- edits ----------------------------------------------------------------------
    def with_split(self, dim: str, axes: tuple[MeshAxis, ...]) -> Sharding:
        rest = tuple((d, a) for d, a in self.split if d != dim)
        return Sharding(rest + ((dim, axes),), self.partial)

    def with_partial(self, axes: tuple[MeshAxis, ...]) -> Sharding:
        return Sharding(self.split, axes)

    def without_axis(self, axis: MeshAxis) -> Sharding:
        split = tuple((d, tuple(a for a in axes if a != axis)) for d, axes in self.split)
        return Sharding(split, tuple(a for a in self.partial if a != axis))

    def restrict(self, dims: tuple[str, ...]) -> Sharding:
        """Keep only the splits of `dims` (the others were reduced away); drop partial."""
        return Sharding(tuple((d, a) for d, a in self.split if d in dims))

    def rename(self, mapping: dict[str, str]) -> Sharding:
        return Sharding(tuple((mapping.get(d, d), a) for d, a in self.split), self.partial)

    # ---- text -----------------------------------------------------------------------
    def __str__(self) -> str:
        parts = [f"{d}:{'*'.join(axes)}" for d, axes in self.split]
        if self.partial:
            parts.append(f"+partial({','.join(self.partial)})")
        return " ".join(parts) if parts else "replicated"

    def __repr__(self) -> str:
        return f"Sharding({self})"

    @staticmethod
    def parse(text: str) -> Sharding:
        text = text.strip()
        if text in ("", "replicated"):
            return Sharding()
        split: list[tuple[str, tuple[MeshAxis, ...]]] = []
        partial: tuple[MeshAxis, ...] = ()
        try:
            for part in text.split():
                if part.startswith("+partial(") and part.endswith(")"):
                    partial = tuple(MeshAxis(a) for a in part[len("+partial(") : -1].split(","))
                else:
                    dim, axes = part.split(":")
                    split.append((dim, tuple(MeshAxis(a) for a in axes.split("*"))))
            return Sharding(tuple(split), partial)
        except ValueError as error:
            raise PlanError(f"cannot read sharding {text!r}: {error}") from None
