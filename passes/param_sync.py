"""The plan's parameter collectives: gradient sync per bucket, and ZeRO's gathers.

A parameter whose gradient is partial over some axes (`Param.grad_partial`) needs
its gradient summed over them. Per ZeRO stage (`runtime/zero.py` runs exactly this):

    stage  gradient sum                       parameter gathers
    0      all-reduce per bucket (grad_sync)  -
    1      reduce-scatter per bucket, after   all-gather per bucket after the step (optimizer)
           backward (full gradients kept)
    2      reduce-scatter per bucket          all-gather per bucket after the step (optimizer)
    3      reduce-scatter per bucket, once    all-gather per bucket at the first read of any of
           its last gradient is computed      its parameters (forward), and again in backward
           (backward)                         (FSDP2's per-module groups: the buckets)
    3, pp  reduce-scatter per bucket, after    all-gather per bucket once per step (forward), kept
           the last microbatch (grad_sync)    across the microbatches

ZeRO-1 and ZeRO-2 move 2Ψ per step (Ψ: the parameters' bytes): a reduce-scatter and an
all-gather, as the ZeRO paper has it, not an all-reduce (2Ψ) and then the gather.
Each collective says what compute it overlaps with (`Collective.overlaps`).
"""

from __future__ import annotations

from fivedc.ir.graph import Collective, CollectiveKind, Graph, Param, Phase, walk_params
from fivedc.ir.mesh import Mesh, MeshAxis
from fivedc.passes.overlap import Bucket
from fivedc.passes.base import DEFAULT_BUCKET_MB

K = CollectiveKind
DEFAULT_BUCKET_BYTES = int(DEFAULT_BUCKET_MB * 2**20)


