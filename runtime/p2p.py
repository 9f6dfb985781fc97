"""One hop around a ring of ranks: send a tensor to the next member, receive its like from the previous.

Ring attention passes K/V blocks (and their gradients) this way over cp
(`runtime/attention_ring.py`); a gather the plan runs in a ring passes the chunks of a
tensor over tp (`runtime/tp_ring.py`). Both post the send and the receive
together (`batch_isend_irecv`) and wait for them when the received tensor is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True, slots=True)
class Transfer:
    """Sends and receives in flight; holds the tensor being sent until they are done."""

    sent: Tensor | None
    requests: tuple[Any, ...]

    def wait(self) -> None:
        for request in self.requests:
            request.wait()


NOTHING = Transfer(None, ())


def exchange(send: Tensor, *, next_rank: int, prev_rank: int, group: Any, tag: int) -> tuple[Tensor, Transfer]:
    """Start sending `send` to global rank `next_rank` and receiving its like from `prev_rank`
    (members of `group`); the tensor that will be received, and the transfer to wait for."""
    received = torch.empty_like(send)
    ops = [dist.P2POp(dist.isend, send, next_rank, group, tag),
           dist.P2POp(dist.irecv, received, prev_rank, group, tag)]
    return received, Transfer(send, tuple(dist.batch_isend_irecv(ops)))
