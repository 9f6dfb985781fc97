"""The execution plan: the compiled graph plus what a reader and the runtime need.

The plan is SPMD: one program for every rank, with rank coordinates resolved at
run time, so its size does not grow with the world size. Besides the graph it
lists the mesh groups (size, count and stride, never rank lists), every collective
with its reason and bytes, and a memory estimate per rank. It is saved as
versioned JSON; reading a plan of another version is a `PlanError`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from fivedc.errors import FivedcError, PlanError
from fivedc.ir import Collective, CollectiveKind, Graph, Op, Repeat, Redistribute, walk_ops
from fivedc.memory import OPTIMIZER_BYTES, MemoryEstimate, estimate_memory  # noqa: F401 (OPTIMIZER_BYTES: re-exported)
from fivedc.mesh import Mesh, MeshAxis
from fivedc.overlap import Bucket, plan_buckets
from fivedc.recompute import recomputed_regions
from fivedc.param_sync import (DEFAULT_BUCKET_BYTES, copy_sync_collectives, param_sync_collectives, sync_bytes,
                               zero_notes)
from fivedc.saved import regather_collectives
from fivedc.hardware import Hardware
from fivedc.memo import Memo, memo_for
from fivedc.step_time import TimeEstimate, estimate_time
from fivedc.serialize import decode, encode
from fivedc.stage_plan import pipeline_collectives
from fivedc.stages import PipelineSpec, chunk_starts

PLAN_VERSION = 1



@dataclass(frozen=True, slots=True)
class GroupInfo:
    axes: tuple[MeshAxis, ...]
    size: int
    count: int  # how many disjoint groups
    strides: tuple[int, ...]  # rank distance between neighbours along each axis


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
    zero: int = 0  # ZeRO stage: 0 (off), 1 optimizer state, 2 + gradients, 3 + parameters
    overlap: bool = True  # reduce gradient buckets during backward; ZeRO-3: prefetch parameters
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    buckets: tuple[Bucket, ...] = ()  # gradient buckets in launch order (fivedc/overlap.py)
    pipeline: PipelineSpec | None = None  # pp > 1: chunks, schedule, microbatches (fivedc/stages.py)
    notes: tuple[str, ...] = ()  # warnings for the reader, e.g. a setting that changes nothing
    recompute: str = "none"  # activation recomputation: none, selective (attention), full (each layer)
    time: TimeEstimate | None = None  # seconds per step on a GPU (compile --gpu; fivedc/step_time.py)

    def save(self, path: str | Path, *, inputs: tuple[str | Path, ...] = ()) -> None:
        """Write atomically with `fivedc.files.write_output`: never half a plan, never over
        a directory, device, outside symlink or one of `inputs` (an `OutputError`)."""
        from fivedc.files import write_output

        write_output(path, json.dumps(encode(self), indent=1) + "\n", inputs=inputs, what="plan")

    @staticmethod
    def load(path: str | Path) -> ExecutionPlan:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise PlanError(f"plan file {path} does not exist") from None
        except IsADirectoryError:
            raise PlanError(f"{path} is a directory, not a plan file",
                            hint="give the .json file that fivedc compile -o wrote") from None
        except OSError as error:
            raise PlanError(f"cannot read plan file {path}: {error.strerror}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise PlanError(f"{path} is not a fivedc plan (not JSON: {error})") from None
        return ExecutionPlan.from_json(data, source=str(path))

    @staticmethod
    def from_json(data: object, *, source: str = "<plan>") -> ExecutionPlan:
        if not isinstance(data, dict) or "version" not in data:
            raise PlanError(f"{source} is not a fivedc plan (no version field)")
        version = data["version"]
        if not isinstance(version, int) or isinstance(version, bool):
            raise PlanError(f"{source}: the version field is {version!r}, not a number",
                            hint=f'a plan this fivedc reads starts {{"version": {PLAN_VERSION}, ...}}')
        if version != PLAN_VERSION:
            raise PlanError(
                f"{source} is a version {version} plan; this fivedc reads version {PLAN_VERSION}",
                hint="recompile the model with this fivedc: fivedc compile MODEL.5d --mesh ...",
            )
        try:
            return decode(ExecutionPlan, data)
        except PlanError as error:
            raise PlanError(f"{source} is not a valid version {PLAN_VERSION} plan: {error.message}",
                            hint="recompile the model rather than editing the plan") from None
        except FivedcError as error:  # a field's own check, e.g. a sharding that does not parse
            raise PlanError(f"{source} is not a valid version {PLAN_VERSION} plan: {error.message}") from None
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise PlanError(f"{source} is not a valid version {PLAN_VERSION} plan: {type(error).__name__}: {error}") from None


def build_plan(graph: Graph, *, mesh: Mesh, sequence_parallel: bool, dtype: str, dtype_bytes: int,
               zero: int = 0, overlap: bool = True, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
               pipeline: PipelineSpec | None = None, recompute: str = "none",
               hardware: Hardware | None = None, memo: Memo | None = None) -> ExecutionPlan:
    memo = memo_for(memo, graph, mesh, dtype)
    buckets = gradient_buckets(graph, mesh, dtype_bytes=dtype_bytes, zero=zero, bucket_bytes=bucket_bytes,
                               pipeline=pipeline, memo=memo)
    collectives = gather_collectives(graph, dtype_bytes=dtype_bytes, mesh=mesh, zero=zero, overlap=overlap,
                                     buckets=buckets) + tuple(regather_collectives(graph, recompute))
    if pipeline is not None:
        collectives += tuple(pipeline_collectives(graph, mesh, pipeline, dtype_bytes))
        collectives += tuple(copy_sync_collectives(graph, mesh, pipeline, dtype_bytes, zero))
    axis_sets = {(a,) for a in mesh.rank_order if mesh.size(a) > 1} | {c.axes for c in collectives}
    groups = tuple(
        GroupInfo(axes, mesh.size(*axes), mesh.group_count(axes), tuple(mesh.stride(a) for a in axes))
        for axes in sorted(axis_sets)
    )
    memory = estimate_memory(graph, mesh=mesh, dtype=dtype, dtype_bytes=dtype_bytes, zero=zero, pipeline=pipeline,
                             recompute=recompute, buckets=buckets, overlap=overlap, memo=memo)
    notes = zero_notes(graph, mesh, zero) + recompute_notes(graph, recompute)
    time = None if hardware is None else estimate_time(
        graph, mesh=mesh, dtype=dtype, dtype_bytes=dtype_bytes, zero=zero, overlap=overlap, buckets=buckets,
        pipeline=pipeline, recompute=recompute, hardware=hardware, memo=memo)
    return ExecutionPlan(PLAN_VERSION, graph, mesh, sequence_parallel, dtype, groups, collectives, memory,
                         zero, overlap, bucket_bytes, buckets, pipeline, notes, recompute, time)


def gradient_buckets(graph: Graph, mesh: Mesh, *, dtype_bytes: int, zero: int, bucket_bytes: int,
                     pipeline: PipelineSpec | None, memo: Memo) -> tuple[Bucket, ...]:
    """The plan's gradient buckets (none for ZeRO-3 alone, which reduces per use)."""
    if zero == 3 and pipeline is None:
        return ()
    cuts = chunk_starts(graph, pipeline)
    return memo.get(("buckets", dtype_bytes, zero, bucket_bytes, cuts), lambda: plan_buckets(
        graph, mesh, param_bytes=lambda p: sync_bytes(graph, mesh, p, dtype_bytes, zero), bucket_bytes=bucket_bytes,
        cuts=cuts))


