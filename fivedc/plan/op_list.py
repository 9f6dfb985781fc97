"""`fivedc show PLAN --ops`: every op and redistribution of a plan with its id.

The ids are what `fivedc verify --inject-fault` and verify's first-divergence report
use (`fivedc/instructions/sites.py`): a top-level value's name, or `REPEAT.LAYER.NAME` for a node
of a layer stack, listed once as `REPEAT.[0-N].NAME`. Each row gives the node's kind
and arguments, its output sharding (`int` for integer values), where it was written,
the collectives it runs (in the op, or the redistribution's forward and backward
steps) and, under a pipeline, the pp rank that computes it.
"""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from fivedc.ir.graph import Redistribute
from fivedc.plan.execution_plan import ExecutionPlan
from fivedc.instructions.sites import graph_nodes, pp_rank_of, sites


SHORT = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "all_to_all": "A2A", "send_recv": "P2P"}


def op_rows(plan: ExecutionPlan) -> list[tuple[str, ...]]:
    """(id, op, output sharding, line, collectives[, pp rank]) per node, in program order."""
    first = {}
    for site in sites(plan.graph):
        first.setdefault(site.value, site)
    rows = []
    for node, repeat in graph_nodes(plan.graph):
        ident = node.out if repeat is None else f"{repeat.name}.[0-{repeat.count - 1}].{node.out}"
        if isinstance(node, Redistribute):
            what, runs = f"redistribute({node.src})", [*node.forward, *node.backward]
        else:
            what, runs = f"{node.kind}({', '.join(map(str, node.args))})", list(node.collectives)
        output = ("int " if node.type.dtype == "int" else "") + f"[{node.sharding}]"
        where = "-" if node.loc is None else (f"{node.loc.line}:{node.loc.col}" if node.loc.file == plan.graph.source
                                              else str(node.loc))
        collectives = " ".join(f"{c.phase[0]}:{SHORT[c.kind]}/{'x'.join(c.axes)}" for c in runs if c.kind != "slice")
        row = (ident, what, output, where, collectives or "-")
        if plan.pipeline is not None:
            row += (str(pp_rank_of(first[node.out], plan.pipeline)),)
        rows.append(row)
    return rows


def render_ops(plan: ExecutionPlan, *, console: Console) -> None:
    table = Table(title=Text(f"ops of {plan.graph.name} on mesh {plan.mesh} ({plan.graph.source})"),
                  title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1, 0, 0))
    columns = ["id", "op", "output", "line", "collectives"] + (["pp"] if plan.pipeline is not None else [])
    for column in columns:  # the collectives wrap at spaces first: the ops and shardings keep their room
        table.add_column(column, overflow="fold", no_wrap=column == "id",
                         max_width=15 if column == "collectives" and console.width <= 100 else None)
    for row in op_rows(plan):
        table.add_row(*(Text(cell) for cell in row))
    console.print(table)
    console.print(Text("collectives: f forward, b backward; AR all-reduce, AG all-gather, RS reduce-scatter, "
                       "A2A all-to-all, P2P send/recv.\nfivedc verify --inject-fault ID[@RANK] perturbs an op's "
                       "output on one rank; in a layer stack give the layer (layers.1.q; a bare name is layer 0)."))
