"""The states' sum over a pipeline's ranks (`fivedc/ir/states.py`, `runtime/states.py`).

A state an op adds to (an MoE layer's tokens per expert) gains on the pp ranks whose chunks
hold that op only. After the optimizer's step, before the after-step hooks read the states,
every rank adds what it added since the last sum, all-reduced over pp (one float64 buffer of
every written state), so each rank holds the one-device value and the hooks compute alike
on every rank. Without a pipeline every rank adds the same (the counts are already summed
over the ranks that split the batch, inside the op), and nothing is listed.
"""

from __future__ import annotations

from fivedc.ir.graph import Collective, CollectiveKind, Graph, Phase
from fivedc.ir.mesh import Mesh, MeshAxis
from fivedc.ir.states import graph_states, written_keys

STATE_BYTES = 8  # summed as float64


def state_sync_collectives(graph: Graph, mesh: Mesh) -> tuple[Collective, ...]:
    """The all-reduce over pp of the written states, or none (pp = 1, or no state is written)."""
    keys = written_keys(graph)
    if mesh.size(MeshAxis.PP) == 1 or not keys:
        return ()
    sizes = {s.key: s.size for s in graph_states(graph)}
    loc = next((s.loc for s in graph_states(graph) if s.written), None)
    names = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
    return (Collective(
        CollectiveKind.ALL_REDUCE, (MeshAxis.PP,), Phase.OPTIMIZER, "states", sum(sizes[k] for k in keys) * STATE_BYTES,
        f"states the forward adds to ({names}): only the pp ranks holding their ops add, so each rank's "
        "additions since the last sum are summed over pp before the after-step hooks read them", loc=loc,
        overlaps="nothing (after the optimizer step)"),)


def state_sync_numel(graph: Graph, mesh: Mesh) -> int:
    """Elements of that all-reduce (0: none)."""
    return sum(c.bytes for c in state_sync_collectives(graph, mesh)) // STATE_BYTES
