"""Expert parallelism: which ep rank holds each expert, and the all-to-alls that move tokens there.

A `moe` op (semantics in `fivedc/ir/ops.py`) sends every token to its top-k experts.
Under expert parallelism the tokens stay split as for every other layer (batch
over dp and ep, sequence over cp) while ep also splits the experts into equal
blocks, one per ep rank. So the tokens travel to their experts and back, within
the ep group of each (dp, tp, cp) coordinate:

    counts    all-to-all of how many tokens go to each (ep rank, expert): the uneven splits
    dispatch  all-to-all of the token rows: T x top_k x hidden, (ep-1)/ep of it leaves the rank
    combine   the reverse all-to-all of the expert outputs, summed with the gate weights at home
    backward  the two token all-to-alls again, in the other direction

This pass runs before sharding propagation. It checks every MoE op (each message
quotes the numbers and the fix: experts divisible by ep, a capacity factor > 0
when given, a known score, non-negative balancing coefficients, a valid `@ep`) and
writes the resolved layout on the op as its `@ep(...)`: the op's own annotation,
then the model's, then contiguous blocks and a flat all-to-all. The sharding rule
(`passes/rules.py`) splits the expert weights' experts dim over ep and their ffn
dim over tp, and lists the op's collectives (`passes/expert_collectives.py`); the
runtime (`runtime/moe.py`) reads the same `MoeSettings` and `ExpertLayout`.

`@ep(...)` takes, in any order: a placement, `contiguous` (expert e on ep rank
e // (E/ep), the default), `strided` (e on rank e % ep) or one ep rank per expert
(`@ep(0, 1, 1, 0)`, each rank E/ep experts); and `flat` (the default) or
`hierarchical`, optionally followed by the ranks per node (default 8): tokens
first move inside the node to the rank with the destination's local index, then
between nodes among ranks with the same local index; the plan lists both levels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

from fivedc.errors import DslError, NotSupportedError, ShapeError, ShardingError
from fivedc.ir.graph import Annotation, Block, Graph, Op, Repeat
from fivedc.ir.mesh import Mesh, MeshAxis
from fivedc.passes.base import CompileOptions
from fivedc.passes.layout import divisors

SCORES = ("softmax", "sigmoid")
PLACEMENTS = ("contiguous", "strided")
ALL_TO_ALL = ("flat", "hierarchical")
NODE_RANKS = 8  # ranks per node for @ep(hierarchical) when not given: one 8-GPU server


@dataclass(frozen=True, slots=True)
class MoeSettings:
    """A moe op's attributes, read once (`capacity_factor` None: dropless)."""

    top_k: int
    score: str
    capacity_factor: float | None
    aux_loss: float
    bias_update: float
    normalize: bool
    swiglu: bool
    bias_state: str = ""  # a state [experts] added to the scores in the choice (fivedc/ir/states.py)
    count_state: str = ""  # a state [experts] that gains the whole batch's tokens per expert

    @staticmethod
    def of(op: Op) -> MoeSettings:
        given = dict(op.attrs)
        factor = given.get("capacity_factor")
        return MoeSettings(
            top_k=int(op.attr("top_k", 2)), score=str(op.attr("score", "softmax")),
            capacity_factor=None if factor is None else float(factor),
            aux_loss=float(op.attr("aux_loss", 0.0)), bias_update=float(op.attr("bias_update", 0.0)),
            normalize=bool(op.attr("normalize", True)), swiglu=len(op.args) == 5,
            bias_state=str(op.attr("bias_state", "")), count_state=str(op.attr("count_state", "")),
        )

    def capacity(self, group_tokens: int, experts: int) -> int:
        """Assignments each expert keeps per group (one batch row): ceil(factor x tokens x k / E)."""
        return math.ceil(self.capacity_factor * group_tokens * self.top_k / experts)


@dataclass(frozen=True, slots=True)
class ExpertLayout:
    """Where the experts of one op live, and how tokens reach them."""

    placement: str  # contiguous | strided | explicit
    owners: tuple[int, ...]  # the ep rank of each expert
    all_to_all: str = "flat"  # flat | hierarchical
    node_ranks: int = NODE_RANKS

    @property
    def annotation(self) -> Annotation:
        what = self.placement if self.placement != "explicit" else ",".join(map(str, self.owners))
        tail = (self.node_ranks,) if self.all_to_all == "hierarchical" else ()
        return Annotation("ep", (what, self.all_to_all) + tail)

    def local_experts(self, rank: int) -> tuple[int, ...]:
        """The experts ep rank `rank` holds, in the order it stores them."""
        return tuple(e for e, owner in enumerate(self.owners) if owner == rank)

    @staticmethod
    def of(op: Op, experts: int, ep: int) -> ExpertLayout:
        """The layout this pass wrote on `op` (contiguous and flat when it has none)."""
        annotation = op.annotation("ep")
        found = _parse(annotation, experts, ep, op) if annotation else {}
        return _layout(found, experts, ep)


