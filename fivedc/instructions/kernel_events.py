"""What a kernel sends inside itself, as proof events (a part of `fivedc/instructions/comm_program.py`).

Vocab-parallel cross-entropy's three all-reduces and its count of targets, ring
attention's K/V hops (and in backward the blocks again with their gradient
accumulators), MoE's capacity and load all-reduces, count exchange, dispatch and
combine. `KernelEvents` is a mixin of the expander: it reads the expander's mesh,
graph, dims, dtype, pipeline, microbatches (`m`) and `numel`.
"""

from __future__ import annotations

from fivedc.ir.ops import counts_targets
from fivedc.ir.mesh import MeshAxis
from fivedc.passes.microbatch_checks import input_only_items
from fivedc.instructions.sites import Site
from fivedc.ir.graph import Op, Phase
from fivedc.passes.fp8 import is_fp8
from fivedc.instructions.events import Event


class KernelEvents:
    def _kernel_forward(self, site: Site) -> list[Event]:
        node = site.node
        if node.kind == "cross_entropy":
            return self._cross_entropy(node)
        if node.kind == "attention":
            return self._ring(node, backward=False)
        if node.kind == "moe":
            return self._moe(node, backward=False)
        if is_fp8(node):
            return self._amax(node, Phase.FORWARD)
        return []

    def _kernel_backward(self, site: Site) -> list[Event]:
        node = site.node
        if node.kind == "attention":
            return self._ring(node, backward=True)
        if node.kind == "moe":
            return self._moe(node, backward=True)
        if is_fp8(node):
            return self._amax(node, Phase.BACKWARD)
        return []

    def _amax(self, op: Op, phase) -> list[Event]:
        """A float8 linear's amax all-reduces (`passes/fp8.py`): forward its input's and
        weight's, backward its output gradient's, one float32 each."""
        return [Event("all_reduce", c.axes, 1, "float32", c.reason, op.loc) for c in op.collectives
                if c.phase == phase and c.reason.startswith("fp8:")]

    def _cross_entropy(self, op: Op) -> list[Event]:
        logits = op.arg_specs[0].sharding
        dims = self.dims[op.args[0]]
        vocab_axes = tuple(a for a in logits.axes_of(dims[-1]))
        out = []
        if self.mesh.size(*vocab_axes) > 1:
            tokens = self.numel(dims[:-1], logits)
            out += [Event("all_reduce", vocab_axes, tokens, self.dtype, f"vocab-parallel cross-entropy: {what}",
                          op.loc) for what in ("max of the logits", "sum of exp(logits)", "logit of the target")]
        if counts_targets(op) and self._counted_up_front(op) is None:
            out += self._count(op)
        return out

    def _counted_up_front(self, op: Op) -> tuple[int, ...] | None:
        """The top-level items a pipeline runs once more before its first microbatch to count
        `op`'s targets over the step (none: they are an input); None where the kernel counts
        them itself (runtime/pipeline.PipelineRunner._count_targets)."""
        if self.pipeline is None:
            return None
        if op.args[1] in {i.name for i in self.graph.inputs}:
            return ()
        return input_only_items(self.graph, op.args[1]) if self.m > 1 else None

    def _count(self, op: Op) -> list[Event]:
        split = op.arg_specs[1].sharding.split_axes()
        if self.mesh.size(*split) == 1:
            return []
        return [Event("all_reduce", split, 1, "float64", "cross-entropy: the number of counted targets", op.loc)]

    def _ring(self, op: Op, *, backward: bool) -> list[Event]:
        cp = self.mesh.size(MeshAxis.CP)
        annotation = op.annotation("cp")
        if cp == 1 or annotation is None or annotation.args[0] != "ring":
            return []
        block = 2 * self.numel(self.dims[op.args[1]], op.arg_specs[1].sharding)  # K and V, packed
        hop = lambda tag, dtype, what: Event("send_recv", (MeshAxis.CP,), block, dtype, what, op.loc,  # noqa: E731
                                             tag=tag)
        if not backward:
            return [hop(0, self.dtype, "ring attention: the K/V block to the next cp rank")] * (cp - 1)
        acc = "float32" if self.dtype in ("bfloat16", "float16") else self.dtype
        out = []
        for step in range(cp):
            if step < cp - 1:
                out.append(hop(0, self.dtype, "ring attention backward: the K/V block again"))
            out.append(hop(1, acc, "ring attention backward: a K/V block's gradient accumulator"))
        return out

    def _moe(self, op: Op, *, backward: bool) -> list[Event]:
        from fivedc.passes.experts import ExpertLayout, MoeSettings, token_axes

        s, mesh = MoeSettings.of(op), self.mesh
        experts = self.graph.dim(self.dims[op.args[1]][1])
        ep = mesh.size(MeshAxis.EP)
        levels = ("",) if ep == 1 or ExpertLayout.of(op, experts, ep).all_to_all == "flat" else ("intra", "inter")
        a2a = lambda numel, dtype, what, level: Event("all_to_all", (MeshAxis.EP,), numel, dtype, what,  # noqa: E731
                                                      op.loc, level=level)
        if backward:
            return [] if ep == 1 else [a2a(None, self.dtype, "MoE combine's gradient", lv) for lv in levels] + \
                [a2a(None, self.dtype, "MoE dispatch's gradient", lv) for lv in reversed(levels)]
        out = []
        x = op.arg_specs[0].sharding
        if s.capacity_factor is not None and MeshAxis.CP in x.axes_of(self.graph.seq_dim or "") and \
                mesh.size(MeshAxis.CP) > 1:
            c = next(c for c in op.collectives if c.axes == (MeshAxis.CP,) and c.kind == "all_reduce")
            out.append(Event("all_reduce", (MeshAxis.CP,), c.bytes // 8 // self._batch_parts(op), "int64",
                             "MoE capacity: assignments per sequence chunk and expert", op.loc))
        axes = token_axes(mesh)
        if axes and (s.aux_loss or s.bias_update or s.count_state):
            out.append(Event("all_reduce", axes, experts, "int64", "MoE: tokens per expert over the batch", op.loc))
        if ep > 1:
            out += [a2a(experts, "int64", "MoE: rows per expert (count exchange)", lv) for lv in levels]
            out += [a2a(None, self.dtype, "MoE dispatch", lv) for lv in levels]
            out += [a2a(None, self.dtype, "MoE combine", lv) for lv in reversed(levels)]
        return out

    def _batch_parts(self, op: Op) -> int:
        return self.m if self.graph.batch_dim in self.dims[op.args[0]] else 1
