"""Is a schedule executable? Static checks, then a run under the P2P semantics.

`check_schedule` raises a `ScheduleError` naming the rank, the action's position and
its text when:

- an action is malformed: microbatch or chunk out of range, a chunk the microbatch
  does not pass through, a computation on a rank that does not hold its chunk, a
  transfer between chunks on one rank, or a peer that is not the other chunk's rank;
- sends and receives do not pair up one to one, in order, per channel;
- an action repeats (both B and I for one microbatch and chunk count as a repeat),
  or runs before its inputs on its rank: F j.c needs F j.c-1 (from this rank, or a
  RECV_FORWARD j.c-1 before it); B/I j.c needs F j.c and the gradient of chunk c+1
  (B/I j.c+1 here, or a RECV_BACKWARD j.c+1), except on the loss chunk; W j.c needs
  I j.c; a SEND needs the computation that produced its tensor;
- computations do not happen exactly once: per microbatch and chunk one F, and
  either one B or one I and one W;
- the run deadlocks (`DeadlockError`).

The loops are written for speed: p=64, m=256, v=2 is 2*10^5 actions.
"""

from __future__ import annotations

from collections import Counter

from fivedc.schedule.actions import Action, ActionKind as K, Schedule, ScheduleError
from fivedc.schedule.clock import DEFAULT_COSTS, execute, pair_transfers

F, B, I, W = K.FORWARD, K.BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT
SF, RF, SB, RB = K.SEND_FORWARD, K.RECV_FORWARD, K.SEND_BACKWARD, K.RECV_BACKWARD
_ON_OWN_CHUNK = frozenset({F, B, I, W, SF, SB})  # run by the rank holding the action's chunk
_TRANSFER = frozenset({SF, RF, SB, RB})


def check_schedule(schedule: Schedule) -> None:
    """Raise a `ScheduleError` (or `DeadlockError`) if `schedule` cannot run as written."""
    execute(schedule, DEFAULT_COSTS, pairs=check_static(schedule))


def check_static(schedule: Schedule) -> list[list[tuple[int, int] | None]]:
    """Everything `check_schedule` checks but the deadlock-finding run; returns the send of every receive."""
    for r, acts in enumerate(schedule.ranks):
        _check_actions(schedule, r, acts)
    pairs = pair_transfers(schedule)
    for r, acts in enumerate(schedule.ranks):
        _check_order(schedule, r, acts)
    # Actions are valid, on their chunk's rank, without duplicates and never both B and I;
    # so per rank the right number of F and of B-or-I means each ran exactly once.
    expected = schedule.v * schedule.m // schedule.pipelines
    for acts in schedule.ranks:
        kinds = Counter(a.kind for a in acts)
        if kinds[F] != expected or kinds[B] + kinds[I] != expected or kinds[W] != kinds[I]:
            _check_counts(schedule)
            raise ScheduleError(f"schedule {schedule.name}: a rank runs {kinds[F]} forwards, {kinds[B]} B, "
                                f"{kinds[I]} I and {kinds[W]} W; it should run {expected} forwards and as many "
                                f"backwards")  # not reached: _check_counts names the microbatch
    return pairs


def _error(s: Schedule, r: int, i: int, a: Action, msg: str, hint: str = "") -> ScheduleError:
    return ScheduleError(f"schedule {s.name}: rank {r} action {i} ({a}): {msg}", hint=hint)


def _check_actions(s: Schedule, r: int, acts: tuple[Action, ...]) -> None:
    n, m, pipes, place = s.num_chunks, s.m, s.pipelines, s.placement
    per = n // pipes
    for i, a in enumerate(acts):
        k, j, c = a.kind, a.microbatch, a.chunk
        if not (0 <= j < m and 0 <= c < n):
            raise _error(s, r, i, a, f"microbatch must be in 0..{m - 1} and chunk in 0..{n - 1}")
        if c // per != j * pipes // m:
            span = s.chunk_range(j)
            raise _error(s, r, i, a, f"microbatch {j} passes through chunks {span.start}..{span.stop - 1} only")
        if k in _ON_OWN_CHUNK and place[c] != r:
            raise _error(s, r, i, a, f"chunk {c} is on rank {place[c]}", hint=f"move it to rank {place[c]}'s list")
        if k in _TRANSFER:
            _check_transfer(s, r, i, a)
        elif a.peer is not None:
            raise _error(s, r, i, a, "a computation has no peer rank")


