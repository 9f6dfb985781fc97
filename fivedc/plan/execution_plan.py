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
from fivedc.estimates.memory import MemoryEstimate
from fivedc.estimates.step_time import TimeEstimate
from fivedc.ir.graph import Collective, CollectiveKind, Graph, Op, Repeat, Redistribute, walk_ops
from fivedc.ir.mesh import Mesh, MeshAxis
from fivedc.ir.aten_allow import refuse_unlisted
from fivedc.ir.limits import MAX_JSON_DEPTH, json_depth
from fivedc.ir.serialize import decode, encode
from fivedc.passes.overlap import Bucket
from fivedc.passes.param_sync import DEFAULT_BUCKET_BYTES
from fivedc.passes.stages import PipelineSpec

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
    buckets: tuple[Bucket, ...] = ()  # gradient buckets in launch order (passes/overlap.py)
    pipeline: PipelineSpec | None = None  # pp > 1: chunks, schedule, microbatches (passes/stages.py)
    notes: tuple[str, ...] = ()  # warnings for the reader, e.g. a setting that changes nothing
    recompute: str = "none"  # activation recomputation: none, selective (attention), full (each layer)
    time: TimeEstimate | None = None  # seconds per step on a GPU (compile --gpu; fivedc/estimates/step_time.py)
    fp8: bool = False  # --fp8: the linears the graph marks run in float8 (passes/fp8.py)

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
        except RecursionError:  # nested deeper than Python's stack: no plan is
            raise PlanError(f"{path} is not a fivedc plan: its JSON nests deeper than {MAX_JSON_DEPTH} levels",
                            hint="give the .json file that fivedc compile -o wrote") from None
        return ExecutionPlan.from_json(data, source=str(path))

    @staticmethod
    def from_json(data: object, *, source: str = "<plan>") -> ExecutionPlan:
        if not isinstance(data, dict) or "version" not in data:
            raise PlanError(f"{source} is not a fivedc plan (no version field)")
        if json_depth(data) > MAX_JSON_DEPTH:  # before decoding it recursively
            raise PlanError(f"{source} is not a fivedc plan: its JSON nests deeper than {MAX_JSON_DEPTH} levels",
                            hint="give the .json file that fivedc compile -o wrote")
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
            plan = decode(ExecutionPlan, data)
        except PlanError as error:
            raise PlanError(f"{source} is not a valid version {PLAN_VERSION} plan: {error.message}",
                            hint="recompile the model rather than editing the plan") from None
        except FivedcError as error:  # a field's own check, e.g. a sharding that does not parse
            raise PlanError(f"{source} is not a valid version {PLAN_VERSION} plan: {error.message}") from None
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise PlanError(f"{source} is not a valid version {PLAN_VERSION} plan: {type(error).__name__}: {error}") from None
        refuse_unlisted(plan.graph, source=source)  # before anything calls an operator the plan names
        return plan


def groups_of(mesh: Mesh, collectives: tuple[Collective, ...]) -> tuple[GroupInfo, ...]:
    """The process groups a plan uses: each axis > 1, and every axis set a collective runs over."""
    axis_sets = {(a,) for a in mesh.rank_order if mesh.size(a) > 1} | {c.axes for c in collectives}
    return tuple(GroupInfo(axes, mesh.size(*axes), mesh.group_count(axes), tuple(mesh.stride(a) for a in axes))
                 for axes in sorted(axis_sets))


def qualified(name: str, repeat: Repeat | None) -> str:
    return f"{repeat.name}.*.{name}" if repeat else name


def graph_collectives(graph: Graph) -> tuple[Collective, ...]:
    """The collectives the compiled graph itself holds: its redistributions' and its ops'
    own (vocab-parallel cross-entropy, ring attention, MoE), counted over a repeat's layers."""
    found: list[Collective] = []
    for node, repeat in walk_ops(graph.body):
        if isinstance(node, Redistribute):  # counts already include the repeat
            found.extend(c for c in node.forward + node.backward if c.kind != CollectiveKind.SLICE)
        elif isinstance(node, Op):
            layers = repeat.count if repeat else 1
            found.extend(replace(c, count=c.count * layers) for c in node.collectives)
    return tuple(found)
