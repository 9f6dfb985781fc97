"""What a rank issues for the gradients and the parameters around a step, expanded from the plan.

A mixin of the class-program expander (`fivedc/proof/comm_program._Expander`, which holds
the plan and the sites): the gradient buckets, started from backward as their last
gradient arrives or after it (`Buckets`); then, after backward, ZeRO-3's reduce-scatters
under a pipeline, the tied parameters' sums over the pp ranks holding them, DualPipe's
exchange of the two copies' gradients, the loss's sum, ZeRO's gathers of the
parameters (`gather_flat`) and, after the step, the states' sum over pp.
"""

from __future__ import annotations

from fivedc.ir.graph import walk_ops
from fivedc.ir.mesh import MeshAxis
from fivedc.passes.state_sync import state_sync_numel
from fivedc.instructions.events import Event

GATHER_BUCKET_BYTES = 25 * 2**20  # runtime/flat_shard.gather_flat's cap for parameters in no bucket


class SyncEvents:
    def _loss(self) -> list[Event]:
        output = next(n for n, _ in walk_ops(self.graph.body) if getattr(n, "out", None) == self.graph.output)
        axes = set(output.sharding.partial) | ({MeshAxis.PP} if self.mesh.size(MeshAxis.PP) > 1 else set())
        axes = tuple(a for a in MeshAxis if a in axes)
        if self.mesh.size(*axes) == 1:
            return []
        dtype = "float64" if self.pipeline is not None else self.dtype
        return [Event("all_reduce", axes, 1, dtype, "the step's loss, summed over its parts", output.loc)]

    def _gathers(self, held: list[str], what: str) -> list[Event]:
        """`gather_flat`: one all-gather per bucket (the part of it this class holds), then
        the parameters in no bucket by group, in name order, closed at 25 MiB."""
        wanted = [n for n in held if self.mesh.size(*self.params[n].grad_partial) > 1]
        wanted_set = set(wanted)
        given = [kept for b in self.expanded_buckets if (kept := [n for n in b if n in wanted_set])]
        covered = {n for b in given for n in b}
        open_: dict[tuple, tuple[list[str], int]] = {}
        done: list[list[str]] = []
        for name in sorted(n for n in wanted if n not in covered):
            param = self.params[name]
            n, chunk = self.mesh.size(*param.grad_partial), self.chunk_numel(name)
            names, filled = open_.get(param.grad_partial, ([], 0))
            size = n * chunk * self.plan_bytes
            if names and filled + size > GATHER_BUCKET_BYTES:
                done.append(names)
                names, filled = [], 0
            open_[param.grad_partial] = (names + [name], filled + size)
        groups = given + sorted(done + [names for names, _ in open_.values()], key=lambda names: names[0])
        return [Event("all_gather", self.params[g[0]].grad_partial,
                      sum(self.chunk_numel(n) for n in g), self.dtype, what)
                for g in groups]

    def _zero3_pipeline_sync(self, held: list[str]) -> list[Event]:
        """ZeRO-3 under a pipeline: each bucket's gradients reduce-scattered after the last
        microbatch (the rest one by one)."""
        mine = set(held)
        buckets = [b for b in self.expanded_buckets if all(n in mine for n in b)]
        out = [self._bucket_event(b, stage=2) for b in buckets]
        covered = {n for b in buckets for n in b}
        for name in held:
            param = self.params[name]
            n = self.mesh.size(*param.grad_partial)
            if name not in covered and n > 1:
                out.append(Event("reduce_scatter", param.grad_partial, n * self.chunk_numel(name),
                                 self.dtype, f"ZeRO-3 gradient of {name}", param.loc))
        return out

    def _states(self) -> list[Event]:
        """After the step: the states the forward adds to, summed over pp (`passes/state_sync.py`)."""
        numel = state_sync_numel(self.graph, self.mesh)
        return [Event("all_reduce", (MeshAxis.PP,), numel, "float64",
                      "the states the forward adds to, summed over pp for the after-step hooks")] if numel else []

    def _tied(self, pp_rank: int) -> list[Event]:
        """Tied parameters (`passes/tied.py`): after the last microbatch, the pp ranks that
        hold copies of them sum their local gradients, one all-reduce per holder set."""
        out = []
        for group in self.tied:
            if pp_rank not in group.pp_ranks:
                continue
            numel = sum(self.param_numel(n) for n in group.names)
            some = group.pp_ranks if len(group.pp_ranks) < self.mesh.size(MeshAxis.PP) else ()
            out.append(Event("all_reduce", (MeshAxis.PP,), numel, self.dtype,
                             f"tied {', '.join(group.names)}: the gradients of the copies, summed", pp_ranks=some))
        return out

    def _copies(self, pp_rank: int, held: list[str]) -> list[Event]:
        """DualPipe: pp ranks r and p-1-r hold the two copies of the same chunks and exchange
        their summed gradients (ZeRO's chunks), in name order, after the sync (but the tied
        parameters', summed over all their holders before)."""
        tied = {n for g in self.tied for n in g.names}
        held = [n for n in held if n not in tied]
        peer = self.mesh.size(MeshAxis.PP) - 1 - pp_rank
        numel = sum(self.chunk_numel(n) if self.plan.zero else self.param_numel(n) for n in held)
        what = f"DualPipe: the summed gradients of the chunks pp ranks {pp_rank} and {peer} both hold"
        return [Event("send", (MeshAxis.PP,), numel, self.dtype, what, peer=peer, tag=2),
                Event("recv", (MeshAxis.PP,), numel, self.dtype, what, peer=peer, tag=2)]

    def _bucket_event(self, names: tuple[str, ...], *, stage: int) -> Event:
        axes = self.params[names[0]].grad_partial
        if stage in (1, 2):
            n = self.mesh.size(*axes)
            numel = n * sum(self.chunk_numel(p) for p in names)
            return Event("reduce_scatter", axes, numel, self.dtype, f"gradient bucket {', '.join(names)}")
        numel = sum(self.param_numel(p) for p in names)
        return Event("all_reduce", axes, numel, self.dtype, f"gradient bucket {', '.join(names)}")


