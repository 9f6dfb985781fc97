"""The IR: named dims, inputs, parameters, ops, repeat blocks, shardings, collectives.

A `Graph` is what both frontends (the DSL and torch.fx) produce and every pass
consumes and returns. Values are SSA names, unique across the whole graph. Tensor
dims are names from `Graph.dims` (`batch`, `seq`, `hidden`, ...), unique within a
tensor, so ops match dims by name: `linear(x, w)` contracts the trailing dims of `x`
that equal the leading dims of `w`.

`Repeat` keeps a layer stack as one body run `count` times: the body's parameters
exist once per layer (`layers.3.wq`), its `args` are bound to `carried` on the first
iteration and to its own `yields` afterwards, and `results` name the values after
the last iteration. The body may also read outer values it does not reassign.
Passes process a body once, so compile time does not grow with the layer count.

Fields left `None` by the frontend (types, shardings) are filled by passes; the
verifier (`passes/verify.py`) checks which must be set at which point.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Callable, Union

from fivedc.errors import SourceLoc
from fivedc.ir.limits import check_dim, check_layers
from fivedc.ir.mesh import Mesh, MeshAxis
from fivedc.ir.sharding import Sharding
from fivedc.ir.seq_layout import SeqLayout

Scalar = Union[bool, int, float, str]


class DType(StrEnum):
    FLOAT = "float"
    INT = "int"


class CollectiveKind(StrEnum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    SEND_RECV = "send_recv"
    SLICE = "slice"  # keeps this rank's chunk: a step of a redistribution, no communication


class Phase(StrEnum):
    FORWARD = "forward"
    BACKWARD = "backward"
    GRAD_SYNC = "grad_sync"  # after backward, before the optimizer step
    OPTIMIZER = "optimizer"  # after the optimizer step (ZeRO-1/2: gather the updated parameters)


@dataclass(frozen=True, slots=True)
class TensorType:
    dims: tuple[str, ...]
    dtype: DType = DType.FLOAT

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(self.dims)}]"


@dataclass(frozen=True, slots=True)
class Annotation:
    """`@col`, `@row`, `@replicate`, `@sp`, `@cp(ring)`, `@ep`, `@stage` as written.

    `@stage` on a top-level op: a pipeline chunk begins at that op (layers of a
    repeat are marked by `Repeat.stage_layers`)."""

    kind: str
    args: tuple[Scalar, ...] = ()
    loc: SourceLoc | None = None

    def __str__(self) -> str:
        return f"@{self.kind}" + (f"({', '.join(map(str, self.args))})" if self.args else "")


@dataclass(frozen=True, slots=True)
class Collective:
    """One collective the plan performs, with the reason it is there.

    `bytes` is the size of the full (unsplit) tensor the collective works on, as held
    by one group, per execution; `count` is the number of executions per step (a
    collective in a repeat body runs once per layer).
    """

    kind: CollectiveKind
    axes: tuple[MeshAxis, ...]
    phase: Phase
    tensor: str
    bytes: int
    reason: str
    dim: str | None = None
    count: int = 1
    loc: SourceLoc | None = None
    dim2: str | None = None  # all-to-all: the dim the chunks are concatenated along
    overlaps: str = ""  # the compute it runs alongside; "" when the next op waits for it


@dataclass(frozen=True, slots=True)
class Input:
    name: str
    type: TensorType
    loc: SourceLoc | None = None
    sharding: Sharding | None = None


PARAM_INITS = ("normal", "ones", "zeros")  # how a parameter starts (runtime/program.init_params)


@dataclass(frozen=True, slots=True)
class Param:
    name: str
    dims: tuple[str, ...]
    init: str = "normal"  # normal(std) | ones | zeros
    std: float = 0.02
    loc: SourceLoc | None = None
    sharding: Sharding | None = None
    grad_partial: tuple[MeshAxis, ...] = ()  # axes its gradient is summed over after backward


@dataclass(frozen=True, slots=True)
class ArgSpec:
    """What an op needs of one tensor argument: its sharding, and the mesh axes over
    which the op's gradient for it is a partial sum (the op's work is split over an
    axis that the argument is replicated over: a column-parallel linear's input)."""

    sharding: Sharding
    grad_partial: tuple[MeshAxis, ...] = ()
    # a parameter's use whose work is whole over axes its gradient is summed over (its other
    # use splits them: a tied table): this use's gradient counts on their first rank only
    grad_once: tuple[MeshAxis, ...] = ()


