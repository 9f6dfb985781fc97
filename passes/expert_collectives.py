"""The plan's collectives of one moe op: the all-to-alls over ep, and the balancing and capacity counts.

Called by the op's sharding rule (`passes/rules.py`), like ring attention's hops,
so they sit on the op and the plan multiplies them by the layers. Per execution:

    forward   all-to-all   ep        token counts (E x 8 B): the uneven splits
    forward   all-to-all   ep        dispatch: T x top_k x hidden x bytes per rank
    forward   all-to-all   ep        combine: the same back
    backward  all-to-all   ep        the combine's and the dispatch's gradients
    forward   all-reduce   dp*ep*cp  tokens per expert (E x 8 B), for the aux loss or the bias update
    forward   all-reduce   cp        capacity: per-chunk counts of each sequence (under cp only)

T is this rank's tokens (the batch over dp and ep, the sequence over cp); each tp
rank sends the same tokens (tp splits the experts' ffn). With
`@ep(hierarchical, R)` every token all-to-all is listed twice, intra-node then
inter-node, each with its group and wire fraction: an ep group whose rank stride
is s spans nodes of R ranks with g = R / s ep ranks per node (1 when s >= R) and
n = ep / g nodes; level 1 moves all T x k rows among the g, (g-1)/g on the wire,
level 2 among the n, (n-1)/n.
"""

from __future__ import annotations

from fivedc.errors import NotSupportedError
from fivedc.ir.graph import Collective, CollectiveKind, Op, Phase, TensorType
from fivedc.ir.mesh import Mesh, MeshAxis
from fivedc.ir.seq_layout import chunks_per_rank
from fivedc.ir.sharding import Sharding
from fivedc.passes.experts import ExpertLayout, MoeSettings, node_levels, token_axes
from fivedc.passes.layout import RuleContext

COUNT_BYTES = 8  # token counts travel as int64
K = CollectiveKind


def moe_collectives(ctx: RuleContext, op: Op, x: Sharding, types: list) -> tuple[Collective, ...]:
    """Per execution (the plan multiplies by the layers): the all-to-alls over ep, the
    count all-reduce of the balancing losses, and capacity's exchange over cp."""
    mesh, graph, s = ctx.mesh, ctx.graph, MoeSettings.of(op)
    x_t: TensorType = types[0]
    experts = graph.dim(types[1].dims[1])
    tokens = graph.local_numel(x_t.dims[:-1], x, mesh)
    out: list[Collective] = []
    if mesh.size(MeshAxis.EP) > 1:
        layout = ExpertLayout.of(op, experts, mesh.size(MeshAxis.EP))
        out += _all_to_alls(ctx, op, layout, tokens, graph.dim(x_t.dims[-1]), experts, s)
    axes = token_axes(mesh)
    if axes and (s.aux_loss or s.bias_update or s.count_state):
        uses = " and ".join(w for w, on in (("the auxiliary loss", s.aux_loss), ("the bias update", s.bias_update),
                                            (f"the state {s.count_state}", s.count_state)) if on)
        out.append(Collective(
            K.ALL_REDUCE, axes, Phase.FORWARD, op.out, experts * COUNT_BYTES,
            f"tokens per expert over the whole batch for {uses} ({experts} counts): each rank routed only "
            "its own tokens", loc=op.loc))
    if s.capacity_factor is not None and MeshAxis.CP in x.axes_of(graph.seq_dim or ""):
        if x_t.dims[1] != graph.seq_dim:
            raise NotSupportedError(f"moe: a capacity factor under cp needs x as [batch, {graph.seq_dim}, ...], "
                                    f"got [{', '.join(x_t.dims)}]", loc=op.loc, hint="use cp=1, or no capacity factor")
        chunks = mesh.size(MeshAxis.CP) * chunks_per_rank(graph.seq_layout)
        rows = graph.local_size(x_t.dims[0], x, mesh)
        out.append(Collective(
            K.ALL_REDUCE, (MeshAxis.CP,), Phase.FORWARD, op.out, rows * s.top_k * chunks * experts * COUNT_BYTES,
            f"capacity: per sequence, how many assignments each of its {chunks} chunks gives each expert, so "
            "every cp rank drops by the same order (choice, then position)", loc=op.loc))
    return tuple(out)