def _check_transfer(s: Schedule, r: int, i: int, a: Action) -> None:
    k, c = a.kind, a.chunk
    forward = k is SF or k is RF
    other = s.next_chunk(c) if forward else s.prev_chunk(c)
    if other is None:
        raise _error(s, r, i, a, f"chunk {c} has no {'next' if forward else 'previous'} chunk to exchange with")
    sender, receiver = s.placement[c], s.placement[other]
    me, peer = (sender, receiver) if k is SF or k is SB else (receiver, sender)
    if me != r or peer != a.peer or sender == receiver:
        raise _error(s, r, i, a, f"chunk {c} to chunk {other} is a transfer from rank {sender} to rank {receiver}",
                     hint="no transfer is needed between chunks on the same rank" if sender == receiver else
                     f"write it as {a.kind.value}{a.microbatch}.{c}{'>' if me == sender else '<'}{peer} "
                     f"on rank {me}")


def _check_counts(s: Schedule) -> None:
    """Name the first microbatch and chunk without exactly one forward and one backward."""
    count = Counter((a.kind, a.microbatch, a.chunk) for acts in s.ranks for a in acts)
    get = count.get
    for j in range(s.m):
        for c in s.chunk_range(j):
            f, b, i, w = get((F, j, c), 0), get((B, j, c), 0), get((I, j, c), 0), get((W, j, c), 0)
            if f == 1 and (b, i, w) in ((1, 0, 0), (0, 1, 1)):
                continue
            what = "forward F" if f != 1 else "backward (one B, or one I and one W)"
            raise ScheduleError(f"schedule {s.name}: microbatch {j} chunk {c} has no single {what}: "
                                f"F x{f}, B x{b}, I x{i}, W x{w}",
                                hint=f"rank {s.placement[c]} must run microbatch {j}'s forward and backward "
                                     f"of chunk {c} exactly once")


def _check_order(s: Schedule, r: int, acts: tuple[Action, ...]) -> None:
    """Every action's inputs were made on this rank (or received by it) earlier in its list."""
    done: set[tuple[K, int, int]] = set()
    local = [p == r for p in s.placement]
    per = s.num_chunks // s.pipelines
    for i, a in enumerate(acts):
        k, j, c = a.kind, a.microbatch, a.chunk
        key = (k, j, c)
        if key in done or (k is B and (I, j, c) in done) or (k is I and (B, j, c) in done):
            clash = (B, I) if k is B or k is I else (k,)
            first = next(n for n in range(i) if acts[n].kind in clash and (acts[n].microbatch, acts[n].chunk) == (j, c))
            raise _error(s, r, i, a, f"repeats action {first} ({acts[first]}): each runs once per microbatch "
                                     f"and chunk, and a backward is either B or I and W",
                         hint=f"remove one of them from rank {r}'s list")
        if k is F:
            if c % per and (((F if local[c - 1] else RF), j, c - 1) not in done):
                _missing(s, r, i, a, acts, ((F,) if local[c - 1] else (RF,)), c - 1)
        elif k is B or k is I:
            if (F, j, c) not in done:
                _missing(s, r, i, a, acts, (F,), c)
            if (c + 1) % per:
                needs = (B, I) if local[c + 1] else (RB,)
                if all((x, j, c + 1) not in done for x in needs):
                    _missing(s, r, i, a, acts, needs, c + 1)
        elif k is W:
            if (I, j, c) not in done:
                _missing(s, r, i, a, acts, (I,), c)
        elif k is SF:
            if (F, j, c) not in done:
                _missing(s, r, i, a, acts, (F,), c)
        elif k is SB:
            if (B, j, c) not in done and (I, j, c) not in done:
                _missing(s, r, i, a, acts, (B, I), c)
        done.add(key)


def _missing(s: Schedule, r: int, i: int, a: Action, acts: tuple[Action, ...], kinds: tuple[K, ...], c: int) -> None:
    j = a.microbatch
    later = [n for n in range(i + 1, len(acts))
             if acts[n].kind in kinds and (acts[n].microbatch, acts[n].chunk) == (j, c)]
    name = "/".join(k.value for k in kinds) + f"{j}.{c}"
    state = f"it comes later, at action {later[0]}" if later else "it is missing"
    raise _error(s, r, i, a, f"needs {name} before it on rank {r}, but {state}",
                 hint=f"run {name} before {a} on rank {r}")