def _name(arg: str | float) -> str | None:
    """An op argument's name, None for a number literal: the one place that tells them apart."""
    return arg if isinstance(arg, str) else None


@dataclass(frozen=True, slots=True)
class Op:
    out: str
    kind: str
    args: tuple[str | float, ...]  # value names, parameter names, or number literals
    attrs: tuple[tuple[str, Scalar], ...] = ()
    annotations: tuple[Annotation, ...] = ()
    loc: SourceLoc | None = None
    type: TensorType | None = None
    sharding: Sharding | None = None  # of the output
    arg_specs: tuple[ArgSpec | None, ...] = ()  # per arg; None for number literals and ints
    collectives: tuple[Collective, ...] = ()  # performed inside the op's kernel

    def attr(self, name: str, default: Scalar | None = None) -> Scalar | None:
        for key, value in self.attrs:
            if key == name:
                return value
        return default

    def annotation(self, kind: str) -> Annotation | None:
        return next((a for a in self.annotations if a.kind == kind), None)

    def arg_sharding(self, index: int) -> Sharding:
        """How argument `index` is laid out where the op reads it (replicated when unset)."""
        spec = self.arg_specs[index] if self.arg_specs else None
        return spec.sharding if spec else Sharding()

    # ---- what the node reads and writes (every pass asks these, not by testing an arg's type) ----
    @property
    def reads(self) -> tuple[str, ...]:
        """The names of the values and parameters the op reads, in argument order (a name given
        twice is read twice); number literals left out."""
        return tuple(a for a in map(_name, self.args) if a is not None)

    @property
    def reads_at(self) -> tuple[tuple[int, str], ...]:
        """`reads` with each name's argument position: `(index, name)`."""
        return tuple((i, a) for i, a in enumerate(map(_name, self.args)) if a is not None)

    @property
    def arg_names(self) -> tuple[str | None, ...]:
        """Per argument, the name it reads, or None for a number literal (to zip with `args` or
        `arg_specs`)."""
        return tuple(map(_name, self.args))

    def read(self, index: int) -> str | None:
        """The name argument `index` reads; None where it is a number literal."""
        return _name(self.args[index])

    def map_reads(self, rename: Callable[[str], str]) -> tuple[str | float, ...]:
        """The args with each name `n` replaced by `rename(n)`, number literals as they are."""
        return tuple(a if (name := _name(a)) is None else rename(name) for a in self.args)

    @property
    def writes(self) -> tuple[str, ...]:
        return (self.out,)


@dataclass(frozen=True, slots=True)
class Redistribute:
    """Changes a value's sharding; inserted by communication insertion, never written.

    `forward` runs in the forward pass; `backward` is what autograd runs for its
    gradient (an all-gather's gradient is a reduce-scatter when the consumers
    produce partial gradients, and so on). `grad_partial` lists the axes over which
    the consumers of `out` produce summand gradients.
    """

    out: str
    src: str
    type: TensorType
    src_sharding: Sharding
    sharding: Sharding
    grad_partial: tuple[MeshAxis, ...]
    forward: tuple[Collective, ...]
    backward: tuple[Collective, ...]
    loc: SourceLoc | None = None

    @property
    def reads(self) -> tuple[str, ...]:
        return (self.src,)

    @property
    def writes(self) -> tuple[str, ...]:
        return (self.out,)


@dataclass(frozen=True, slots=True)
class Block:
    args: tuple[str, ...] = ()
    params: tuple[Param, ...] = ()
    items: tuple[Node, ...] = ()
    yields: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Repeat:
    name: str  # parameter prefix: `layers` gives `layers.0.wq`, ...
    count: int
    carried: tuple[str, ...]
    body: Block
    results: tuple[str, ...]
    loc: SourceLoc | None = None
    carried_shardings: tuple[Sharding, ...] = ()  # of the carried values on every iteration
    stage_layers: tuple[int, ...] = ()  # layers at which a pipeline chunk begins (marked by the user)
    recompute: str | None = None  # this stack's activation recomputation (`@recompute(full)`); None: the plan's

    @property
    def writes(self) -> tuple[str, ...]:
        """The values after the last layer (what the repeat defines in the block around it); what
        it reads is its `carried` values and `outer_reads(body)`."""
        return self.results