def _all_to_alls(ctx: RuleContext, op: Op, layout: ExpertLayout, tokens: int, hidden: int, experts: int,
                 s: MoeSettings) -> list[Collective]:
    mesh, k = ctx.mesh, s.top_k
    ep = mesh.size(MeshAxis.EP)
    rows = tokens * k * hidden * ctx.dtype_bytes
    size = f"{tokens} tokens x top_k {k} x hidden {hidden} x {ctx.dtype_bytes} B"
    bound = (f"at most, capacity factor {s.capacity_factor:g}: dropped tokens stay home" if s.capacity_factor
             else "dropless: the exact size follows the routing")
    shared = f"; each of the {mesh.size(MeshAxis.TP)} tp ranks sends the same tokens (tp splits the experts' ffn)" \
        if ctx.tp else ""
    levels = _levels(mesh, layout)

    def a2a(phase: Phase, tensor: str, nbytes: int, what: str) -> list[Collective]:
        return [Collective(K.ALL_TO_ALL, (MeshAxis.EP,), phase, tensor, nbytes, what + level, loc=op.loc)
                for level in levels]

    x_name, placed = str(op.args[0]), _placement_text(layout, experts, ep)
    return [
        *a2a(Phase.FORWARD, op.out, experts * COUNT_BYTES,
             f"expert parallelism: exchange how many tokens each rank sends to each expert ({experts} counts); "
             "they size the uneven splits of the dispatch and the combine"),
        *a2a(Phase.FORWARD, x_name, rows,
             f"dispatch: each token to the ep ranks holding its top-{k} experts ({placed}); {size}, of which "
             f"{ep - 1}/{ep} leaves the rank under balanced routing ({bound}){shared}"),
        *a2a(Phase.FORWARD, op.out, rows,
             "combine: the expert outputs back to their tokens' ranks (the dispatch's splits reversed), "
             "summed there with the gate weights"),
        *a2a(Phase.BACKWARD, op.out, rows, "combine's gradient: the output gradient to the ranks holding the experts"),
        *a2a(Phase.BACKWARD, x_name, rows, "dispatch's gradient: the token gradients back to their ranks"),
    ]


def _levels(mesh: Mesh, layout: ExpertLayout) -> list[str]:
    """The reason's tail per level: one flat all-to-all, or intra-node then inter-node."""
    ep = mesh.size(MeshAxis.EP)
    if layout.all_to_all == "flat":
        return [f" [flat over the {ep} ep ranks: wire bytes (ep-1)/ep = {ep - 1}/{ep}]"]
    per_node, nodes = node_levels(mesh, layout.node_ranks)
    return [
        f" [hierarchical 1/2, intra-node ({layout.node_ranks} ranks per node): among the {per_node} ep ranks "
        f"of a node, to the one with the destination's local index; wire bytes {per_node - 1}/{per_node}]",
        f" [hierarchical 2/2, inter-node: among the {nodes} nodes' ranks with the same local index; "
        f"wire bytes {nodes - 1}/{nodes}]",
    ]


def _placement_text(layout: ExpertLayout, experts: int, ep: int) -> str:
    per_rank = experts // ep
    if layout.placement == "contiguous":
        return f"contiguous: ep rank r holds experts {per_rank}r..{per_rank}r+{per_rank - 1}"
    if layout.placement == "strided":
        return f"strided: ep rank r holds experts r, r+{ep}, ..."
    return "placed as @ep(" + ",".join(map(str, layout.owners)) + ")"
