"""The execution plan: the compiled graph plus what a reader and the runtime need.

The plan is SPMD: one program for every rank, with rank coordinates resolved at
run time, so its size does not grow with the world size. Besides the graph it
lists the mesh groups (size, count and stride, never rank lists), every collective
with its reason and bytes, and a memory estimate per rank. It is saved as
versioned JSON; reading a plan of another version is a `PlanError`.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from fivedc.errors import PlanError
from fivedc.ir import Collective, CollectiveKind, Graph, Op, Phase, Redistribute, Repeat, walk_ops, walk_params
from fivedc.mesh import Mesh, MeshAxis
from fivedc.serialize import decode, encode

PLAN_VERSION = 1

# Bytes per parameter element for (parameters, gradients, optimizer state) with AdamW:
# in 16-bit training the optimizer keeps an fp32 master copy and fp32 moments (ZeRO's
# 2 + 2 + 12 bytes); in fp32 or fp64 the parameters are the master copy.
OPTIMIZER_BYTES = {"bf16": 12, "fp16": 12, "fp32": 8, "fp64": 16}


@dataclass(frozen=True, slots=True)
class GroupInfo:
    axes: tuple[MeshAxis, ...]
    size: int
    count: int  # how many disjoint groups
    strides: tuple[int, ...]  # rank distance between neighbours along each axis


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Bytes per rank. Activations: every op output kept for backward, no recomputation."""

    params: int
    grads: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations


@dataclass(frozen=True, slots=True)
class ExecutionPlan:
    version: int
    graph: Graph
    mesh: Mesh
    sequence_parallel: bool
    dtype: str
    groups: tuple[GroupInfo, ...]
    collectives: tuple[Collective, ...]
    memory: MemoryEstimate

    def save(self, path: str | Path) -> None:
        """Write atomically: a failed write never leaves a half-written plan behind."""
        path = Path(path)
        text = json.dumps(encode(self), indent=1)
        fd, tmp = tempfile.mkstemp(dir=path.parent if str(path.parent) else ".", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text + "\n")
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @staticmethod
    def load(path: str | Path) -> ExecutionPlan:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise PlanError(f"plan file {path} does not exist") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise PlanError(f"{path} is not a fivedc plan (not JSON: {error})") from None
        return ExecutionPlan.from_json(data, source=str(path))

    @staticmethod
    def from_json(data: object, *, source: str = "<plan>") -> ExecutionPlan:
        if not isinstance(data, dict) or "version" not in data:
            raise PlanError(f"{source} is not a fivedc plan (no version field)")
        if data["version"] != PLAN_VERSION:
            raise PlanError(
                f"{source} is a version {data['version']} plan; this fivedc reads version {PLAN_VERSION}",
                hint="recompile the model with this fivedc: fivedc compile MODEL.5d --mesh ...",
            )
        try:
            return decode(ExecutionPlan, data)
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise PlanError(f"{source} is not a valid version {PLAN_VERSION} plan: {error}") from None


def build_plan(graph: Graph, *, mesh: Mesh, sequence_parallel: bool, dtype: str, dtype_bytes: int) -> ExecutionPlan:
    collectives = gather_collectives(graph, dtype_bytes=dtype_bytes, mesh=mesh)
    axis_sets = {(a,) for a in mesh.rank_order if mesh.size(a) > 1} | {c.axes for c in collectives}
    groups = tuple(
        GroupInfo(axes, mesh.size(*axes), mesh.group_count(axes), tuple(mesh.stride(a) for a in axes))
        for axes in sorted(axis_sets)
    )
    memory = estimate_memory(graph, mesh=mesh, dtype=dtype, dtype_bytes=dtype_bytes)
    return ExecutionPlan(PLAN_VERSION, graph, mesh, sequence_parallel, dtype, groups, collectives, memory)


def qualified(name: str, repeat: Repeat | None) -> str:
    return f"{repeat.name}.*.{name}" if repeat else name


def gather_collectives(graph: Graph, *, dtype_bytes: int, mesh: Mesh) -> tuple[Collective, ...]:
    found: list[Collective] = []
    for node, repeat in walk_ops(graph.body):
        if isinstance(node, Redistribute):  # counts already include the repeat
            found.extend(c for c in node.forward + node.backward if c.kind != CollectiveKind.SLICE)
        elif isinstance(node, Op):
            layers = repeat.count if repeat else 1
            found.extend(replace(c, count=c.count * layers) for c in node.collectives)
    for param, repeat in walk_params(graph.body):
        if not param.grad_partial:
            continue
        nbytes = graph.local_numel(param.dims, param.sharding, mesh) * dtype_bytes
        found.append(
            Collective(
                CollectiveKind.ALL_REDUCE,
                param.grad_partial,
                Phase.GRAD_SYNC,
                qualified(param.name, repeat),
                nbytes,
                f"{param.name} is replicated over {'*'.join(param.grad_partial)} while the ops using it "
                f"split their work over {'*'.join(param.grad_partial)}: each rank holds a partial gradient",
                count=repeat.count if repeat else 1,
                loc=param.loc,
            )
        )
    return tuple(found)


def estimate_memory(graph: Graph, *, mesh: Mesh, dtype: str, dtype_bytes: int) -> MemoryEstimate:
    elements = 0
    for param, repeat in walk_params(graph.body):
        elements += graph.local_numel(param.dims, param.sharding, mesh) * (repeat.count if repeat else 1)
    activations = 0
    for node, repeat in walk_ops(graph.body):
        if isinstance(node, Op):
            count = repeat.count if repeat else 1
            activations += graph.local_numel(node.type.dims, node.sharding, mesh) * dtype_bytes * count
    return MemoryEstimate(
        params=elements * dtype_bytes,
        grads=elements * dtype_bytes,
        optimizer=elements * OPTIMIZER_BYTES[dtype],
        activations=activations,
    )
