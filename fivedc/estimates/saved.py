"""What each op keeps for backward: one save rule per op kind, as the runtime's kernels save
(a pointwise op's: the rule its definition's `saves` names, fivedc/ir/pointwise.py).

An op's rule lists `Saved` tensors for one microbatch on one rank: a value it keeps
(an input or its output, by name, so two ops keeping the same tensor count it once,
as autograd keeps one storage), a buffer of its own (the log-sum-exp of attention,
a norm's statistics, the log-softmax of a loss), or a constant every microbatch
shares (RoPE's tables, cached by the kernel). Parameters and the model's inputs
are never counted: they are held whatever backward needs. What the kernels of
`runtime/kernels.py`'s table save, and so what the rules say (tests/test_saved.py measures
each kernel with saved-tensor hooks against its rule):

    linear, matmul   x (a weight stored [out, in] also: its transposed copy)
    mul, div         the operands the other's gradient needs
    gelu, silu       x                relu, tanh, sigmoid   the output
    swiglu           gate and up (silu(gate) is recomputed in backward)
    rmsnorm          x and 1/rms per row            layernorm  x, mean and 1/std per row
    rope             the cos and sin tables (a constant)
    attention        q, k, v, the output and the log-sum-exp per query row (flash-style:
                     no s x s scores; grouped-query K/V are not repeated)
    cross_entropy    the (log-)softmax of the logits, the targets, the mask of counted ones
    embedding        vocab-parallel: the local indices and the in-range mask
    moe              routing scores and choices, the routed rows, the experts' inner
                     activations and the rows sent back (balanced routing assumed)
    add, sub, aten   nothing (add, sub); an aten op its tensor arguments

Sequence parallelism as Megatron runs it: the all-gathered input of a column-parallel
linear is not kept; the linear keeps the sequence shard and gathers it again in
backward (`fivedc/passes/regather.py`; `runtime/saved.py` does it, the plan lists the extra
all-gather). So a GPT layer keeps 32·s·b·h/t bytes in 16-bit training, Megatron's
34·s·b·h/t less its two dropout masks (fivedc has no dropout), plus the
log-sum-exp and the norms' statistics (tests/test_activations.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fivedc.ir.graph import CollectiveKind, Graph, Op, Redistribute, Repeat, TensorType, DType, walk_ops, walk_params
from fivedc.ir.mesh import Mesh
from fivedc.ir.ops import POINTWISE
from fivedc.ir.pointwise import Saves
from fivedc.passes.attention_kernel import kernel_of
from fivedc.passes.fp8 import SCALAR_BYTES as FP8_SCALE_BYTES, is_fp8
from fivedc.instructions.done_again import DoneAgain, read_done_again
from fivedc.ir.sharding import Sharding

LOW_PRECISION = ("bf16", "fp16")  # their kernels keep statistics in float32
INDEX_BYTES = 8  # int64 indices
VALUE, OWN, CONSTANT = "value", "own", "constant"


@dataclass(frozen=True, slots=True)
class Saved:
    """One tensor kept for backward: `key` is a value's name (VALUE), `op:what` (OWN), or
    a key shared by every op and microbatch using the same constant (CONSTANT)."""

    key: str
    bytes: int
    kind: str = VALUE


@dataclass(frozen=True)
class SaveContext:
    """Sizes of values on one rank for one microbatch, and which names are not activations."""

    graph: Graph
    mesh: Mesh
    dtype: str
    dtype_bytes: int
    microbatches: int = 1
    layouts: dict = field(default_factory=dict)  # name -> (TensorType, Sharding)
    params: frozenset[str] = frozenset()
    inputs: frozenset[str] = frozenset()
    # what backward does again, read from the instruction lists: the ops and layers it recomputes,
    # and SP's gathered values, kept as their shard (`fivedc/instructions/done_again.py`)
    again: DoneAgain = field(default_factory=DoneAgain)
    param_dims: dict = field(default_factory=dict)  # parameter name -> its dims
    _sizes: dict = field(default_factory=dict, init=False, compare=False, repr=False)  # numel by (dims, sharding)

    @staticmethod
    def of(graph: Graph, mesh: Mesh, *, dtype: str, dtype_bytes: int, microbatches: int = 1,
           recompute: str = "none", again: DoneAgain | None = None) -> SaveContext:
        """`again`: what the instruction lists under `recompute` do again (read here if not given)."""
        params = frozenset(p.name for p in graph.body.params) | frozenset(
            p.name for node, _ in walk_ops(graph.body) if isinstance(node, Repeat) for p in node.body.params)
        again = again if again is not None else read_done_again(graph, mesh, recompute=recompute, dtype=dtype)
        return SaveContext(graph, mesh, dtype, dtype_bytes, microbatches, value_layouts(graph), params,
                           frozenset(i.name for i in graph.inputs), again,
                           {p.name: p.dims for p, _ in walk_params(graph.body)})

    @property
    def regathered(self) -> dict[str, str]:
        """SP's gathered values that backward gathers again -> the shard kept in each one's place."""
        return self.again.gathered

    @property
    def compute_bytes(self) -> int:
        """Bytes of a statistic a kernel keeps (float32 in 16-bit training)."""
        return 4 if self.dtype in LOW_PRECISION else self.dtype_bytes

    def numel(self, dims: tuple[str, ...], sharding: Sharding | None) -> int:
        """Elements on one rank for one microbatch (the batch dim divided by the microbatches)."""
        key = (dims, sharding)
        try:
            return self._sizes[key]
        except KeyError:
            n = self.graph.local_numel(dims, sharding or Sharding(), self.mesh)
            n = self._sizes[key] = n // self.microbatches if self.graph.batch_dim in dims else n
            return n

    def value_numel(self, name: str) -> int:
        t, sharding = self.layouts[name]
        return self.numel(t.dims, sharding)

    def value_bytes(self, name: str) -> int:
        t, _ = self.layouts[name]
        return self.value_numel(name) * (INDEX_BYTES if t.dtype == DType.INT else self.dtype_bytes)

    def value(self, name: str | None) -> list[Saved]:
        """The value `name` kept: nothing for None (a number literal: `Op.read`), a parameter or
        an input; a gathered value that is gathered again in backward is kept as its shard."""
        if name is None or name in self.params or name in self.inputs or name not in self.layouts:
            return []
        name = self.regathered.get(name, name)
        return [Saved(name, self.value_bytes(name))]

    def value_args(self, op: Op) -> list[Saved]:
        """The op's tensor arguments as kept values (what a recomputed region's checkpoint holds)."""
        return [s for name in op.reads for s in self.value(name)]

    def own(self, op: Op, what: str, nbytes: int) -> Saved:
        return Saved(f"{op.out}:{what}", nbytes, OWN)

    def rows(self, op: Op, trailing: int = 1) -> int:
        """The output's elements without its last dim, or last `trailing` (a norm's or loss's rows)."""
        dims = op.type.dims
        return self.numel(dims[:-trailing], op.sharding) if dims else 1


