"""The store a torchrun rank joins its process group through, fresh for each restart of the job.

torchrun's agent (c10d rendezvous, the default since torch 2.5) keeps one TCPStore for
every round of a job and hands the same MASTER_ADDR:MASTER_PORT to each restart
(`TORCHELASTIC_USE_AGENT_STORE=True`), with the keys of the attempt before still in it:
a restarted rank can read a dead peer's address and fail to connect (measured: two of
three restarts of a plain `init_process_group("gloo", "env://")` failed so here, one
after a two-minute hang; pytorch/pytorch#135712). `launcher_store` puts each attempt's
keys under its own prefix, `fivedc-attempt-N/` for torchrun's `TORCHELASTIC_RESTART_COUNT`.
That count is each node's own, and nodes that restart because another one failed do not
count it, so across nodes the prefix could differ: a job on several nodes that may
restart must let each round make its own store (`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`,
then no prefix is needed), and is refused with that hint otherwise.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from fivedc.errors import MeshError

SHARE_OFF = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def launcher_store(rank: int, world: int, timeout: timedelta):
    """A store for `init_process_group` (None: the plain env:// rendezvous serves)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None  # not torchrun's shared store: a fresh one each round (or no torchrun at all)
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if nodes > 1 and restarts > 0:
        raise MeshError(f"torchrun restarts this job on {nodes} nodes through one store for every round, where "
                        "a restarted rank can read the last round's addresses (pytorch/pytorch#135712)",
                        hint=f"set {SHARE_OFF}=1 for torchrun on every node: each round then makes its own store")
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"fivedc-attempt-{attempt}/", store)


__all__ = ["SHARE_OFF", "launcher_store"]