Node = Union[Op, Redistribute, Repeat]


@dataclass(frozen=True, slots=True)
class Graph:
    name: str
    dims: tuple[tuple[str, int], ...]
    inputs: tuple[Input, ...]
    body: Block  # top level: no args; yields the loss
    batch_dim: str
    seq_dim: str | None = None
    annotations: tuple[Annotation, ...] = ()
    source: str = ""  # file the model came from
    loc: SourceLoc | None = None
    seq_layout: SeqLayout = SeqLayout.CONTIGUOUS  # over cp; chosen by the sequence-split pass
    model_file: str = ""  # the file compiled (a .5d, or the file.py of file.py:factory), as given
    model_hash: str = ""  # sha256:HEX of its bytes at compile (fivedc/cli/model_source.py)
    dim_locs: tuple[tuple[str, SourceLoc], ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        """Sizes within what fivedc plans for (`fivedc/ir/limits.py`): a model's and a plan file's."""
        for name, size in self.dims:
            if isinstance(size, int):
                check_dim(name, size, loc=self.dim_loc(name))
        repeats = [node for node, _ in walk_ops(self.body) if isinstance(node, Repeat)]
        if repeats:
            check_layers(sum(r.count for r in repeats if isinstance(r.count, int)),
                         loc=max(repeats, key=lambda r: r.count if isinstance(r.count, int) else 0).loc)

    def dim(self, name: str) -> int:
        for key, value in self.dims:
            if key == name:
                return value
        raise KeyError(name)

    def local_size(self, dim: str, sharding: Sharding, mesh: Mesh) -> int:
        """Size of one rank's chunk of `dim` when `sharding` splits it over `mesh`."""
        return self.dim(dim) // mesh.size(*sharding.axes_of(dim))

    def local_numel(self, dims: tuple[str, ...], sharding: Sharding, mesh: Mesh) -> int:
        return math.prod(self.local_size(d, sharding, mesh) for d in dims)

    def dim_loc(self, name: str) -> SourceLoc | None:
        return dict(self.dim_locs).get(name)

    def annotation(self, kind: str) -> Annotation | None:
        return next((a for a in self.annotations if a.kind == kind), None)

    @property
    def output(self) -> str:
        return self.body.yields[0]


def walk_ops(block: Block):
    """Every node of a block and of its repeat bodies, with the repeat it sits in."""
    for item in block.items:
        yield item, None
        if isinstance(item, Repeat):
            for inner, _ in walk_ops(item.body):
                yield inner, item


def readers(block: Block) -> dict[str, list[tuple[Op | Redistribute, int]]]:
    """Each name the ops and redistributions of a block (and of its repeats' bodies) read ->
    `(node, argument position)` of every read, in program order (a redistribution reads its
    source at 0)."""
    out: dict[str, list[tuple[Op | Redistribute, int]]] = {}
    for node, _ in walk_ops(block):
        if isinstance(node, Op):
            for index, name in node.reads_at:
                out.setdefault(name, []).append((node, index))
        elif isinstance(node, Redistribute):
            out.setdefault(node.src, []).append((node, 0))
    return out


def outer_reads(block: Block) -> set[str]:
    """The names the nodes of a block (and of its repeats' bodies) read and do not define: the
    block's args, values of the scope around it, parameters (a repeat reads its `carried` and
    defines its `results` and its body's args)."""
    read: set[str] = set()
    defined: set[str] = set()
    for node, _ in walk_ops(block):
        if isinstance(node, (Op, Redistribute)):
            read.update(node.reads)
        else:
            read.update(node.carried)
            defined.update(node.body.args)
        defined.update(node.writes)
    return read - defined


def walk_params(block: Block):
    """Every parameter with the repeat that owns it (None at top level)."""
    for param in block.params:
        yield param, None
    for item in block.items:
        if isinstance(item, Repeat):
            for param, _ in walk_params(item.body):
                yield param, item


def param_instances(graph: Graph):
    """Every parameter instance with its qualified name (`wte`, `layers.0.wq`, ...)."""
    for param in graph.body.params:
        yield param.name, param
    for item in graph.body.items:
        if isinstance(item, Repeat):
            for i in range(item.count):
                for param in item.body.params:
                    yield f"{item.name}.{i}.{param.name}", param
