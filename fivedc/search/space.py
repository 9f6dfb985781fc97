"""The layouts `fivedc search` considers: meshes, rank orders and plan options, as plain data.

A `Candidate` is everything `fivedc compile` takes besides the model: the mesh
(dp x pp x tp x cp x ep, its product the cluster's GPUs), the rank order, sequence
parallelism, the CP attention variant, the pipeline schedule with its microbatches
and virtual stages, the ZeRO stage and the recomputation. The space (`meshes`,
`pipelines`, `OPTIONS` below):

- tp divides the GPUs of a node (tensor parallelism stays inside one; `--gpus-per-node`);
- cp > 1 only for a model with attention over a sequence dim, with at least
  `MIN_TOKENS_PER_CP_RANK` tokens per cp rank (a ring hop of fewer tokens cannot
  hide behind its attention: its bytes grow with the tokens, the attention's work
  with their square); ep > 1 only for a model with MoE layers;
- pp at most the model's pipeline units (layers, and op runs between them) and 32;
- dp x ep divides the global batch (each data rank gets whole sequences);
- rank orders: tp innermost, pp outermost, and every order of cp, ep and dp between
  (orders that differ only in axes of size 1 are one);
- pp at most `MAX_PP` (32); per pp > 1: each schedule the runtime runs (interleaved
  with 2 chunks per rank), at two microbatch counts that split the local batch: the
  fewest the schedule accepts at or above pp, and the most up to 4 x as many;
- SP on and off under tp > 1; ring and all-gather CP attention under cp > 1;
- ZeRO 0-3 and recompute none, selective, full, where they change something.

Not searched: the precision. The dtype and `--fp8` (float8 linears, `passes/fp8.py`)
are the user's choice, the same for every candidate (`Candidate.fp8`), as they change the
numbers the model computes and not only its speed.

What does not divide or does not fit is pruned by the compiler's own checks and
estimates (`fivedc/search/search.py`), so the space above can be wide.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from fivedc.ir.graph import Graph, Op, walk_ops
from fivedc.ir.mesh import DEFAULT_RANK_ORDER, Mesh, MeshAxis
from fivedc.passes.base import CompileOptions
from fivedc.schedule import DEFAULT_SCHEDULE, DEFAULT_VIRTUAL, SCHEDULES as ALL_SCHEDULES, schedule_kind
from fivedc.search.divisors import divisors

A = MeshAxis
MIN_TOKENS_PER_CP_RANK = 1024
MICROBATCH_RANGE = 4  # microbatches tried: the fewest at or above pp, and up to 4 x as many
MAX_PP = 32  # deeper pipelines: their bubble or their microbatches grow with pp
SCHEDULES = (DEFAULT_SCHEDULE, *(name for name in ALL_SCHEDULES if name != DEFAULT_SCHEDULE))  # tried in this order
ZERO_STAGES = (0, 1, 2, 3)
RECOMPUTE = ("none", "selective", "full")  # in order of compute added: a fitting mode dominates the later ones


@dataclass(frozen=True, slots=True)
class Candidate:
    """One layout: a mesh with its rank order and the plan options `fivedc compile` takes."""

    mesh: Mesh
    sp: bool = False
    cp_attention: str | None = None  # ring | allgather, when cp > 1
    schedule: str | None = None  # when pp > 1
    microbatches: int | None = None
    virtual: int | None = None  # interleaved's chunks per rank
    zero: int = 0
    recompute: str = "none"
    fp8: bool = False  # float8 linears (--fp8): the user's choice, the same for every candidate, never searched

    def options(self, *, dtype: str, hardware=None) -> CompileOptions:
        return CompileOptions(mesh=self.mesh, sequence_parallel=self.sp, dtype=dtype,
                              cp_attention=self.cp_attention, zero=self.zero, schedule=self.schedule or DEFAULT_SCHEDULE,
                              microbatches=self.microbatches, virtual=self.virtual, recompute=self.recompute,
                              hardware=hardware, fp8=self.fp8)

    def as_json(self) -> dict:
        """The options as `--json` lists them (the mesh is written beside them)."""
        out: dict = {"rank_order": ",".join(self.mesh.rank_order), "sp": self.sp}
        if self.cp_attention:
            out["cp_attention"] = self.cp_attention
        if self.schedule:
            out |= {"schedule": self.schedule, "microbatches": self.microbatches}
            if self.virtual:
                out["virtual"] = self.virtual
        return out | {"zero": self.zero, "recompute": self.recompute} | ({"fp8": True} if self.fp8 else {})

    def flags(self) -> str:
        """The `fivedc compile` flags that give this layout."""
        parts = [f"--mesh {self.mesh}"]
        if self.mesh.rank_order != DEFAULT_RANK_ORDER:
            parts.append(f"--rank-order {','.join(self.mesh.rank_order)}")
        parts.append("--sp" if self.sp else "--no-sp") if self.mesh.size(A.TP) > 1 else None
        if self.cp_attention:
            parts.append(f"--cp-attention {self.cp_attention}")
        if self.schedule:
            parts += [f"--schedule {self.schedule}", f"--microbatches {self.microbatches}"]
            if self.virtual:
                parts.append(f"--virtual {self.virtual}")
        if self.zero:
            parts.append(f"--zero {self.zero}")
        if self.recompute != "none":
            parts.append(f"--recompute {self.recompute}")
        if self.fp8:
            parts.append("--fp8")
        return " ".join(parts)

    def short(self) -> str:
        """The options in a few words (the table's column)."""
        parts = ["sp" if self.sp else ""] if self.mesh.size(A.TP) > 1 else []
        if self.cp_attention:
            parts.append(f"cp:{self.cp_attention}")
        if self.schedule:
            parts.append(f"{self.schedule}{'/v' + str(self.virtual) if self.virtual else ''} m={self.microbatches}")
        parts += [f"zero{self.zero}" if self.zero else "", f"rc:{self.recompute}" if self.recompute != "none" else ""]
        if self.mesh.rank_order != DEFAULT_RANK_ORDER:
            parts.append("order " + ",".join(a for a in self.mesh.rank_order if self.mesh.size(a) > 1))
        return " ".join(p for p in parts if p) or "-"


def model_traits(graph: Graph) -> tuple[bool, bool]:
    """(has attention over a sequence dim, has MoE layers)."""
    kinds = {op.kind for op, _ in walk_ops(graph.body) if isinstance(op, Op)}
    return "attention" in kinds and graph.seq_dim is not None, "moe" in kinds


def mesh_sizes(graph: Graph, *, gpus: int, gpus_per_node: int, units: int) -> list[tuple[int, ...]]:
    """dp x pp x tp x cp x ep sizes of the space (before rank orders), in a fixed order."""
    attention, moe = model_traits(graph)
    seq = graph.dim(graph.seq_dim) if graph.seq_dim else 1
    out = []
    for tp in (t for t in divisors(gpus_per_node) if gpus % t == 0):
        for cp in (c for c in divisors(gpus // tp) if c == 1 or (attention and seq // c >= MIN_TOKENS_PER_CP_RANK)):
            for ep in (e for e in divisors(gpus // (tp * cp)) if e == 1 or moe):
                for pp in (p for p in divisors(gpus // (tp * cp * ep)) if p <= min(units, MAX_PP)):
                    dp = gpus // (tp * cp * ep * pp)
                    out.append((dp, pp, tp, cp, ep))
    return out


def batch_splits(graph: Graph, sizes: tuple[int, ...]) -> bool:
    return graph.dim(graph.batch_dim) % (sizes[0] * sizes[4]) == 0


def rank_orders(sizes: tuple[int, ...]) -> list[tuple[MeshAxis, ...]]:
    """tp innermost, pp outermost, cp/ep/dp in every order that differs on axes larger than 1."""
    size = dict(zip((A.DP, A.PP, A.TP, A.CP, A.EP), sizes))
    seen, out = set(), []
    middle = [(A.CP, A.EP, A.DP), *itertools.permutations((A.CP, A.EP, A.DP))]
    for perm in middle:
        order = (A.TP, *perm, A.PP)
        key = tuple(a for a in order if size[a] > 1)
        if key not in seen:
            seen.add(key)
            out.append(order)
    return out


def pipelines(graph: Graph, sizes: tuple[int, ...]) -> list[tuple[str | None, int | None, int | None]]:
    """(schedule, microbatches, virtual) choices for a mesh; (None, None, None) without a pipeline."""
    pp = sizes[1]
    if pp == 1:
        return [(None, None, None)]
    local = graph.dim(graph.batch_dim) // (sizes[0] * sizes[4])
    out = []
    for name in SCHEDULES:
        kind = schedule_kind(name)
        least = max(kind.min_microbatches(pp), 1 if kind.forwards_first else pp)  # GPipe: fewer keep less
        counts = [d for d in divisors(local) if d >= least and (not kind.microbatches_multiple_of_p or d % pp == 0)]
        if not counts:
            counts = [d for d in divisors(local) if d >= kind.min_microbatches(pp)][:1]
        for m in _spread(counts):
            out.append((name, m, kind.virtual(DEFAULT_VIRTUAL)))
    return out


def _spread(counts: list[int]) -> list[int]:
    """The fewest, and the most up to `MICROBATCH_RANGE` times as many."""
    if not counts:
        return []
    most = max(d for d in counts if d <= counts[0] * MICROBATCH_RANGE)
    return sorted({counts[0], most})