def qualified(name: str, repeat: Repeat | None) -> str:
    return f"{repeat.name}.*.{name}" if repeat else name


def gather_collectives(graph: Graph, *, dtype_bytes: int, mesh: Mesh, zero: int = 0, overlap: bool = True,
                       buckets: tuple[Bucket, ...] = ()) -> tuple[Collective, ...]:
    found: list[Collective] = []
    for node, repeat in walk_ops(graph.body):
        if isinstance(node, Redistribute):  # counts already include the repeat
            found.extend(c for c in node.forward + node.backward if c.kind != CollectiveKind.SLICE)
        elif isinstance(node, Op):
            layers = repeat.count if repeat else 1
            found.extend(replace(c, count=c.count * layers) for c in node.collectives)
    found.extend(param_sync_collectives(graph, mesh, dtype_bytes=dtype_bytes, zero=zero, overlap=overlap,
                                        buckets=buckets))
    return tuple(found)


def recompute_notes(graph: Graph, recompute: str) -> tuple[str, ...]:
    """A recompute mode that recomputes nothing in this model, said once."""
    if recompute != "none" and recomputed_regions(graph, recompute) == (0, 0):
        return (f"recompute {recompute} changes nothing: the model has no attention op and no layer stack "
                "(repeat) it recomputes",)
    return ()