def token_axes(mesh: Mesh) -> tuple[MeshAxis, ...]:
    """The axes that split a moe op's tokens: the data axes and cp (tp ranks share tokens)."""
    return tuple(a for a in (MeshAxis.DP, MeshAxis.EP, MeshAxis.CP) if mesh.size(a) > 1)


def node_levels(mesh: Mesh, node_ranks: int, loc=None) -> tuple[int, int]:
    """(ep ranks per node, nodes) that one ep group spans, with `node_ranks` ranks per node."""
    stride, ep = mesh.stride(MeshAxis.EP), mesh.size(MeshAxis.EP)
    if stride >= node_ranks:
        per_node = 1 if stride % node_ranks == 0 else 0
    else:
        per_node = min(ep, node_ranks // stride) if node_ranks % stride == 0 else 0
    if per_node == 0 or ep % per_node:
        raise ShardingError(
            f"@ep(hierarchical, {node_ranks}): an ep group (ep={ep}, rank stride {stride}) does not split "
            f"evenly into nodes of {node_ranks} ranks",
            loc=loc, hint="give the ranks per node as a multiple or divisor of the ep stride, e.g. "
                          f"@ep(hierarchical, {max(stride, 1) * min(ep, 2)})",
        )
    return per_node, ep // per_node


@dataclass(frozen=True, slots=True)
class PlaceExperts:
    name: ClassVar[str] = "place-experts"
    purpose: ClassVar[str] = "EP: check each MoE op and place its experts and all-to-all over ep"

    def run(self, graph: Graph, options: CompileOptions) -> Graph:
        model = graph.annotation("ep")
        if model and any(_is_int(a) or (isinstance(a, str) and _owner_text(a)) for a in model.args):
            raise ShardingError(f"{model} on the model: a list of ep ranks places one moe call's experts",
                                loc=model.loc, hint="put @ep(0, 1, ...) on the moe call; the model takes "
                                                    "@ep(contiguous|strided|flat|hierarchical[, ranks per node])")
        return replace(graph, body=_block(graph, graph.body, options.mesh, model, {}))


def _block(graph: Graph, block: Block, mesh: Mesh, model: Annotation | None, outer: dict) -> Block:
    params = {**outer, **{p.name: p.dims for p in block.params}}
    items = []
    for item in block.items:
        if isinstance(item, Repeat):
            items.append(replace(item, body=_block(graph, item.body, mesh, model, params)))
        elif isinstance(item, Op) and item.kind == "moe":
            experts_dim = params[item.args[1]][1] if item.args[1] in params else "experts"
            items.append(_place(item, mesh, model, experts_dim, graph.dim(experts_dim)))
        elif isinstance(item, Op) and item.annotation("ep"):
            raise ShardingError(f"@ep places the experts of a moe call, but this op is {item.kind}",
                                loc=item.annotation("ep").loc or item.loc, hint="put @ep(...) on a moe call")
        else:
            items.append(item)
    return replace(block, items=tuple(items))


def _place(op: Op, mesh: Mesh, model: Annotation | None, experts_dim: str, experts: int) -> Op:
    _check_settings(op)
    if MoeSettings.of(op).aux_loss and mesh.size(MeshAxis.PP) > 1:
        raise NotSupportedError(
            f"moe: aux_loss under pipeline parallelism (pp={mesh.size(MeshAxis.PP)}): the Switch loss is a "
            "statistic of the whole batch, and each pipeline microbatch holds only part of it",
            loc=op.loc, hint="balance with bias_update=0.001 (summed over microbatches), or compile with pp=1",
        )
    ep = mesh.size(MeshAxis.EP)
    if experts % ep:
        choices = ", ".join(str(d) for d in divisors(experts) if d <= 64)
        raise ShapeError(
            f"moe: {experts_dim}={experts} is not divisible by ep={ep}: each ep rank holds an equal block of experts",
            loc=op.loc, hint=f"choose ep in {{{choices}}}, or make {experts_dim} a multiple of {ep}",
        )
    own = op.annotation("ep")
    found = _parse(model, experts, ep, op) if model else {}
    found.update(_parse(own, experts, ep, op) if own else {})
    layout = _layout(found, experts, ep)
    if layout.all_to_all == "hierarchical" and ep > 1:
        node_levels(mesh, layout.node_ranks, (own or model).loc or op.loc)
    others = tuple(a for a in op.annotations if a.kind != "ep")
    return replace(op, annotations=others + (replace(layout.annotation, loc=own.loc if own else None),))


def _check_settings(op: Op) -> None:
    s = MoeSettings.of(op)
    if s.score not in SCORES:
        raise DslError(f'moe: score="{s.score}" is not a choice', loc=op.loc,
                       hint='write score="softmax" or score="sigmoid"')
    if s.capacity_factor is not None and not s.capacity_factor > 0:
        raise DslError(
            f"moe: capacity_factor={s.capacity_factor:g} must be > 0 (each expert keeps "
            "ceil(capacity_factor x tokens per sequence x top_k / experts) tokens of a sequence)",
            loc=op.loc, hint="e.g. capacity_factor=1.25; leave it out for dropless routing (no token dropped)",
        )
    if s.bias_update and s.bias_state:
        raise DslError("moe: bias_update and bias_state are two routing biases; a layer has one", loc=op.loc,
                       hint="keep bias_state (the module's bias, updated by an after-step hook) or bias_update")
    for name, value in (("aux_loss", s.aux_loss), ("bias_update", s.bias_update)):
        if value < 0:
            raise DslError(f"moe: {name}={value:g} must be >= 0", loc=op.loc,
                           hint=f"e.g. {name}={'0.01' if name == 'aux_loss' else '0.001'}; 0 turns it off")


def _parse(annotation: Annotation, experts: int, ep: int, op: Op) -> dict:
    """The choices an `@ep(...)` makes (only those it names)."""
    found: dict = {}
    args = list(annotation.args)
    loc = annotation.loc or op.loc
    while args:
        arg = args.pop(0)
        if arg in PLACEMENTS:
            found["placement"] = arg
        elif arg in ALL_TO_ALL:
            found["all_to_all"] = arg
            if arg == "hierarchical" and args and _is_int(args[0]) and not _owners_follow(args):
                found["node_ranks"] = args.pop(0)
                if found["node_ranks"] < 1:
                    raise ShardingError(f"{annotation}: ranks per node must be >= 1", loc=loc)
        elif _is_int(arg) or (isinstance(arg, str) and _owner_text(arg)):
            owners = [int(v) for v in str(arg).split(",")] if isinstance(arg, str) else [arg]
            while args and _is_int(args[0]):
                owners.append(args.pop(0))
            found["placement"], found["owners"] = "explicit", tuple(owners)
        else:
            choices = ", ".join(PLACEMENTS + ALL_TO_ALL)
            raise ShardingError(f"{annotation}: {arg!r} is not a choice: {choices}, or one ep rank per expert",
                                loc=loc, hint="e.g. @ep(strided) or @ep(hierarchical, 8)")
    if found.get("placement") == "explicit":
        _check_owners(found["owners"], experts, ep, annotation, loc)
    return found


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _owners_follow(args: list) -> bool:
    """After `hierarchical`, an int starts a placement list only if more ints follow."""
    return len(args) > 1 and _is_int(args[1])


def _owner_text(text: str) -> bool:
    return all(part.strip().isdigit() for part in text.split(",")) and bool(text)


def _check_owners(owners: tuple[int, ...], experts: int, ep: int, annotation: Annotation, loc) -> None:
    per_rank = experts // ep
    counts = [owners.count(r) for r in range(ep)]
    if len(owners) != experts or any(not 0 <= o < ep for o in owners) or counts != [per_rank] * ep:
        raise ShardingError(
            f"{annotation}: a placement names the ep rank (0..{ep - 1}) of each of the {experts} experts, "
            f"{per_rank} per rank; got {len(owners)} entries with ranks {sorted(set(owners))}",
            loc=loc, hint=f"e.g. @ep(contiguous) or @ep(strided), or {experts} ranks with each of 0..{ep - 1} "
                          f"{per_rank} times",
        )


def _layout(found: dict, experts: int, ep: int) -> ExpertLayout:
    placement = found.get("placement", "contiguous")
    per_rank = max(experts // ep, 1)
    if placement == "contiguous":
        owners = tuple(e // per_rank for e in range(experts))
    elif placement == "strided":
        owners = tuple(e % ep for e in range(experts))
    else:
        owners = found["owners"]
    return ExpertLayout(placement, owners, found.get("all_to_all", "flat"), found.get("node_ranks", NODE_RANKS))

