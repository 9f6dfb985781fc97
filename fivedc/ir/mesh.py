"""The 5-D device mesh: axis sizes, rank order, rank <-> coordinates, and groups.

`--mesh DPxPPxTPxCPxEP` is always in that order; the named form `dp=2,tp=2` leaves
omitted axes at 1. The rank order says which axis is contiguous in rank numbers,
innermost first: the default `tp,cp,ep,dp,pp` puts tensor-parallel ranks on one
node. Everything here is arithmetic on integers: the planner never needs a process
group, and a 16384-rank mesh costs the same as a 1-rank one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum

from fivedc.errors import MeshError
from fivedc.ir.limits import check_world


class MeshAxis(StrEnum):
    """A mesh axis. An axis splits work over ranks; a dim is a tensor dimension."""

    DP = "dp"
    PP = "pp"
    TP = "tp"
    CP = "cp"
    EP = "ep"


MESH_ORDER: tuple[MeshAxis, ...] = (MeshAxis.DP, MeshAxis.PP, MeshAxis.TP, MeshAxis.CP, MeshAxis.EP)
_INDEX = {axis: i for i, axis in enumerate(MESH_ORDER)}
DEFAULT_RANK_ORDER: tuple[MeshAxis, ...] = (MeshAxis.TP, MeshAxis.CP, MeshAxis.EP, MeshAxis.DP, MeshAxis.PP)


def _axis(name: str, *, what: str) -> MeshAxis:
    try:
        return MeshAxis(name.strip().lower())
    except ValueError:
        raise MeshError(
            f"unknown mesh axis {name.strip()!r} in {what}",
            hint="axes are dp, pp, tp, cp, ep",
        ) from None


@dataclass(frozen=True, slots=True)
class Mesh:
    """Axis sizes (in `MESH_ORDER`) and the rank order (innermost axis first)."""

    sizes: tuple[int, ...]
    rank_order: tuple[MeshAxis, ...] = DEFAULT_RANK_ORDER

    def __post_init__(self) -> None:
        if len(self.sizes) != len(MESH_ORDER) or any(s < 1 for s in self.sizes):
            raise MeshError(f"a mesh needs five sizes >= 1 (dp, pp, tp, cp, ep), got {self.sizes}")
        if sorted(self.rank_order) != sorted(MESH_ORDER):
            raise MeshError(
                f"rank order {','.join(self.rank_order)} must name each of dp, pp, tp, cp, ep once"
            )
        check_world(math.prod(self.sizes), what=f"mesh {'x'.join(map(str, self.sizes))}")

    # ---- construction -------------------------------------------------------------
    @staticmethod
    def parse(text: str, *, rank_order: str | None = None) -> Mesh:
        """`2x1x2x1x1` (dp x pp x tp x cp x ep) or `dp=2,tp=2`."""
        order = Mesh.parse_rank_order(rank_order) if rank_order else DEFAULT_RANK_ORDER
        text = text.strip()
        if re.fullmatch(r"\d+(x\d+){4}", text):
            return Mesh(tuple(int(part) for part in text.split("x")), order)
        if re.fullmatch(r"\s*\w+\s*=\s*\d+(\s*,\s*\w+\s*=\s*\d+)*\s*", text):
            sizes = dict.fromkeys(MESH_ORDER, 1)
            seen: set[MeshAxis] = set()
            for part in text.split(","):
                name, value = part.split("=")
                axis = _axis(name, what=f"mesh {text!r}")
                if axis in seen:
                    raise MeshError(f"mesh axis {axis} is given twice in {text!r}")
                seen.add(axis)
                if int(value) < 1:
                    raise MeshError(f"mesh axis {axis}={value} must be at least 1")
                sizes[axis] = int(value)
            return Mesh(tuple(sizes[a] for a in MESH_ORDER), order)
        raise MeshError(
            f"cannot parse mesh {text!r}",
            hint="write DPxPPxTPxCPxEP, e.g. 8x16x8x4x4, or named sizes, e.g. dp=2,tp=2",
        )

    @staticmethod
    def parse_rank_order(text: str) -> tuple[MeshAxis, ...]:
        axes = tuple(_axis(name, what=f"rank order {text!r}") for name in text.split(","))
        if sorted(axes) != sorted(MESH_ORDER):
            raise MeshError(
                f"rank order {text!r} must name each of dp, pp, tp, cp, ep exactly once",
                hint="the default is tp,cp,ep,dp,pp (innermost first)",
            )
        return axes

    # ---- sizes --------------------------------------------------------------------
    def size(self, *axes: MeshAxis) -> int:
        """Product of the sizes of `axes` (1 for none)."""
        size = 1
        for axis in axes:
            size *= self.sizes[_INDEX[axis]]
        return size

    @property
    def world(self) -> int:
        return math.prod(self.sizes)

    def as_dict(self) -> dict[str, int]:
        return {str(a): s for a, s in zip(MESH_ORDER, self.sizes)}

    def __str__(self) -> str:
        return "x".join(str(s) for s in self.sizes)

    # ---- ranks --------------------------------------------------------------------
    def stride(self, axis: MeshAxis) -> int:
        """Distance in rank numbers between neighbours along `axis`."""
        inner = self.rank_order[: self.rank_order.index(axis)]
        return self.size(*inner)

    def coords(self, rank: int) -> dict[MeshAxis, int]:
        if not 0 <= rank < self.world:
            raise MeshError(f"rank {rank} is outside a world of {self.world}")
        return {a: (rank // self.stride(a)) % self.size(a) for a in MESH_ORDER}

    def rank_of(self, coords: dict[MeshAxis, int]) -> int:
        return sum(coords.get(a, 0) * self.stride(a) for a in MESH_ORDER)

    def group_ranks(self, axes: tuple[MeshAxis, ...], rank: int) -> tuple[int, ...]:
        """The ranks that share every coordinate of `rank` except those on `axes`.

        Ordered with the first axis of `axes` outermost, which is the order a
        collective over a composite group (e.g. dp x ep) uses for its chunks.
        """
        base = self.coords(rank)
        ranks = [base]
        for axis in axes:
            ranks = [{**c, axis: i} for c in ranks for i in range(self.size(axis))]
        return tuple(self.rank_of(c) for c in ranks)

    def all_groups(self, axes: tuple[MeshAxis, ...]) -> Iterator[tuple[int, ...]]:
        """Every group over `axes` once (as `group_ranks` orders it), by its lowest rank."""
        for rank in range(self.world):
            if all((rank // self.stride(a)) % self.size(a) == 0 for a in axes):
                yield self.group_ranks(axes, rank)

    def group_count(self, axes: tuple[MeshAxis, ...]) -> int:
        """How many disjoint groups the axes form: world / group size."""
        return self.world // self.size(*axes)

    def device_mesh_layout(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """Shape and names for torch's DeviceMesh: outermost axis first (row-major)."""
        outer_first = tuple(reversed(self.rank_order))
        return tuple(self.size(a) for a in outer_first), tuple(str(a) for a in outer_first)
