"""The plan's paths of its linears (`runtime/linear_paths.py`), read once per program.

Which linear multiplies a gathered value chunk by chunk as its ring brings it, which feeds
the sum of its output as it makes it, and which puts its weight gradient off behind which
redistribution's backward sum: all from the plan's graph, no process needed. The runs
themselves (the same collectives in the same order as the agreement proof lists, the same
gradients as without the overlaps) are tested in tests/test_tp_ring.py,
tests/test_tp_overlap.py and tests/test_agreement.py.
"""

from __future__ import annotations

from fivedc.frontends.dsl_file import load_model
from fivedc.instructions.done_again import read_done_again
from fivedc.ir.graph import Op, Redistribute, Repeat, walk_ops
from fivedc.ir.mesh import Mesh
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from fivedc.runtime import kernels
from fivedc.runtime.linear_paths import LINEAR_KINDS, plan_paths


def compiled(mesh: str = "1x1x2x1x1", **options):
    return compile_graph(load_model("examples/tiny_llama.5d"),
                         CompileOptions(mesh=Mesh.parse(mesh), dtype="fp64", **options))


def by_weight(plan) -> dict:
    """Each linear's path, by its weight's name (the first layer's: a repeat's body is one)."""
    paths = plan_paths(plan.graph, read_done_again(plan.graph, plan.mesh, recompute=plan.recompute))
    ops = {node.out: node for node, _ in walk_ops(plan.graph.body) if isinstance(node, Op)}
    return {ops[out].args[1]: path for out, path in paths.linears.items()}


def test_under_sp_the_first_reader_of_each_gather_takes_its_chunks() -> None:
    plan = compiled(sequence_parallel=True)
    paths = by_weight(plan)
    assert sorted(w for w, p in paths.items() if p.gathered_by) == ["w_gate", "w_head", "wq"]
    assert sorted(w for w, p in paths.items() if p.feeds_sum) == ["w_down", "wo"]
    # every reader of a redistributed input puts dW off behind its gradient's sum, each at its index
    whole = plan_paths(plan.graph, read_done_again(plan.graph, plan.mesh, recompute=plan.recompute))
    for weight, path in paths.items():
        if path.put_off_by is not None:
            assert whole.put_offs[path.put_off_by].weights[path.put_off_index] == weight
    assert sorted(w for w, p in paths.items() if p.put_off_by) == ["w_gate", "w_head", "w_up", "wk", "wq", "wv"]
    # the gather's reader is the item right after its redistribution
    blocks = [plan.graph.body, *(node.body for node, _ in walk_ops(plan.graph.body) if isinstance(node, Repeat))]
    readers = [(whole.gathers[node.out].reader, block.items[index + 1].out) for block in blocks
               for index, node in enumerate(block.items)
               if isinstance(node, Redistribute) and node.out in whole.gathers]
    assert len(readers) == 3 and all(reader == after for reader, after in readers)


def test_without_sp_no_gather_and_the_row_parallel_linears_feed_chunked_sums() -> None:
    paths = by_weight(compiled())
    assert not any(p.gathered_by for p in paths.values())
    assert sorted(w for w, p in paths.items() if p.feeds_sum) == ["w_down", "wo"]


def test_without_overlap_every_linear_is_plain() -> None:
    plan = compiled(sequence_parallel=True, overlap=False)
    paths = plan_paths(plan.graph, read_done_again(plan.graph, plan.mesh, recompute="none"))
    assert paths.linears == paths.gathers == paths.sums == paths.put_offs == {}


def test_the_fed_kinds_are_the_linear_kernels() -> None:
    """The program hands a `LinearFeed` only to ops of `LINEAR_KINDS`, whose kernel takes it."""
    assert all(kernels.KERNELS[kind] is kernels._linear for kind in LINEAR_KINDS)


def test_a_pipeline_unit_is_a_block_of_its_own() -> None:
    """Cut into one item per piece, the head's gather has no reader in its piece (the ring is
    finished at the piece's end) and no reader puts dW off behind it; the layers' bodies
    keep theirs."""
    plan = compiled(sequence_parallel=True)
    whole = plan_paths(plan.graph, read_done_again(plan.graph, plan.mesh, recompute=plan.recompute))
    items = plan.graph.body.items
    cut = plan_paths(plan.graph, read_done_again(plan.graph, plan.mesh, recompute=plan.recompute), pieces=[(i, i + 1) for i in range(len(items))])
    top = [node.out for node in items if isinstance(node, Redistribute) and node.out in whole.gathers]
    assert top and all(whole.gathers[v].reader is not None and cut.gathers[v].reader is None for v in top)
    assert all(v in whole.put_offs and v not in cut.put_offs for v in top)
    inner = set(whole.gathers) - set(top)
    assert inner and all(cut.gathers[v] == whole.gathers[v] for v in inner)