def zero_chunk(graph: Graph, mesh: Mesh, param: Param) -> int:
    """Elements of a parameter's local tensor one rank owns under ZeRO (the last chunk padded)."""
    local = graph.local_numel(param.dims, param.sharding, mesh)
    return -(-local // mesh.size(*param.grad_partial))


def sync_bytes(graph: Graph, mesh: Mesh, param: Param, dtype_bytes: int, zero: int) -> int:
    """Bytes of one parameter's gradient as its sum moves (padded to whole chunks under ZeRO)."""
    n = mesh.size(*param.grad_partial)
    elements = zero_chunk(graph, mesh, param) * n if zero else graph.local_numel(param.dims, param.sharding, mesh)
    return elements * dtype_bytes


def zero_notes(graph: Graph, mesh: Mesh, zero: int) -> tuple[str, ...]:
    notes = []
    if zero and not any(mesh.size(*p.grad_partial) > 1 for p, _ in walk_params(graph.body)):
        notes.append(
            f"ZeRO-{zero} shards over each parameter's data-parallel group (the ranks that hold the "
            "same replica), and every such group here has one rank: it changes nothing"
        )
    if zero == 3 and mesh.size(MeshAxis.PP) > 1:
        notes.append(
            "ZeRO-3 under a pipeline keeps each parameter gathered across the microbatches of a step "
            "(gathered once, its gradient reduce-scattered after the last microbatch): during the step "
            "a rank holds its chunks' whole parameters, so ZeRO-3 saves memory only between steps"
        )
    return tuple(notes)


def sum_collectives(buckets: tuple[Bucket, ...], mesh: Mesh, *, zero: int, overlap: bool,
                    pipelined: bool) -> list[Collective]:
    """Per gradient bucket: its sum (all-reduce, or ZeRO's reduce-scatter)."""
    return [_bucket_collective(b, mesh, zero, overlap, pipelined) for b in buckets]


def zero_gathers(buckets: tuple[Bucket, ...], mesh: Mesh, *, zero: int, overlap: bool,
                 pipelined: bool) -> list[Collective]:
    """ZeRO's gathers, by the same buckets: ZeRO-1/2 after the update; ZeRO-3 under a
    pipeline once per step; ZeRO-3 alone per group (a bucket) in forward and again in
    backward, as FSDP2 gathers per module."""
    if zero in (1, 2) or (zero == 3 and pipelined):
        return [_bucket_gather(b, mesh, zero) for b in buckets]
    if zero != 3:
        return []
    out = []
    for b in buckets:
        n, what = mesh.size(*b.axes), f"bucket {b.index}: {', '.join(b.params)}"
        out += [Collective(K.ALL_GATHER, b.axes, Phase.FORWARD, what, b.bytes,
                           f"ZeRO-3: these parameters rest in 1/{n} chunks; gather them as one group at the first "
                           "read of any, keep them while their layer runs", count=b.count,
                           overlaps="the previous group's compute (prefetched one group ahead)" if overlap else ""),
                Collective(K.ALL_GATHER, b.axes, Phase.BACKWARD, what, b.bytes,
                           "ZeRO-3: gather the group again for its backward (autograd did not keep it)",
                           count=b.count)]
    return out


def _bucket_collective(bucket: Bucket, mesh: Mesh, zero: int, overlap: bool, pipelined: bool) -> Collective:
    group = "*".join(bucket.axes)
    n = mesh.size(*bucket.axes)
    why = f"the parameters are replicated over {group} while their ops split the work over {group}: sum the gradients"
    if zero >= 1:
        kind, why = K.REDUCE_SCATTER, why + f"; ZeRO-{zero} keeps only this rank's 1/{n} chunk of each"
    else:
        kind = K.ALL_REDUCE
    where = "the layer" if bucket.count > 1 else "the step"
    if zero == 3 and not pipelined:  # inside backward, once the group's last gradient is computed
        return Collective(kind, bucket.axes, Phase.BACKWARD, f"bucket {bucket.index}: {', '.join(bucket.params)}",
                          bucket.bytes, why + " (one reduce-scatter per group, when its last gradient is computed)",
                          count=bucket.count)
    overlaps = (
        f"backward of what ran before it in {where} (starts when its last gradient is ready)"
        if overlap and zero != 1 else "nothing (after backward: ZeRO-1 keeps the full gradients until then)"
        if overlap else "nothing (after backward: overlap is off)"
    )
    return Collective(kind, bucket.axes, Phase.GRAD_SYNC, f"bucket {bucket.index}: {', '.join(bucket.params)}",
                      bucket.bytes, why, count=bucket.count, overlaps=overlaps)


def _bucket_gather(bucket: Bucket, mesh: Mesh, zero: int) -> Collective:
    n, what = mesh.size(*bucket.axes), f"bucket {bucket.index}: {', '.join(bucket.params)}"
    if zero == 3:  # under a pipeline (runtime/zero.py keep_gathered)
        return Collective(K.ALL_GATHER, bucket.axes, Phase.FORWARD, what, bucket.bytes,
                          f"ZeRO-3 under a pipeline: these parameters rest in 1/{n} chunks; gather them once per "
                          "step and keep them across the microbatches", count=bucket.count,
                          overlaps="nothing (before the step's first microbatch)")
    return Collective(K.ALL_GATHER, bucket.axes, Phase.OPTIMIZER, what, bucket.bytes,
                      f"ZeRO-{zero}: each rank updated its 1/{n} chunk of these parameters; gather them",
                      count=bucket.count, overlaps="nothing (after the optimizer step)")


def tied_sync_collectives(graph: Graph, mesh: Mesh, groups, dtype_bytes: int) -> list[Collective]:
    """Per group of tied parameters (`passes/tied.py`): after the last microbatch's
    backward, before the gradient sync, the pp ranks that hold them sum their gradients of
    the parameters' uses on their chunks (their local tensors, one flat buffer)."""
    out = []
    params = {p.name: p for p in graph.body.params}
    for group in groups:
        nbytes = sum(graph.local_numel(params[n].dims, params[n].sharding, mesh) for n in group.names) * dtype_bytes
        ranks = ", ".join(map(str, group.pp_ranks))
        loc = next((params[n].loc for n in group.names if params[n].loc is not None), None)
        out.append(Collective(
            K.ALL_REDUCE, (MeshAxis.PP,), Phase.GRAD_SYNC, f"tied {', '.join(group.names)} (pp ranks {ranks})",
            nbytes, f"tied weights: pipeline chunks on pp ranks {ranks} each use and hold a copy of "
            f"{', '.join(group.names)}; each copy's gradient has only its own uses: sum them over the pp ranks "
            "that hold it (a group of those ranks for each coordinate of the other axes), so the copies take the "
            "same update", loc=loc,
            overlaps="nothing (after the last microbatch's backward, before the gradient sync)"))
    return out


def copy_sync_collectives(graph: Graph, mesh: Mesh, pipeline, dtype_bytes: int, zero: int,
                          tied: frozenset[str] = frozenset()) -> list[Collective]:
    """DualPipe keeps two copies of the model: pp ranks r and p-1-r hold the same chunks
    (one of each copy), each copy sees half the microbatches, so after the gradient sync
    the two exchange their summed gradients (the chunk ZeRO keeps) and add them; but the
    `tied` parameters, which more ranks hold and which are summed over all of them before."""
    if pipeline is None or pipeline.kind.pipelines == 1:
        return []
    from fivedc.passes.held_params import held_params, param_count

    p, out = mesh.size(MeshAxis.PP), []
    for r in range(p // 2):
        held = held_params(graph, pipeline, pp_rank=r)
        nbytes = 0
        for param, repeat in walk_params(graph.body):
            tied_here = repeat is None and param.name in tied  # summed over all its holders before
            n = 0 if tied_here else param_count(held, param.name, repeat)
            each = zero_chunk(graph, mesh, param) if zero else graph.local_numel(param.dims, param.sharding, mesh)
            nbytes += each * n * dtype_bytes
        out.append(Collective(
            K.SEND_RECV, (MeshAxis.PP,), Phase.GRAD_SYNC, f"gradients of pp ranks {r} and {p - 1 - r}", nbytes,
            f"DualPipe: pp ranks {r} and {p - 1 - r} hold the two copies of the same chunks, each copy saw half "
            "the microbatches: they exchange their summed gradients and add them (an all-reduce of two), so both "
            "copies update alike", overlaps="nothing (after the gradient sync)"))
    return out

