"""State: the buffers of a model that its forward reads or writes, as the plan knows them.

A state is a module's buffer (a key of the module's buffers, `model.layers.1.moe.expert_bias_E`),
held whole on every rank, never trained by the optimizer. Ops name the states they use in
their attributes; `graph_states` reads them off the graph, one table entry per op kind:

- `state_add`: the value (whole on every rank) is added to the state `state` in a training
  forward: a module's `buffer.add_(value)` in traced code (its sum over the batch is computed
  whole, as any reduction along the batch; a pipeline's microbatches each add their rows' sum);
- `moe`: `bias_state` is read (a routing bias added to the scores in the choice);
  `count_state` is written: each training forward adds the tokens per expert of the whole
  batch (the counts summed over the ranks that split the batch: dp, ep and cp, an
  all-reduce the op lists; a pipeline's microbatches each add theirs), the value one
  device computes from the whole batch.

Writes are additions, so a state is the same on every rank holding the op and the sum of
what each pp rank's chunks added (`runtime/states.py` sums them over pp after the
step, then runs the after-step hooks: updates the training loop makes from the state).
"""

from __future__ import annotations

from dataclasses import dataclass

from fivedc.ir.graph import Graph, Op, SourceLoc, walk_ops, walk_params


@dataclass(frozen=True, slots=True)
class State:
    """One buffer the forward uses: its module key, its elements, and whether the forward adds to it."""

    key: str
    size: int
    written: bool
    op: str  # the op that uses it (its output's name)
    loc: SourceLoc | None = None


def _moe(graph: Graph, op: Op, dims: dict[str, tuple[str, ...]]) -> list[State]:
    experts = graph.dim(dims[op.args[1]][1])
    out = []
    for attr, written in (("bias_state", False), ("count_state", True)):
        key = str(op.attr(attr, ""))
        if key:
            out.append(State(key, experts, written, op.out, op.loc))
    return out


def _state_add(graph: Graph, op: Op, dims: dict[str, tuple[str, ...]]) -> list[State]:
    size = 1
    for d in op.type.dims if op.type is not None else ():
        size *= graph.dim(d)
    return [State(str(op.attr("state")), size, True, op.out, op.loc)]


_RULES = {"moe": _moe, "state_add": _state_add}


def graph_states(graph: Graph) -> tuple[State, ...]:
    """Every state the graph's ops use, in program order (a key used twice is listed once per use)."""
    dims = {p.name: p.dims for p, _ in walk_params(graph.body)}
    out: list[State] = []
    for op, _ in walk_ops(graph.body):
        rule = _RULES.get(getattr(op, "kind", ""))
        if rule is not None:
            out += rule(graph, op, dims)
    return tuple(out)


def state_sizes(graph: Graph) -> dict[str, int]:
    """Each state's key and elements, once, in program order."""
    return {s.key: s.size for s in graph_states(graph)}


def written_keys(graph: Graph) -> tuple[str, ...]:
    """The states some op adds to, once each, in program order."""
    return tuple(dict.fromkeys(s.key for s in graph_states(graph) if s.written))
