"""Context parallelism: split the sequence over cp, and choose how attention spans it.

Everything position-wise (embeddings, norms, MLPs, the loss) runs on the local
chunk of the sequence; only attention needs the other chunks. This pass decides
the two things the sharding rules and the runtime need for that:

- the sequence layout (`fivedc/ir/seq_layout.py`): `balanced` by default when some
  attention is causal, so every cp rank does the same attention work, else
  `contiguous`; `--cp-layout` or `@cp(balanced|contiguous)` on the model overrides;
- for every attention op, its cp variant, recorded on the op as `@cp(ring)` or
  `@cp(allgather)`: `ring` streams K/V blocks around the cp ring (P2P), `allgather`
  gathers K/V over cp and reduce-scatters their gradients. The op's own `@cp(...)`
  wins, then `--cp-attention`, then the model's `@cp(...)`, then `ring`.

It checks the sequence divides into the layout's chunks and that `@cp` is only
asked of attention. With cp = 1 it only checks the annotations.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from fivedc.errors import ShapeError, ShardingError
from fivedc.ir.graph import Annotation, Block, Graph, Op, Repeat
from fivedc.ir.mesh import MeshAxis
from fivedc.ir.seq_layout import SeqLayout, chunks_per_rank
from fivedc.passes.base import CP_VARIANTS, CompileOptions
from fivedc.passes.layout import divisors


@dataclass(frozen=True, slots=True)
class SplitSequence:
    name: ClassVar[str] = "split-sequence"
    purpose: ClassVar[str] = "CP: the sequence layout over cp and each attention's ring or all-gather variant"

    def run(self, graph: Graph, options: CompileOptions) -> Graph:
        model_variant, model_layout = _model_choices(graph)
        _check_op_annotations(graph.body)
        cp = options.mesh.size(MeshAxis.CP)
        if cp == 1:
            return graph
        if graph.seq_dim is None:
            first = graph.inputs[0]
            raise ShapeError(
                f"cp={cp} splits the sequence, but model {graph.name} has no sequence dim "
                f"(its first input {first.name} is [{', '.join(first.type.dims)}])",
                loc=first.loc or graph.loc,
                hint="use cp=1, or give the first input a [batch, seq, ...] shape",
            )
        layout = SeqLayout(options.cp_layout or model_layout or _default_layout(graph.body))
        _check_divisible(graph, cp, layout)
        variant = options.cp_attention or model_variant or "ring"
        return replace(graph, seq_layout=layout, body=_choose_variants(graph.body, variant))


def _model_choices(graph: Graph) -> tuple[str | None, str | None]:
    variant = layout = None
    for annotation in graph.annotations:
        if annotation.kind != "cp":
            continue
        for arg in annotation.args:
            if arg in CP_VARIANTS:
                variant = str(arg)
            elif arg in tuple(SeqLayout):
                layout = str(arg)
            else:
                choices = ", ".join(CP_VARIANTS + tuple(SeqLayout))
                raise ShardingError(f"@cp({arg}) on the model is not a choice: {choices}", loc=annotation.loc)
    return variant, layout


def _check_op_annotations(block: Block) -> None:
    for item in block.items:
        if isinstance(item, Repeat):
            _check_op_annotations(item.body)
            continue
        annotation = item.annotation("cp") if isinstance(item, Op) else None
        if annotation is None:
            continue
        if item.kind != "attention":
            raise ShardingError(
                f"{annotation} asks for a context-parallel attention variant, but this op is {item.kind}",
                loc=annotation.loc or item.loc,
                hint="put @cp(ring) or @cp(allgather) on an attention call",
            )
        if len(annotation.args) != 1 or annotation.args[0] not in CP_VARIANTS:
            raise ShardingError(
                f"{annotation} on attention takes one of: {', '.join(CP_VARIANTS)}",
                loc=annotation.loc or item.loc,
            )


def _default_layout(block: Block) -> SeqLayout:
    for item in block.items:
        if isinstance(item, Repeat) and _default_layout(item.body) == SeqLayout.BALANCED:
            return SeqLayout.BALANCED
        if isinstance(item, Op) and item.kind == "attention" and item.attr("causal", True):
            return SeqLayout.BALANCED
    return SeqLayout.CONTIGUOUS


def _check_divisible(graph: Graph, cp: int, layout: SeqLayout) -> None:
    seq = graph.seq_dim
    n, chunks = graph.dim(seq), chunks_per_rank(layout) * cp
    if n % chunks == 0:
        return
    valid = [c for c in divisors(n) if n % (chunks_per_rank(layout) * c) == 0 and c <= 64]
    why = f"the {layout} layout cuts it into {chunks_per_rank(layout)}*cp = {chunks} chunks"
    hint = f"choose cp in {{{', '.join(map(str, valid))}}}, or change {seq}"
    if layout == SeqLayout.BALANCED and n % cp == 0:
        hint += ", or use --cp-layout contiguous (less even work under a causal mask)"
    raise ShapeError(f"{seq}={n} is not divisible by {chunks} ({why})", loc=graph.dim_loc(seq) or graph.loc, hint=hint)


def _choose_variants(block: Block, variant: str) -> Block:
    items = []
    for item in block.items:
        if isinstance(item, Repeat):
            item = replace(item, body=_choose_variants(item.body, variant))
        elif isinstance(item, Op) and item.kind == "attention" and item.annotation("cp") is None:
            item = replace(item, annotations=item.annotations + (Annotation("cp", (variant,)),))
        items.append(item)
    return replace(block, items=tuple(items))
