"""Activation recomputation: which parts of a step keep only their inputs (plain data).

A plan's `recompute` option (`--recompute`, `parallelize(recompute=...)`, or the
model's `@recompute(...)` annotation) is one of

- `none`: every op keeps what its backward needs;
- `selective`: each attention op's kernel keeps only its inputs (q, k, v) and runs
  again in backward (Megatron's selective recomputation of the attention core: what
  it keeps inside, the log-sum-exp and, with grouped-query attention, K and V
  repeated for every query head, is rebuilt instead of kept);
- `full`: each layer of a repeat keeps only its input and runs its whole forward again
  in backward (Megatron's full recomputation); attention ops outside any repeat are
  recomputed as under `selective`.

A layer stack can choose for itself: `repeat layers @recompute(full) { ... }` sets
`Repeat.recompute`, which wins over the plan's mode for that stack (as an op's `@cp`
wins over `--cp-attention`). The runtime (`runtime/program.py`,
`runtime/recompute.py`), the memory estimate (`fivedc/estimates/activations.py`) and the
summary all ask the functions here, so they agree on what is recomputed. Nothing
here imports torch.
"""

from __future__ import annotations

from fivedc.errors import FivedcError
from fivedc.ir.graph import Graph, Op, Repeat, walk_ops

RECOMPUTE_MODES = ("none", "selective", "full")


def check_mode(mode: str, *, loc=None) -> str:
    if mode not in RECOMPUTE_MODES:
        raise FivedcError(f"unknown recompute mode {mode!r}", loc=loc,
                          hint=f"choose one of {', '.join(RECOMPUTE_MODES)} (e.g. --recompute selective)")
    return mode


def model_mode(graph: Graph) -> str:
    """The model's own choice, `@recompute(full)` on the model; `none` when it makes none."""
    annotation = graph.annotation("recompute")
    if annotation is None:
        return "none"
    if len(annotation.args) != 1:
        raise FivedcError(f"@recompute takes one mode, got {annotation}", loc=annotation.loc or graph.loc,
                          hint=f"e.g. @recompute(selective); modes: {', '.join(RECOMPUTE_MODES)}")
    return check_mode(str(annotation.args[0]), loc=annotation.loc or graph.loc)


def layer_mode(repeat: Repeat, mode: str) -> str:
    """The mode of one layer stack: its own `@recompute(...)`, else the plan's."""
    return repeat.recompute if repeat.recompute is not None else mode


def recomputes_layer(repeat: Repeat, mode: str) -> bool:
    """Whether each layer of `repeat` is one recomputed region."""
    return layer_mode(repeat, mode) == "full"


def recomputes_op(op: Op, repeat: Repeat | None, mode: str) -> bool:
    """Whether `op` (in `repeat`, or at top level) is a recomputed region of its own (not
    one inside a recomputed layer)."""
    if op.kind != "attention":
        return False
    if repeat is not None:
        return layer_mode(repeat, mode) == "selective"
    return mode in ("selective", "full")


def recomputed_regions(graph: Graph, mode: str) -> tuple[int, int]:
    """(layers recomputed whole, attention ops recomputed alone), per step."""
    layers = sum(r.count for r in graph.body.items if isinstance(r, Repeat) and recomputes_layer(r, mode))
    alone = sum(repeat.count if repeat else 1 for node, repeat in walk_ops(graph.body)
                if isinstance(node, Op) and recomputes_op(node, repeat, mode))
    return layers, alone


def recompute_notes(graph: Graph, recompute: str) -> tuple[str, ...]:
    """A recompute mode that recomputes nothing in this model, said once."""
    if recompute != "none" and recomputed_regions(graph, recompute) == (0, 0):
        return (f"recompute {recompute} changes nothing: the model has no attention op and no layer stack "
                "(repeat) it recomputes",)
    return ()
