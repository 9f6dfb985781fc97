"""What a pipeline's class of ranks issues around its chunks' computations (a part of
`fivedc/instructions/comm_program.py`).

The schedule's actions in order: a forward or backward is its chunk's runs (built once,
the same for every microbatch), a send or receive one event sized by the sender from what
its chunk computed and by the receiver from the plan's boundary types (the proof compares
the two); before the first microbatch, the loss's target count and ZeRO-3's gathers.
`PipelineEvents` is a mixin of the expander: it reads its plan, graph, pipeline, schedule,
sites and `_units`.
"""

from __future__ import annotations

from dataclasses import replace

from fivedc.ir.ops import counts_targets
from fivedc.ir.graph import Op, Redistribute, Repeat, walk_ops
from fivedc.ir.mesh import MeshAxis
from fivedc.passes.stage_values import value_types
from fivedc.instructions.events import COMPUTE, MICROBATCH, Event, Run, compute


class PipelineEvents:
    def _actions(self, pp_rank: int) -> list[Run]:
        """The schedule's actions: a computation is its chunk's runs (the same for every
        microbatch), a transfer a run of one event."""
        out: list[Run] = []
        for action in self.schedule.ranks[pp_rank]:
            kind, c = action.kind.value, action.chunk
            if kind in ("F", "B", "I"):
                key = ("chunk", kind == "F", c)
                if key not in self._chunks:
                    self._chunks[key] = self.unit_runs("forward" if kind == "F" else "backward",
                                                    *self.pipeline.chunks[c].units)
                runs = self._chunks[key]  # the same for every microbatch; an instruction list names it
                if self.computations:
                    runs = [r._replace(microbatch=action.microbatch)
                            for r in (self._input_only(c, runs) if kind == "I" else runs)]
                out += runs
            elif kind in ("SF", "RF", "SB", "RB"):
                out.append(Run(self._transfer(kind, action.peer, c), microbatch=action.microbatch))
            elif kind == "W" and self.computations:  # zero bubble: the weight gradients put off
                key = ("weights", c)
                if key not in self._chunks:
                    self._chunks[key] = (compute(f"weight gradients of chunk {c} (microbatch {MICROBATCH})"),)
                out.append(Run(self._chunks[key], microbatch=action.microbatch))
        return out

    def _input_only(self, c: int, runs: list[Run]) -> list[Run]:
        """A split backward's first half (zero bubble: its weight gradients come later, a `W`
        action): chunk c's backward `runs` with their computations named so."""
        key = ("input only", c)
        if key not in self._chunks:
            self._chunks[key] = [r._replace(events=tuple(
                replace(e, what=e.what.replace("backward of", "input gradient of", 1)) if e.op == COMPUTE else e
                for e in r.events)) for r in runs]
        return self._chunks[key]

    def _transfer(self, kind: str, peer: int, c: int) -> tuple[Event]:
        """A pipeline transfer: chunk c's outputs (forward) or the gradients of chunk c-1's
        (backward). The sender sizes its buffer from what its chunk computed, the receiver
        from what it expects (the plan's boundary types): the proof compares the two. One
        event for every microbatch (its description names it `{microbatch}`)."""
        key = ("transfer", kind, peer, c)
        if key not in self._chunks:
            producer = c if kind in ("SF", "RF") else c - 1
            names = self.pipeline.chunks[producer].sends
            numel = sum(self._computed_numel(n) if kind == "SF" else self._boundary_numel(n) for n in names)
            what = f"{'activations' if kind[1] == 'F' else 'gradients'} of {', '.join(names)} (microbatch " \
                   f"{MICROBATCH}, chunk {producer} -> {producer + 1})"
            self._chunks[key] = (Event("send" if kind in ("SF", "SB") else "recv", (MeshAxis.PP,), numel, self.dtype,
                                       what, peer=peer, tag=0 if kind[1] == "F" else 1),)
        return self._chunks[key]

    def _boundary_numel(self, name: str) -> int:
        t, sharding = value_types(self.graph)[name]
        return self.numel(t.dims, sharding)

    def _computed_numel(self, name: str) -> int:
        """A boundary value's size as its producer computed it (a repeat's result: its
        last layer's yield)."""
        for item in self.graph.body.items:
            if isinstance(item, Repeat) and name in item.results:
                value = item.body.yields[item.results.index(name)]
                node = next((n for n, _ in walk_ops(item.body) if getattr(n, "out", None) == value), None)
                if node is not None:
                    return self.numel(node.type.dims, node.sharding)
            elif isinstance(item, (Op, Redistribute)) and item.out == name:
                return self.numel(item.type.dims, item.sharding)
        return self._boundary_numel(name)

    def _pipeline_start(self, pp_rank: int, mine: list[str]) -> list[Event]:
        """Before the first microbatch: the loss's target count (on the last chunk's rank, for a
        loss with ignore_index whose targets are an input or, under several microbatches, computed
        from the inputs alone: those ops run once more first), and ZeRO-3's gathers."""
        out: list[Event] = []
        if any(c.rank == pp_rank for c in self.pipeline.chunks if self.schedule.next_chunk(c.index) is None):
            top = {id(site.node): site for site in self.sites if site.repeat is None}
            for site in self.sites:
                node = site.node
                items = self._counted_up_front(node) if isinstance(node, Op) and counts_targets(node) \
                    else None
                if items is not None:
                    out += [e for i in items for e in self._step_forward(top[id(self.graph.body.items[i])])]
                    out += self._count(node)
        if self.plan.zero == 3:
            out += self._gathers(mine, "gather every parameter once for the step (ZeRO-3 under a pipeline)")
        return out