class Buckets:
    """A class's gradient buckets: started from backward as their last gradient arrives
    (overlap on, no pipeline), each once every earlier one has started; the rest after.
    Backward visits the sites in reverse, so a parameter's gradient is complete after the
    backward of the first site that reads it, and bucket k starts after the backward of
    site min(the first use of its parameters, where bucket k - 1 started): worked out per
    bucket from the parameters' first uses (`first_uses`), not site by site."""

    def __init__(self, expander, pp_rank: int, *, overlap: bool) -> None:
        self.x, self.overlap = expander, overlap
        stage = expander.plan.zero
        self.buckets = [] if stage == 3 else expander.held_buckets(pp_rank)
        self.stage = stage
        self.at: dict[int, list[int]] = {}  # site index -> the buckets started after its backward, in order
        self.started = 0  # buckets started from backward (the first ones: they start in order)
        if overlap and self.buckets and expander.sites:
            first, prev = expander.first_uses(), len(expander.sites) - 1
            for k, bucket in enumerate(self.buckets):
                uses = [first.get(n) for n in bucket]
                if None in uses:  # read by no site: complete only after backward
                    break
                prev = min([prev, *uses])
                self.at.setdefault(prev, []).append(k)
                self.started = k + 1

    def after(self, index: int) -> list[Event]:
        """The buckets started after the backward of site `index`."""
        return [self.x._bucket_event(self.buckets[k], stage=self.stage) for k in self.at.get(index, ())]

    def rest(self) -> list[Event]:
        out = [self.x._bucket_event(b, stage=self.stage) for b in self.buckets[self.started:]]
        self.started = len(self.buckets)
        return out
