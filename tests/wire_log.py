"""What a rank really calls on torch.distributed during one training step, for the agreement tests.

`record_step` (a worker-pool job) wraps torch.distributed's collectives and point-to-
point calls, trains one step of the plan (`runtime/verify.train_plan`), and returns
each call as (op, group axes or "pp", elements, dtype, peer pp rank). Calls made
inside another recorded call (torch's `recv` through `irecv`) are not recorded twice.
`expected_calls` turns a class program (`fivedc/instructions/comm_program.py`) into the same form,
as gloo runs it: a reduce-scatter is an all-reduce of the same input; a ring hop is a
send and a receive (recorded as one `send_recv`).
"""

from __future__ import annotations

from itertools import combinations

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from fivedc.ir.mesh import MeshAxis

NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
         "all_to_all_single", "isend", "irecv", "send", "recv", "broadcast")
P2P = {"isend": "send", "send": "send", "irecv": "recv", "recv": "recv"}
MESH_ORDER = [a.value for a in MeshAxis]


def axes_of(mesh, rank: int, ranks) -> tuple[str, ...]:
    """The mesh axes whose group through `rank` has exactly `ranks`, in mesh order."""
    used = [a for a in MeshAxis if mesh.size(a) > 1]
    for k in range(1, len(used) + 1):
        for combo in combinations(used, k):
            if set(mesh.group_ranks(combo, rank)) == set(ranks):
                return tuple(str(a) for a in combo)
    return tuple(map(str, ranks))


class Recording:
    """Every torch.distributed call this rank makes between `start` and `stop`, in `calls`
    (ring hops paired into `send_recv`)."""

    def __init__(self, mesh, info) -> None:
        self.mesh, self.info, self.log, self.depth = mesh, info, [], 0
        self.real = {name: getattr(dist, name) for name in NAMES}

    @property
    def calls(self) -> list[tuple]:
        return _paired(self.log)

    def start(self) -> Recording:
        _swap({name: self._wrap(name) for name in NAMES})
        return self

    def stop(self) -> None:
        _swap(self.real)

    def _note(self, name, args, kwargs):
        group = kwargs.get("group", args[2] if name in P2P and len(args) > 2 else None)
        tensor = args[1] if name in ("all_gather", "all_to_all_single") else args[0]
        dtype = str(tensor.dtype).removeprefix("torch.")
        if name in P2P and group is None:  # a pipeline transfer: the peer is a global rank
            peer = kwargs.get("dst", kwargs.get("src", args[1] if len(args) > 1 else None))
            return (P2P[name], ("pp",), tensor.numel(), dtype, self.mesh.coords(peer)[MeshAxis.PP])
        ranks = dist.get_process_group_ranks(group) if group is not None else range(self.info.world)
        op = P2P.get(name) or {"all_to_all_single": "all_to_all"}.get(name, name)
        return (op, axes_of(self.mesh, self.info.rank, ranks), tensor.numel(), dtype, None)

    def _wrap(self, name):
        def call(*args, **kwargs):
            if not self.depth:
                self.log.append(self._note(name, args, kwargs))
            self.depth += 1
            try:
                return self.real[name](*args, **kwargs)
            finally:
                self.depth -= 1
        return call


def _swap(table) -> None:
    for name, fn in table.items():
        setattr(dist, name, fn)
        if name in ("isend", "irecv"):  # P2POp checks its op against c10d's own
            setattr(c10d, name, fn)


def record_step(info, payload) -> list[tuple]:
    from fivedc.runtime import verify, zero

    plan, settings = payload
    program, params, inputs, _ = verify.setup_rank(plan, info, settings)
    recording = Recording(plan.mesh, info)
    full_params = zero.ZeroOptimizer.full_params
    zero.ZeroOptimizer.full_params = lambda self: (recording.stop(), full_params(self))[1]  # the check, not the step
    try:
        recording.start()
        verify.train_plan(plan, program, params, inputs, settings)
    finally:
        recording.stop()
        zero.ZeroOptimizer.full_params = full_params
    return recording.calls


def _paired(log: list[tuple]) -> list[tuple]:
    """A ring hop (isend then irecv over one group) as one `send_recv`."""
    out, i = [], 0
    while i < len(log):
        if log[i][0] == "send" and log[i][1] != ("pp",) and i + 1 < len(log) and log[i + 1][0] == "recv":
            out.append(("send_recv", *log[i][1:]))
            i += 2
        else:
            out.append(log[i])
            i += 1
    return out


def expected_calls(events) -> list[tuple]:
    out = []
    for e in events:
        op = "all_reduce" if e.op == "reduce_scatter" else e.op  # gloo
        axes = ("pp",) if op in ("send", "recv") else tuple(sorted(map(str, e.axes), key=MESH_ORDER.index))
        out.append((op, axes, e.numel, e.dtype, e.peer))
    return out


def by_group(calls: list[tuple]) -> dict[tuple, list[tuple]]:
    groups: dict[tuple, list[tuple]] = {}
    for call in calls:
        groups.setdefault(call[1], []).append(call)
    return groups


def same_call(got: tuple, want: tuple) -> bool:
    """Equal, where an expected size of None (sized at run time) matches any."""
    return got[:2] == want[:2] and got[3:] == want[3:] and (want[2] is None or got[2] == want[2])


def assert_calls_match(plan, pool) -> None:
    """One step of `plan` on `pool` (a worker pool), each rank's recorded collectives held to
    the agreement proof's program of its class, group by group and in order."""
    from fivedc.instructions.comm_program import class_programs
    from fivedc.runtime.train import TrainSettings

    programs = class_programs(plan)
    calls = pool.run(record_step, world=plan.mesh.world, payload=(plan, TrainSettings(steps=1, keep_grads=False)))
    for rank, got in enumerate(calls):
        want = by_group(expected_calls(programs[plan.mesh.coords(rank)[MeshAxis.PP]]))
        got = by_group(got)
        assert set(got) == set(want), (rank, set(got) ^ set(want))
        for group in want:
            assert len(got[group]) == len(want[group]) and all(map(same_call, got[group], want[group])), \
                (rank, group, got[group], want[group])
