"""The plan's parameter collectives: gradient sync per bucket, and ZeRO's gathers.

A parameter whose gradient is partial over some axes (`Param.grad_partial`) needs
its gradient summed over them. Per ZeRO stage (`fivedc/runtime/zero.py` runs exactly this):

    stage  gradient sum                       parameter gathers
    0      all-reduce per bucket (grad_sync)  -
    1      reduce-scatter per bucket, after   all-gather per bucket after the step (optimizer)
           backward (full gradients kept)
    2      reduce-scatter per bucket          all-gather per bucket after the step (optimizer)
    3      reduce-scatter per use (backward)  all-gather before each use, forward and backward
    3, pp  reduce-scatter per bucket, after    all-gather per bucket once per step (forward), kept
           the last microbatch (grad_sync)    across the microbatches

ZeRO-1 and ZeRO-2 move 2Ψ per step (Ψ: the parameters' bytes): a reduce-scatter and an
all-gather, as the ZeRO paper has it, not an all-reduce (2Ψ) and then the gather.
Each collective says what compute it overlaps with (`Collective.overlaps`).
"""

from __future__ import annotations

from fivedc.ir.graph import Collective, CollectiveKind, Graph, Op, Param, Phase, walk_ops, walk_params
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


def param_sync_collectives(graph: Graph, mesh: Mesh, *, dtype_bytes: int, zero: int, overlap: bool,
                           buckets: tuple[Bucket, ...]) -> list[Collective]:
    out = [_bucket_collective(b, mesh, zero, overlap) for b in buckets]
    if zero in (1, 2) or (zero == 3 and buckets):  # the gathers go by the same buckets (flat_shard.gather_flat)
        return out + [_bucket_gather(b, mesh, zero) for b in buckets]
    uses = _param_uses(graph)
    for param, repeat in walk_params(graph.body):
        if mesh.size(*param.grad_partial) > 1 and zero:
            out.extend(_zero_collectives(graph, mesh, param, repeat, dtype_bytes, zero, overlap, uses[param.name]))
    return out


def _bucket_collective(bucket: Bucket, mesh: Mesh, zero: int, overlap: bool) -> Collective:
    group = "*".join(bucket.axes)
    n = mesh.size(*bucket.axes)
    why = f"the parameters are replicated over {group} while their ops split the work over {group}: sum the gradients"
    if zero >= 1:
        kind, why = K.REDUCE_SCATTER, why + f"; ZeRO-{zero} keeps only this rank's 1/{n} chunk of each"
    else:
        kind = K.ALL_REDUCE
    where = "the layer" if bucket.count > 1 else "the step"
    overlaps = (
        f"backward of what ran before it in {where} (starts when its last gradient is ready)"
        if overlap and zero != 1 else "nothing (after backward: ZeRO-1 keeps the full gradients until then)"
        if overlap else "nothing (after backward: overlap is off)"
    )
    return Collective(kind, bucket.axes, Phase.GRAD_SYNC, f"bucket {bucket.index}: {', '.join(bucket.params)}",
                      bucket.bytes, why, count=bucket.count, overlaps=overlaps)


def _bucket_gather(bucket: Bucket, mesh: Mesh, zero: int) -> Collective:
    n, what = mesh.size(*bucket.axes), f"bucket {bucket.index}: {', '.join(bucket.params)}"
    if zero == 3:  # under a pipeline (fivedc/runtime/zero.py keep_gathered)
        return Collective(K.ALL_GATHER, bucket.axes, Phase.FORWARD, what, bucket.bytes,
                          f"ZeRO-3 under a pipeline: these parameters rest in 1/{n} chunks; gather them once per "
                          "step and keep them across the microbatches", count=bucket.count,
                          overlaps="nothing (before the step's first microbatch)")
    return Collective(K.ALL_GATHER, bucket.axes, Phase.OPTIMIZER, what, bucket.bytes,
                      f"ZeRO-{zero}: each rank updated its 1/{n} chunk of these parameters; gather them",
                      count=bucket.count, overlaps="nothing (after the optimizer step)")


def _param_uses(graph: Graph) -> dict[str, int]:
    """How many ops read each parameter name (per layer for a repeat body's own)."""
    uses: dict[str, int] = {}
    for node, _ in walk_ops(graph.body):
        if isinstance(node, Op):
            for arg in node.args:
                if isinstance(arg, str):
                    uses[arg] = uses.get(arg, 0) + 1
    return uses


def _zero_collectives(graph, mesh, param, repeat, dtype_bytes: int, zero: int, overlap: bool,
                      uses: int) -> list[Collective]:
    """ZeRO-3's per-parameter collectives: the gathers and the gradient's reduce-scatter."""
    axes, layers = param.grad_partial, (repeat.count if repeat else 1)
    n = mesh.size(*axes)
    nbytes = sync_bytes(graph, mesh, param, dtype_bytes, zero)
    name = f"{repeat.name}.*.{param.name}" if repeat else param.name

    def make(kind: K, phase: Phase, reason: str, count: int, overlaps: str = "") -> Collective:
        return Collective(kind, axes, phase, name, nbytes, reason, count=count, loc=param.loc, overlaps=overlaps)

    group = "*".join(axes)
    summed = f"{param.name} is replicated over {group} while its ops split the work over {group}: sum its gradient"
    prefetch = "the compute of the previous use (prefetched one use ahead)" if overlap else ""
    return [
        make(K.ALL_GATHER, Phase.FORWARD,
             f"ZeRO-3: {param.name} rests in 1/{n} chunks; gather it before each use, free it after",
             uses * layers, prefetch),
        make(K.ALL_GATHER, Phase.BACKWARD,
             f"ZeRO-3: gather {param.name} again for the backward of each use (not kept from forward)", uses * layers),
        make(K.REDUCE_SCATTER, Phase.BACKWARD, f"{summed}; ZeRO-3 keeps only this rank's 1/{n} chunk", uses * layers),
    ]


def copy_sync_collectives(graph: Graph, mesh: Mesh, pipeline, dtype_bytes: int, zero: int) -> list[Collective]:
    """DualPipe keeps two copies of the model: pp ranks r and p-1-r hold the same chunks
    (one of each copy), each copy sees half the microbatches, so after the gradient sync
    the two exchange their summed gradients (the chunk ZeRO keeps) and add them."""
    if pipeline is None or pipeline.schedule != "dualpipe":
        return []
    from fivedc.passes.stages import chunk_param_names

    p, out = mesh.size(MeshAxis.PP), []
    for r in range(p // 2):
        local = chunk_param_names(graph, pipeline, pp_rank=r)
        nbytes = 0
        for param, repeat in walk_params(graph.body):
            n = (param.name in local) if repeat is None else sum(f"{repeat.name}.{i}.{param.name}" in local
                                                                  for i in range(repeat.count))
            each = zero_chunk(graph, mesh, param) if zero else graph.local_numel(param.dims, param.sharding, mesh)
            nbytes += each * n * dtype_bytes
        out.append(Collective(
            K.SEND_RECV, (MeshAxis.PP,), Phase.GRAD_SYNC, f"gradients of pp ranks {r} and {p - 1 - r}", nbytes,
            f"DualPipe: pp ranks {r} and {p - 1 - r} hold the two copies of the same chunks, each copy saw half "
            "the microbatches: they exchange their summed gradients and add them (an all-reduce of two), so both "
            "copies update alike", overlaps="nothing (after the gradient sync)"))
    return out