def value_layouts(graph: Graph) -> dict[str, tuple[TensorType, Sharding]]:
    """Type and sharding of every value: inputs, op and redistribution outputs, repeat
    body arguments (as the carried value) and results."""
    out = {i.name: (i.type, i.sharding or Sharding()) for i in graph.inputs}
    for node, _ in walk_ops(graph.body):
        if isinstance(node, (Op, Redistribute)):
            out[node.out] = (node.type, node.sharding or Sharding())
    for node, _ in walk_ops(graph.body):
        if isinstance(node, Repeat):
            for arg, carried, result, i in zip(node.body.args, node.carried, node.results, range(len(node.results))):
                t = out[carried][0]
                sharding = node.carried_shardings[i] if i < len(node.carried_shardings) else out[carried][1]
                out[arg] = out[result] = (t, sharding)
    return out


# ---- the rules ----------------------------------------------------------------------------
def _nothing(c: SaveContext, op: Op) -> list[Saved]:
    return []


def _input(index: int):
    return lambda c, op: c.value(op.read(index))


def _output(c: SaveContext, op: Op) -> list[Saved]:
    return c.value(op.out)


def _linear(c: SaveContext, op: Op) -> list[Saved]:
    x, w = op.args[0], op.args[1]
    saved = c.value(x) if w in c.params or _requires_grad(c, w) else []
    if w not in c.params:
        return saved + (c.value(w) if _requires_grad(c, x) else [])
    x_dims = c.layouts[x][0].dims
    k = len([d for d in x_dims if d not in op.type.dims])
    w_dims = _param_dims(c.graph, w)
    if tuple(w_dims[:k]) != tuple(x_dims[-k:]):  # stored [out, in]: tensordot keeps a transposed copy
        sharding = op.arg_specs[1].sharding if op.arg_specs and op.arg_specs[1] else Sharding()
        saved.append(c.own(op, "weight^T", c.graph.local_numel(w_dims, sharding, c.mesh) * c.dtype_bytes))
    if is_fp8(op):  # float8 (passes/fp8.py): the forward's scales of x and w, one float32 each
        saved.append(c.own(op, "fp8 scales", 2 * FP8_SCALE_BYTES))
    return saved


