"""What every pass shares: the compile options, and the `Pass` protocol.

A pass is a small frozen dataclass with a `name` and a `run(graph, options)` that
returns a new graph; it never mutates its input and never imports
`torch.distributed`. `fivedc/pipeline.py` lists the passes in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

from fivedc.errors import FivedcError
from fivedc.ir.hardware import Hardware
from fivedc.ir.graph import Graph
from fivedc.ir.limits import check_microbatches
from fivedc.ir.mesh import Mesh, MeshAxis
from fivedc.passes.recompute import check_mode, model_mode
from fivedc.schedule import DEFAULT_SCHEDULE, SCHEDULES, schedule_kind
from fivedc.ir.seq_layout import SeqLayout

DTYPE_BYTES = {"fp64": 8, "fp32": 4, "bf16": 2, "fp16": 2}
CP_VARIANTS = ("ring", "allgather")  # how attention spans the cp axis (passes/context.py)
CP_LAYOUTS = tuple(str(layout) for layout in SeqLayout)
ATTENTION_KERNELS = ("flash", "flash2", "math")  # passes/attention_kernel.py
ZERO_STAGES = (0, 1, 2, 3)
DEFAULT_BUCKET_MB = 25.0  # gradient bucket size: PyTorch DDP's default


@dataclass(frozen=True, slots=True)
class CompileOptions:
    """Everything that changes a plan besides the model itself."""

    mesh: Mesh
    sequence_parallel: bool | None = None  # None: the model's @sp annotation decides
    dtype: str = "bf16"  # training precision of parameters and activations
    cp_attention: str | None = None  # None: the model's @cp(...) decides, else ring
    cp_layout: str | None = None  # None: the model's @cp(...) decides, else balanced if causal
    zero: int = 0  # ZeRO stage over each parameter's data-parallel group: 0 (off), 1, 2, 3
    overlap: bool = True  # gradient buckets reduced during backward; ZeRO-3 parameter prefetch
    bucket_mb: float = DEFAULT_BUCKET_MB  # gradient bucket size in MiB
    schedule: str = DEFAULT_SCHEDULE  # pipeline schedule (fivedc/schedule/), for pp > 1
    microbatches: int | None = None  # per step; None: max(pp, the schedule's least)
    virtual: int | None = None  # chunks per pp rank; None: the schedule's (interleaved: 2)
    pp_layout: tuple[int, ...] | None = None  # layers per chunk; None: balanced by cost
    recompute: str | None = None  # activation recomputation (passes/recompute.py); None: the model's @recompute, else none
    attention_kernel: str | None = None  # flash | math where the model's attention does not say; None: flash
    hardware: Hardware | None = None  # the GPU the step-time model and the fit check assume (fivedc/ir/hardware.py)
    fp8: bool = False  # linears' three matmuls in float8, torchao's tensorwise recipe (passes/fp8.py)

    def __post_init__(self) -> None:
        for what, value, choices in (
            ("dtype", self.dtype, tuple(DTYPE_BYTES)),
            ("cp attention variant", self.cp_attention, CP_VARIANTS),
            ("cp layout", self.cp_layout, CP_LAYOUTS),
            ("attention kernel", self.attention_kernel, ATTENTION_KERNELS),
        ):
            if value is not None and value not in choices:
                raise FivedcError(f"unknown {what} {value!r}", hint=f"choose one of {', '.join(choices)}")
        if not (isinstance(self.bucket_mb, (int, float)) and 0 < self.bucket_mb < 2**40):
            raise FivedcError(f"bucket size {self.bucket_mb} MiB must be > 0 and finite (below 2^40 MiB)",
                              hint="e.g. --bucket-mb 25")
        if self.schedule not in SCHEDULES:
            raise FivedcError(f"unknown pipeline schedule {self.schedule!r}", hint=f"choose one of {', '.join(SCHEDULES)}")
        for what, value in (("microbatches", self.microbatches), ("virtual stages per rank", self.virtual)):
            if value is not None and (not _is_int(value) or value < 1):
                raise FivedcError(f"{what} {value!r} must be an integer >= 1",
                                  hint="e.g. --microbatches 8" if what == "microbatches" else "e.g. --virtual 2")
        if self.microbatches is not None:
            per_rank = schedule_kind(self.schedule).per_rank(self.virtual)
            check_microbatches(self.microbatches, chunks=self.mesh.size(MeshAxis.PP) * per_rank)
        if self.pp_layout is not None and (not self.pp_layout or not all(_is_int(n) and n >= 0 for n in self.pp_layout)):
            raise FivedcError(f"pipeline layout {self.pp_layout} must be layer counts >= 0, one per chunk",
                              hint="e.g. --pp-layout 3,5,5,3")
        if self.recompute is not None:
            check_mode(self.recompute)
        if self.fp8 and self.hardware is not None and self.hardware.fp8_flops is None:
            raise FivedcError(f"--fp8: the {self.hardware.key} profile ({self.hardware.name}) has no float8 tensor "
                              "cores (no fp8_flops)", hint="drop --fp8, or choose a GPU with them (h100, h800, h200)")
        if self.zero not in ZERO_STAGES:
            raise FivedcError(
                f"unknown ZeRO stage {self.zero}",
                hint="choose 1 (optimizer state), 2 (+ gradients), 3 (+ parameters), or 0 for none",
            )

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * 2**20))

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def sp_enabled(self, graph: Graph) -> bool:
        if self.sequence_parallel is not None:
            return self.sequence_parallel
        return graph.annotation("sp") is not None

    def recompute_mode(self, graph: Graph) -> str:
        """none, selective or full: the option, else the model's `@recompute(...)`, else none."""
        return self.recompute if self.recompute is not None else model_mode(graph)

    @property
    def data_axes(self) -> tuple[MeshAxis, ...]:
        """Axes that split the batch of every non-expert layer (DESIGN.md: dp and ep)."""
        return (MeshAxis.DP, MeshAxis.EP)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Pass(Protocol):
    name: ClassVar[str]
    purpose: ClassVar[str]  # one line, listed by `fivedc compile --passes`

    def run(self, graph: Graph, options: CompileOptions) -> Graph: ...
