"""Runs one training step of a pipeline schedule on one rank: its action list, in order.

The plan's `PipelineSpec` names the schedule, the microbatches and the chunks (unit
ranges, `passes/stages.py`); the schedule is regenerated from its name, so every
rank runs exactly the checked action list of its pp rank. Semantics (those of
`fivedc/schedule/simulator.py`): a SEND is an `isend` waited for at the end of the
step; a RECV blocks; activations and gradients travel with their own tags, in
order per (sender, receiver). A chunk's boundary values travel as one flat buffer;
its shapes follow from the plan (types, shardings, the microbatch's batch size).

The inputs split along the batch dim into microbatches. Forward of (j, c) runs the
chunk's units on microbatch j; on the last chunk the loss is the microbatch's share
of the full loss (cross-entropy divides by the global token count), so summing the
microbatches gives the full-batch loss and gradients accumulate to the full-batch
gradients. B runs autograd through the chunk and sends the gradients of its inputs;
I computes those and every gradient but the linear layers' weight gradients, whose
matmuls it keeps (`runtime/weight_grads.py`); W then does only those matmuls.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from fivedc.ir.mesh import MeshAxis
from fivedc.schedule import Action, ActionKind
from fivedc.runtime.groups import moves_nothing
from fivedc.runtime.loss import counted_targets
from fivedc.runtime.saved import held
from fivedc.runtime.weight_grads import DeferredGrad
from fivedc.runtime.weight_grads import enable as enable_deferred_weight_grads
from fivedc.passes.microbatch_checks import input_only_items
from fivedc.passes.stage_values import value_types
from fivedc.passes.stages import PipelineSpec, Unit, units
from fivedc.passes.tied import tied_groups

K = ActionKind
TAGS = {K.SEND_FORWARD: 0, K.RECV_FORWARD: 0, K.SEND_BACKWARD: 1, K.RECV_BACKWARD: 1}
COPY_TAG = 2  # DualPipe: the two copies' gradients


@dataclass
class _Micro:
    """What one (microbatch, chunk) keeps between its forward and its backward."""

    received: list[Tensor] = field(default_factory=list)  # boundary inputs (leaves)
    outputs: list[Tensor] = field(default_factory=list)  # boundary outputs, or [loss]
    grads_in: list[Tensor] | None = None  # gradients of the outputs, from the next chunk
    grads_out: list[Tensor] = field(default_factory=list)  # gradients of `received`
    deferred: list[DeferredGrad] = field(default_factory=list)  # I's weight gradients, for W
    done: bool = False  # backward (B, or W after I) has run
    sent: bool = False  # grads_out has been sent


@dataclass
class _Step:
    """What one step's actions share: the microbatches' inputs and state, the sends in flight, the loss."""

    params: dict
    inputs: list[dict[str, Tensor]]  # per microbatch
    micro: dict[tuple[int, int], _Micro] = field(default_factory=dict)  # per (microbatch, chunk)
    sends: list = field(default_factory=list)  # (buffer, work) of the sends still in flight
    total: Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))

    def post(self, send) -> None:
        """Keep a posted send (its buffer referenced until done), dropping those already done."""
        self.sends = _pending(self.sends) + [send]


class PipelineRunner:
    def __init__(self, program, spec: PipelineSpec, *, dtype: torch.dtype, device: torch.device) -> None:
        graph, ctx = program.graph, program.ctx
        self.program, self.spec, self.graph, self.ctx = program, spec, graph, ctx
        self.dtype, self.device = dtype, device
        pp_rank = ctx.coords[MeshAxis.PP]
        self.schedule = spec.build_schedule(ctx.mesh.size(MeshAxis.PP))
        self.actions = self.schedule.ranks[pp_rank]
        self.all_units: list[Unit] = units(graph)
        self.types = value_types(graph)
        copy = len(spec.chunks) // self.schedule.pipelines  # DualPipe runs two copies of the model's chunks
        self.loss_chunks = {c for c in range(len(spec.chunks)) if self.schedule.next_chunk(c) is None}
        self.last_chunk = copy - 1  # the first copy's loss chunk (forward_only runs that copy)
        self.tied = [g for g in tied_groups(graph, spec, ctx.mesh.size(MeshAxis.PP)) if pp_rank in g.pp_ranks]
        split = any(a.kind == K.BACKWARD_WEIGHT for a in self.actions)
        self.weight_grads = enable_deferred_weight_grads(ctx) if split else None
        self.meter = None  # a `runtime.saved.LiveMeter` measuring what the step keeps for backward
        self.sends_done_at_once = moves_nothing()  # a rehearsal's fake group: the peer has it at once

    # ---- one step --------------------------------------------------------------------------
    def step(self, params, inputs: dict[str, Tensor]) -> Tensor:
        """Forward and backward of every microbatch on this rank; the sum of the losses
        computed here (zero on ranks without the last chunk). Each action runs by its kind
        (`_ACTIONS`: one method per kind)."""
        self._count_targets(inputs)
        run = _Step(params, self._split(inputs))
        for action in self.actions:
            self._ACTIONS[action.kind](self, action, run)
        for _, work in _pending(run.sends):  # the buffer stays referenced until its send is done
            work.wait()
        self._sum_tied(params)
        return run.total

    def _on_forward(self, action: Action, run: _Step) -> None:
        """F: the chunk's units on the microbatch; its inputs came by RECV_FORWARD or, when
        the previous chunk ran here, are handed over; what backward needs is kept."""
        key = (action.microbatch, action.chunk)
        micro = run.micro.setdefault(key, _Micro())
        if self._local_prev(action.chunk):  # the previous chunk ran here: hand over, no transfer
            previous = run.micro[(action.microbatch, action.chunk - 1)].outputs
            micro.received = [t.detach().requires_grad_(True) for t in previous]
        if self.program.tracer is not None:
            self.program.tracer.microbatch = action.microbatch
        with self.meter.forward(key) if self.meter is not None else contextlib.nullcontext():
            loss = self._forward(run.params, run.inputs[action.microbatch], micro, action.chunk)
            held([*micro.received, *micro.outputs])  # kept until its backward
        if loss is not None:
            run.total = run.total + loss.detach().double()

    def _on_backward(self, action: Action, run: _Step) -> None:
        """B, or I (its weight gradients kept for W): the input gradients, handed to the
        previous chunk when it ran here, else kept for SEND_BACKWARD; the activations freed."""
        key = (action.microbatch, action.chunk)
        micro = run.micro[key]
        self._backward(action.kind, micro, key)
        if self._local_prev(action.chunk):
            run.micro[(action.microbatch, action.chunk - 1)].grads_in = micro.grads_out
            micro.grads_out, micro.sent = [], True
        micro.outputs, micro.received, micro.grads_in = [], [], None  # the graph is done with
        if action.kind == K.BACKWARD:
            self._finish(run, key)

    def _on_weight(self, action: Action, run: _Step) -> None:
        """W: the weight-gradient matmuls I kept."""
        key = (action.microbatch, action.chunk)
        micro = run.micro[key]
        for deferred in micro.deferred:
            deferred.run()
        micro.deferred = []
        self._finish(run, key)

    def _finish(self, run: _Step, key: tuple[int, int]) -> None:
        """After B or W nothing of the (microbatch, chunk) is needed."""
        run.micro[key].done = True
        if self.meter is not None:
            self.meter.release(key)
        self._forget(run.micro, key)

    def _on_send_forward(self, action: Action, run: _Step) -> None:
        """SEND_FORWARD: the chunk's outputs to the next chunk's rank."""
        run.post(self._send(run.micro[(action.microbatch, action.chunk)].outputs, action.peer, TAGS[action.kind]))

    def _on_send_backward(self, action: Action, run: _Step) -> None:
        """SEND_BACKWARD: the gradients of the chunk's inputs to the previous chunk's rank."""
        key = (action.microbatch, action.chunk)
        micro = run.micro[key]
        run.post(self._send(micro.grads_out, action.peer, TAGS[action.kind]))
        micro.grads_out, micro.sent = [], True
        self._forget(run.micro, key)

    def _on_recv_forward(self, action: Action, run: _Step) -> None:
        """RECV_FORWARD: the inputs of chunk c+1, from chunk c's rank."""
        target = run.micro.setdefault((action.microbatch, action.chunk + 1), _Micro())
        target.received = [t.requires_grad_(True) for t in self._recv(action.peer, TAGS[action.kind], action.chunk)]

    def _on_recv_backward(self, action: Action, run: _Step) -> None:
        """RECV_BACKWARD: the gradients for the outputs of chunk c-1, from chunk c's rank."""
        target = run.micro[(action.microbatch, action.chunk - 1)]
        target.grads_in = self._recv(action.peer, TAGS[action.kind], action.chunk - 1)

    _ACTIONS = {
        K.FORWARD: _on_forward,
        K.BACKWARD: _on_backward,
        K.BACKWARD_INPUT: _on_backward,
        K.BACKWARD_WEIGHT: _on_weight,
        K.SEND_FORWARD: _on_send_forward,
        K.SEND_BACKWARD: _on_send_backward,
        K.RECV_FORWARD: _on_recv_forward,
        K.RECV_BACKWARD: _on_recv_backward,
    }

    def forward_only(self, params, inputs: dict[str, Tensor]) -> Tensor:
        """Every microbatch's forward and no backward (evaluation, under `torch.no_grad()`):
        this rank's chunks in model order, one microbatch after another; the sum of the
        losses computed here. Every rank works in (microbatch, chunk) order, so a
        receive never waits on a send that comes later."""
        chunks, mine = self.spec.chunks[:self.last_chunk + 1], self.ctx.coords[MeshAxis.PP]
        total = torch.zeros((), dtype=torch.float64)
        sends: list = []
        self._count_targets(inputs)
        for inputs_j in self._split(inputs):
            outputs: list[Tensor] = []
            for chunk in chunks:
                if chunk.rank != mine:
                    continue
                micro = _Micro()
                if chunk.index > 0:
                    before = chunks[chunk.index - 1]  # ran here just now, or is received
                    micro.received = outputs if before.rank == mine else self._recv(before.rank, TAGS[K.RECV_FORWARD],
                                                                                    before.index)
                loss = self._forward(params, inputs_j, micro, chunk.index)
                if loss is not None:
                    total = total + loss.detach().double()
                outputs = micro.outputs
                after = chunks[chunk.index + 1] if chunk.index < self.last_chunk else None
                if after is not None and after.rank != mine:
                    sends.append(self._send(outputs, after.rank, TAGS[K.SEND_FORWARD]))
        for _, work in _pending(sends):
            work.wait()
        return total

    def _count_targets(self, inputs: dict[str, Tensor]) -> None:
        """A loss with ignore_index divides by the count of its targets over the whole step,
        not one microbatch's: counted here, before them, on the rank that holds the loss. Its
        targets are an input, or computed from the inputs alone (Hugging Face's label shift:
        `microbatch_checks.input_only_items`), by those ops run once more here on the whole step's
        inputs (row by row: the plan runs no op along the batch under microbatches)."""
        self.ctx.step_counts.clear()
        if all(self.spec.chunks[c].rank != self.ctx.coords[MeshAxis.PP] for c in self.loss_chunks):
            return
        for op in self.program.losses_ignoring():
            targets = op.args[1]
            if targets not in inputs and self.spec.microbatches > 1:
                env, dims = dict(inputs), {i.name: i.type.dims for i in self.graph.inputs}
                items = input_only_items(self.graph, targets)
                self.program.run_units([Unit(i, i + 1) for i in items], {}, env, dims)
                inputs = {**inputs, targets: env[targets]}
            if targets in inputs:  # else one microbatch: the kernel counts them itself
                self.ctx.step_counts[op.out] = counted_targets(self.ctx, op, inputs[targets])

    def _split(self, inputs: dict[str, Tensor]) -> list[dict[str, Tensor]]:
        """The inputs of each microbatch: split along the batch dim."""
        m, batch = self.spec.microbatches, self.graph.batch_dim
        micro_inputs: list[dict[str, Tensor]] = [{} for _ in range(m)]
        for item in self.graph.inputs:
            index = item.type.dims.index(batch)
            for j, part in enumerate(inputs[item.name].chunk(m, dim=index)):
                micro_inputs[j][item.name] = part
        return micro_inputs

    def _forward(self, params, inputs: dict[str, Tensor], micro: _Micro, chunk: int) -> Tensor | None:
        spec = self.spec.chunks[chunk]
        env = dict(inputs)
        dims = {i.name: i.type.dims for i in self.graph.inputs}
        if self.schedule.prev_chunk(chunk) is not None:
            names = self.spec.chunks[chunk - 1].sends
            env.update(zip(names, micro.received))
            dims.update((n, self.types[n][0].dims) for n in names)
        first, stop = spec.units
        self.program.run_units(self.all_units[first:stop], params, env, dims)
        if chunk in self.loss_chunks:
            micro.outputs = [env[self.graph.output]]
            return micro.outputs[0]
        micro.outputs = [env[n] for n in spec.sends]
        return None

    def _local_prev(self, chunk: int) -> bool:
        previous = self.schedule.prev_chunk(chunk)
        return previous is not None and self.schedule.stage_of(previous) == self.schedule.stage_of(chunk)

    def _forget(self, state: dict, key: tuple[int, int]) -> None:
        """Drop a (microbatch, chunk) once its backward is done and its input
        gradients are sent (the first chunk of a pipeline sends none)."""
        micro = state[key]
        if micro.done and (micro.sent or self.schedule.prev_chunk(key[1]) is None):
            del state[key]

    def _backward(self, kind: ActionKind, micro: _Micro, key: tuple[int, int]) -> None:
        """B or I through the chunk: the gradients of its received inputs in `micro.grads_out`."""
        outputs, grads = micro.outputs, micro.grads_in
        pairs = [(o, g) for o, g in zip(outputs, grads or [None] * len(outputs)) if o.requires_grad]
        if not pairs:
            micro.grads_out = [torch.zeros_like(t) for t in micro.received]
            return
        outs, gs = [o for o, _ in pairs], [g for _, g in pairs] if grads is not None else None
        leaves = [t for t in micro.received]
        if kind == K.BACKWARD_INPUT:
            with self.weight_grads.defer():
                torch.autograd.backward(outs, gs)
            micro.deferred = self.weight_grads.take()
            if self.meter is not None:  # the graph is freed; W keeps the linears' inputs and output gradients
                self.meter.hold(key, [t for d in micro.deferred for t in (d.x, d.grad_out)])
        else:
            torch.autograd.backward(outs, gs)
        micro.grads_out = [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]

    # ---- tied parameters: held by several pp ranks ----------------------------------------------
    def _sum_tied(self, params) -> None:
        """A tied parameter (`passes/tied.py`) has a copy on each pp rank whose chunks
        use it, and each copy's gradient holds only those uses: after the last microbatch,
        before the gradient sync, the holders sum them (one all-reduce per holder set, its
        parameters in name order as one flat buffer), so every copy gets the same update."""
        for group in self.tied:
            names = [n for n in group.names if params[n].requires_grad]  # frozen alike on every rank
            if not names:
                continue
            grads = [params[n].grad if params[n].grad is not None else torch.zeros_like(params[n]) for n in names]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.ctx.groups.pp_group(group.pp_ranks))
            for name, part in zip(names, flat.split([g.numel() for g in grads])):
                params[name].grad = part.view_as(params[name])

    # ---- DualPipe: two copies of each chunk ----------------------------------------------------
    def sum_copies(self, grads: dict[str, Tensor]) -> None:
        """DualPipe keeps two copies of the model (pp rank r holds chunk r of one and chunk
        p-1-r of the other): each copy saw half the microbatches, so the two ranks holding
        the copies of a chunk (pp ranks r and p-1-r hold the same parameters) exchange
        their summed gradients, in name order, and add them (a + b = b + a: both updates
        stay equal). Tied parameters that more ranks hold were summed over all of them."""
        tied = {n for g in self.tied for n in g.names}  # summed over all their holders already
        names = sorted(n for n in grads if n not in tied)
        if self.schedule.pipelines == 1 or not names:
            return
        mine = torch.cat([grads[n].reshape(-1) for n in names])
        theirs = torch.empty_like(mine)
        peer = self._peer(self.ctx.mesh.size(MeshAxis.PP) - 1 - self.ctx.coords[MeshAxis.PP])
        for work in (dist.isend(mine, dst=peer, tag=COPY_TAG), dist.irecv(theirs, src=peer, tag=COPY_TAG)):
            work.wait()
        offset = 0
        for name in names:
            size = grads[name].numel()
            grads[name].add_(theirs[offset:offset + size].view_as(grads[name]))
            offset += size

    # ---- point to point ------------------------------------------------------------------------
    def _peer(self, pp_rank: int) -> int:
        return self.ctx.mesh.rank_of({**self.ctx.coords, MeshAxis.PP: pp_rank})

    def _send(self, tensors: list[Tensor], peer: int, tag: int):
        flat = torch.cat([t.detach().reshape(-1) for t in tensors]).contiguous()
        work = dist.isend(flat, dst=self._peer(peer), tag=tag)
        return flat, None if self.sends_done_at_once else work

    def _recv(self, peer: int, tag: int, producer: int) -> list[Tensor]:
        """The boundary tensors after chunk `producer` (forward), or their gradients."""
        names = self.spec.chunks[producer].sends
        shapes = [self._local_shape(n) for n in names]
        flat = torch.empty(sum(math.prod(s) for s in shapes), dtype=self.dtype, device=self.device)
        dist.recv(flat, src=self._peer(peer), tag=tag)
        out, offset = [], 0
        for shape in shapes:
            size = math.prod(shape)
            out.append(flat[offset:offset + size].view(shape).clone())
            offset += size
        return out

    def _local_shape(self, name: str) -> tuple[int, ...]:
        t, sharding = self.types[name]
        graph, mesh = self.graph, self.ctx.mesh
        shape = []
        for dim in t.dims:
            size = graph.local_size(dim, sharding, mesh)
            shape.append(size // self.spec.microbatches if dim == graph.batch_dim else size)
        return tuple(shape)


def _pending(sends: list) -> list:
    """The sends still in flight (their buffers stay referenced until done); the others dropped."""
    return [(buffer, work) for buffer, work in sends if work is not None and not work.is_completed()]