def _mul(c: SaveContext, op: Op) -> list[Saved]:
    a, b = op.read(0), op.read(1)
    return (c.value(a) if _requires_grad(c, b) else []) + (c.value(b) if _requires_grad(c, a) else [])


def _div(c: SaveContext, op: Op) -> list[Saved]:
    a, b = op.read(0), op.read(1)
    keep_b = b is not None and (_requires_grad(c, a) or _requires_grad(c, b))
    return (c.value(a) if _requires_grad(c, b) else []) + (c.value(b) if keep_b else [])


def _requires_grad(c: SaveContext, name: str | None) -> bool:
    """Everything but numbers (None: `Op.read`) and the model's inputs carries a gradient here."""
    return name is not None and name not in c.inputs


def _norm(statistics: int):
    def rule(c: SaveContext, op: Op) -> list[Saved]:
        rows = c.rows(op, len(c.param_dims.get(op.args[1], ())) or 1)  # over the weight's dims
        return c.value(op.args[0]) + [c.own(op, "stats", statistics * rows * c.compute_bytes)]
    return rule


def _rope(c: SaveContext, op: Op) -> list[Saved]:
    t, _ = c.layouts[op.args[0]]
    sharding = op.arg_specs[0].sharding if op.arg_specs and op.arg_specs[0] else Sharding()
    seq = c.graph.seq_dim
    positions = c.graph.local_size(seq, sharding, c.mesh) if seq in t.dims else 1
    half = c.graph.local_size(t.dims[-1], sharding, c.mesh) // 2
    key = f"rope:{sharding}:{op.attr('theta', 10000.0)}:{op.attr('freqs', '')}:{','.join(t.dims)}"
    return [Saved(key, 2 * positions * half * c.dtype_bytes, CONSTANT)]


def _attention(c: SaveContext, op: Op) -> list[Saved]:
    """q, k, v, the output and the log-sum-exp per (batch, head, query row); the `math`
    kernel keeps the softmax's output instead, every score (batch x heads x sq x sk)."""
    rows = c.numel(op.type.dims[:-1], op.sharding)
    kept = c.own(op, "lse", rows * c.compute_bytes)
    if kernel_of(op) == "math":
        kept = c.own(op, "softmax", score_elements(c, op) * c.dtype_bytes)
    return [s for i in range(3) for s in c.value(op.read(i))] + c.value(op.out) + [kept]


def score_elements(c: SaveContext, op: Op) -> int:
    """An attention's scores on one rank for one microbatch: every query row on the rank
    (batch x seq x heads) against every key of the sequence (a ring brings the rest a
    block at a time)."""
    return c.numel(op.type.dims[:-1], op.sharding) * c.graph.dim(c.graph.seq_dim)


def _cross_entropy(c: SaveContext, op: Op) -> list[Saved]:
    """The (log-)softmax, as large as the logits in float32 at least (the loss of 16-bit logits is
    computed in float32, as autocast and Megatron do); per token the targets (int64; clamped,
    or the local index), the counted mask; vocab-parallel also the in-range mask; the
    local loss keeps nll's total weight, a scalar."""
    logits, targets = op.args[0], op.args[1]
    tokens = c.value_numel(targets)
    vocab = c.layouts[logits][0].dims[-1]
    split = op.arg_specs and op.arg_specs[0] and op.arg_specs[0].sharding.axes_of(vocab) and \
        c.mesh.size(*op.arg_specs[0].sharding.axes_of(vocab)) > 1
    saved = [c.own(op, "softmax", c.value_numel(logits) * c.compute_bytes),  # 16-bit logits: in float32
             c.own(op, "targets", tokens * INDEX_BYTES), c.own(op, "counted", tokens * c.compute_bytes)]
    return saved + [c.own(op, "in range", tokens) if split else c.own(op, "total weight", c.dtype_bytes)]


def _embedding(c: SaveContext, op: Op) -> list[Saved]:
    tokens = c.value_numel(op.args[0])
    vocab = _param_dims(c.graph, op.args[1])[0]
    sharding = op.arg_specs[1].sharding if op.arg_specs and op.arg_specs[1] else Sharding()
    saved = c.value(op.args[0])
    if sharding.axes_of(vocab) and c.mesh.size(*sharding.axes_of(vocab)) > 1:
        saved += [c.own(op, "indices", tokens * INDEX_BYTES), c.own(op, "in range", tokens * c.dtype_bytes)]
    if op.attr("padding_idx") is not None:
        saved.append(c.own(op, "padding", tokens))
    return saved


