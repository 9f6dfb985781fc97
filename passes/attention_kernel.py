"""Which kernel computes each attention: `flash`, `flash2` or `math`, recorded on the op.

flash (the default): one fused kernel; the scores live in on-chip memory a tile at a
time and are never held (FlashAttention, torch's SDPA on a GPU). flash2: the same, pinned
to FlashAttention-2 (SDPA's flash backend, as torchtitan pinned it), which on Hopper reaches
less of the peak than the fused kernel SDPA picks there (`Hardware.attention_share`); it
keeps what flash keeps. math: the scores are
materialised: q k^T, the softmax and p v run as separate kernels through HBM, and the
softmax output p (batch x heads x sq x sk) is kept for backward (Megatron-LM before
flash attention; torch's SDPA math backend). The step-time model prices each kernel
(`fivedc/estimates/attention_cost.py`), the memory model keeps p, and the runtime runs
the kernel the op names. `--attention-kernel` sets it where the model's call does not
(`attention(q, k, v, kernel="math")` wins).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from fivedc.errors import NotSupportedError
from fivedc.ir.graph import Block, Graph, Op, Repeat
from fivedc.passes.base import ATTENTION_KERNELS, CompileOptions


@dataclass(frozen=True, slots=True)
class ChooseAttentionKernel:
    name: ClassVar[str] = "attention-kernel"
    purpose: ClassVar[str] = "each attention's kernel: flash or flash2 (scores never held), or math (scores kept)"

    def run(self, graph: Graph, options: CompileOptions) -> Graph:
        return replace(graph, body=_choose(graph.body, options.attention_kernel))


def _choose(block: Block, kernel: str | None) -> Block:
    items = []
    for item in block.items:
        if isinstance(item, Repeat):
            item = replace(item, body=_choose(item.body, kernel))
        elif isinstance(item, Op) and item.kind == "attention":
            item = _kernel_of(item, kernel)
        items.append(item)
    return replace(block, items=tuple(items))


def _kernel_of(op: Op, kernel: str | None) -> Op:
    given = op.attr("kernel")
    if given is not None and given not in ATTENTION_KERNELS:
        raise NotSupportedError(f"attention kernel {given!r} is not a kernel fivedc has",
                            loc=op.loc, hint=f"choose one of {', '.join(ATTENTION_KERNELS)}")
    if given is not None or kernel in (None, "flash"):
        return op  # no attribute: flash
    return replace(op, attrs=(*op.attrs, ("kernel", kernel)))


def kernel_of(op: Op) -> str:
    """The kernel an attention op runs with."""
    return str(op.attr("kernel", "flash"))