def _aten(c: SaveContext, op: Op) -> list[Saved]:
    return [s for name in op.reads if _requires_grad(c, name) for s in c.value(name)]


def _moe(c: SaveContext, op: Op) -> list[Saved]:
    """runtime/moe.py on T local tokens, R = T x top_k routed rows (dropless, balanced: a
    rank receives as many as it sends): x (the router's input); the scores [T, E]; the
    chosen experts [T, k] (int64); the gates and their sum, normalised; the routed
    rows' order and tokens [R] (int64); the rows the experts receive [R, hidden] and
    their inner activations (SwiGLU: gate, silu, up and product, 4 x [R, ffn]; GELU:
    2), the rows sent back and the same times their gates [R, hidden] each, and the
    gates [R]; with an auxiliary loss the batch's share per expert [E]. Rows from several
    ep ranks are grouped by expert and back: two more index vectors [R]; a hierarchical
    all-to-all permutes twice and back: 4."""
    x, router, weights = op.args[0], op.args[1], op.args[2:]
    hidden = c.layouts[x][0].dims[-1]
    tokens = c.value_numel(x) // c.graph.dim(hidden)
    experts = c.graph.dim(next(d for d in _param_dims(c.graph, router) if d != hidden))
    w_dims = _param_dims(c.graph, weights[0])
    ffn = next(d for d in w_dims[1:] if d != hidden)
    spec = op.arg_specs[2].sharding if op.arg_specs and op.arg_specs[2] else Sharding()
    ffn_local, k = c.graph.local_size(ffn, spec, c.mesh), int(op.attr("top_k", 2))
    rows, b, i = tokens * k, c.dtype_bytes, INDEX_BYTES
    saved = c.value(x) + [c.own(op, "scores", tokens * experts * b), c.own(op, "chosen", tokens * k * i),
                          c.own(op, "order", 2 * rows * i), c.own(op, "rows", rows * c.graph.dim(hidden) * b),
                          c.own(op, "experts", (4 if len(weights) == 3 else 2) * rows * ffn_local * b),
                          c.own(op, "back", rows * (2 * c.graph.dim(hidden) + 1) * b)]
    if op.attr("normalize", True) and k > 1:
        saved.append(c.own(op, "gates", tokens * (k + 1) * b))
    if float(op.attr("capacity_factor", 0.0) or 0.0) > 0:
        saved.append(c.own(op, "kept", rows * i))
    if float(op.attr("aux_loss", 0.0) or 0.0) > 0:
        saved.append(c.own(op, "share", experts * b))
    a2a = next((col for col in op.collectives if col.kind == CollectiveKind.ALL_TO_ALL), None)
    if a2a is not None and c.mesh.size(*a2a.axes) > 1:
        hierarchical = op.annotation("ep") is not None and "hierarchical" in map(str, op.annotation("ep").args)
        saved.append(c.own(op, "grouped", (2 + 4 * hierarchical) * rows * i))
    return saved


# A pointwise op's rule is its definition's `saves` (fivedc/ir/pointwise.py), priced here.
POINTWISE_SAVES = {Saves.NOTHING: _nothing, Saves.INPUT: _input(0), Saves.OUTPUT: _output,
                   Saves.OTHER_OPERAND: _mul, Saves.QUOTIENT_OPERANDS: _div}

SAVE_RULES = {
    **{kind: POINTWISE_SAVES[pointwise.saves] for kind, pointwise in POINTWISE.items()},
    "linear": _linear, "matmul": _linear, "state_add": _nothing,
    "swiglu": lambda c, op: c.value(op.args[0]) + c.value(op.args[1]),
    "rmsnorm": _norm(1), "layernorm": _norm(2), "rope": _rope, "attention": _attention,
    "cross_entropy": _cross_entropy, "embedding": _embedding, "moe": _moe, "aten": _aten,
}


def op_saves(c: SaveContext, op: Op) -> list[Saved]:
    """What `op` keeps for backward (one microbatch, one rank)."""
    return SAVE_RULES[op.kind](c, op)


def _param_dims(graph: Graph, name: str) -> tuple[str, ...]:
    for node, _ in walk_ops(graph.body):
        if isinstance(node, Repeat):
            for p in node.body.params:
                if p.name == name:
                    return p.dims
    return next(p.dims for p in graph.body.params if p.name == name)
