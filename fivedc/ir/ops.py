"""The op vocabulary: every op kind, its arguments, its attrs with defaults, and its family.

Frontends check calls against this table (an unknown op or keyword is a DSL error
at the call's position). An op's `family` names the shape rule and the sharding rule it
shares with its kin (linear and matmul; add, sub, mul, div; the five activations; the two
norms): `passes/shapes.py` and `passes/rules.py` each hold one rule per family
and read their per-kind table from this one (`by_family`, which fails at import when a
family has no rule). A pointwise op (the activation and elementwise families) is defined
here whole. Its `Pointwise` (`fivedc/ir/pointwise.py`) names the torch function of its kernel,
what its backward saves, and what the fx frontend reads as it. The kernels
(`runtime/kernels.py`), save rules (`fivedc/estimates/saved.py`), the fx frontend's names
and the kind sets that list pointwise ops are built from `POINTWISE`. The other ops' kernels
and save rules are per kind. `tests/test_op_tables.py` holds every table to the kinds here;
docs/adding-an-op.md walks through adding one.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Mapping, TypeVar

from fivedc.ir.graph import Scalar
from fivedc.ir.pointwise import Pointwise, Saves


class OpFamily(StrEnum):
    """Ops that share their shape and sharding rules."""

    EMBEDDING = "embedding"
    LINEAR = "linear"  # linear, matmul: a contraction with a weight
    ELEMENTWISE = "elementwise"  # a op b, b broadcast by dim name or a number
    UNARY = "unary"  # an activation: same dims, same sharding
    STATE_ADD = "state_add"  # same dims as its argument, which it needs whole
    SWIGLU = "swiglu"
    NORM = "norm"
    ROPE = "rope"
    ATTENTION = "attention"
    CROSS_ENTROPY = "cross_entropy"
    MOE = "moe"
    ATEN = "aten"


POINTWISE_FAMILIES = {OpFamily.UNARY: 1, OpFamily.ELEMENTWISE: 2}  # families of pointwise ops, and their arity


@dataclass(frozen=True, slots=True)
class OpSpec:
    kind: str
    args: tuple[str, ...]  # argument names, for messages
    min_args: int
    attrs: tuple[tuple[str, Scalar], ...] = ()  # keyword attributes and their defaults
    doc: str = ""
    variadic: bool = False  # any number of arguments (aten)
    family: OpFamily | None = None  # None: UNARY or ELEMENTWISE for a pointwise op, else the one named as the kind
    pointwise: Pointwise | None = None  # a pointwise op's own facts: kernel, save rule, fx names

    def __post_init__(self) -> None:
        if self.family is None:
            pointwise_family = OpFamily.UNARY if len(self.args) == 1 else OpFamily.ELEMENTWISE
            object.__setattr__(self, "family", pointwise_family if self.pointwise else OpFamily(self.kind))
        if (self.pointwise is not None) != (self.family in POINTWISE_FAMILIES):
            raise TypeError(f"op {self.kind!r} of family {self.family}: a pointwise definition "
                            f"(fivedc/ir/pointwise.py) is {'required' if self.pointwise is None else 'only'} "
                            "for the families "
                            f"{sorted(map(str, POINTWISE_FAMILIES))}")
        if self.pointwise is not None and len(self.args) != POINTWISE_FAMILIES[self.family]:
            raise TypeError(f"pointwise op {self.kind!r}: {self.family} ops take "
                            f"{POINTWISE_FAMILIES[self.family]} arguments, not {len(self.args)}")

    @property
    def max_args(self) -> int:
        return 1 << 16 if self.variadic else len(self.args)


def freqs_text(freqs) -> str:
    """rope's `freqs` attribute: exact decimal reprs, comma separated."""
    return ",".join(repr(float(f)) for f in freqs)


def parse_freqs(text: str) -> tuple[float, ...]:
    """rope's frequencies from its `freqs` attribute (empty: none given); ValueError when not numbers."""
    return tuple(float(f) for f in text.split(",")) if text else ()


_UNARY = ("x",)
_BINARY = ("a", "b")
_F = "torch.nn.functional"

OP_SPECS: dict[str, OpSpec] = {
    spec.kind: spec
    for spec in (
        OpSpec("embedding", ("tokens", "table"), 2, (("padding_idx", 0),),
               doc="table[vocab, hidden] rows picked by int tokens; padding_idx (when given): that row gets "
                   "no gradient (torch's F.embedding(padding_idx=))"),
        OpSpec("linear", ("x", "w"), 2, family=OpFamily.LINEAR,
               doc="contract x's trailing dims with w's leading dims (or with its "
                   "trailing dims: a weight stored [out, in], a tied embedding table)"),
        OpSpec("matmul", ("x", "w"), 2, family=OpFamily.LINEAR, doc="same contraction as linear"),
        OpSpec("add", _BINARY, 2, doc="elementwise a + b (b broadcast by dim name, or a number)",
               pointwise=Pointwise("torch.add", Saves.NOTHING, functions=("operator.add", "operator.iadd"),
                                   aten=("add",), commutative=True)),
        OpSpec("sub", _BINARY, 2, doc="elementwise a - b",
               pointwise=Pointwise("torch.sub", Saves.NOTHING, functions=("operator.sub", "operator.isub"),
                                   aten=("sub",))),
        OpSpec("mul", _BINARY, 2, doc="elementwise a * b",
               pointwise=Pointwise("torch.mul", Saves.OTHER_OPERAND, functions=("operator.mul", "operator.imul"),
                                   methods=("multiply",), aten=("mul",), commutative=True)),
        OpSpec("div", _BINARY, 2, doc="elementwise a / b",
               pointwise=Pointwise("torch.div", Saves.QUOTIENT_OPERANDS,
                                   functions=("operator.truediv", "torch.true_divide"),
                                   methods=("divide", "true_divide"), aten=("div",))),
        OpSpec("gelu", _UNARY, 1, (("approximate", "none"),), doc="GELU activation",
               pointwise=Pointwise(f"{_F}.gelu", Saves.INPUT, modules=("torch.nn.GELU",), aten=("gelu",))),
        OpSpec("silu", _UNARY, 1, doc="SiLU (swish) activation",
               pointwise=Pointwise(f"{_F}.silu", Saves.INPUT, modules=("torch.nn.SiLU",), aten=("silu",))),
        OpSpec("relu", _UNARY, 1, doc="ReLU activation",
               pointwise=Pointwise(f"{_F}.relu", Saves.OUTPUT, functions=("torch.relu",), modules=("torch.nn.ReLU",),
                                   aten=("relu",))),
        OpSpec("state_add", ("value",), 1, (("state", ""),),
               doc="adds value (whole on every rank: the whole batch's) to the module buffer `state` in a "
                   "training forward, and returns value (fivedc/ir/states.py)"),
        OpSpec("tanh", _UNARY, 1, doc="tanh activation",
               pointwise=Pointwise("torch.tanh", Saves.OUTPUT, functions=(f"{_F}.tanh",), modules=("torch.nn.Tanh",),
                                   aten=("tanh",))),
        OpSpec("sigmoid", _UNARY, 1, doc="sigmoid activation",
               pointwise=Pointwise("torch.sigmoid", Saves.OUTPUT, functions=(f"{_F}.sigmoid",),
                                   modules=("torch.nn.Sigmoid",), aten=("sigmoid",))),
        OpSpec("swiglu", ("gate", "up"), 2, doc="silu(gate) * up"),
        OpSpec("rmsnorm", ("x", "w"), 2, (("eps", 1e-5),), family=OpFamily.NORM,
               doc="RMS norm over x's trailing dims that w has (the last, or several)"),
        OpSpec("layernorm", ("x", "w", "b"), 2, (("eps", 1e-5),), family=OpFamily.NORM,
               doc="layer norm over x's trailing dims that w has (the last, or several)"),
        OpSpec("rope", ("x",), 1, (("theta", 10000.0), ("freqs", "")),
               doc="rotary embedding at global positions: frequencies theta**(-i/half), or freqs "
                   "(comma-separated, half of the last dim) where a model's own table differs"),
        OpSpec(
            "attention",
            ("q", "k", "v"),
            3,
            (("causal", True), ("softcap", 0.0), ("kernel", "flash"), ("window", 0)),
            doc="softmax(q k^T / sqrt(d)) v; GQA when k, v have fewer heads; @cp(ring|allgather) under cp; "
                "softcap c > 0: each score s capped at c * tanh(s / c) before the mask (Gemma 2); window "
                "W > 0 (causal): the query at i sees the keys at i - W < j <= i (Mistral's, Gemma 2's "
                "sliding_window), blocks outside the band skipped; kernel: "
                "flash (fused, scores never held) or math (scores materialised and kept for backward)",
        ),
        OpSpec("cross_entropy", ("logits", "targets"), 2,
               (("ignore_index", -100), ("reduction", "mean"), ("label_smoothing", 0.0), ("weight", "")),
               doc="token cross-entropy (scalar); with ignore_index given, targets equal to it are left out "
                   "and the mean is over the others (as torch's F.cross_entropy); without, every token counts; "
                   "reduction: mean (over the counted tokens of the whole batch) or sum; label_smoothing eps: "
                   "(1 - eps) x the target's -log p + eps x the mean over the classes of -log p; weight: class "
                   "weights (comma-separated, one per class; a constant), each token's loss times its target's, "
                   "the mean divided by their sum"),
        OpSpec(
            "moe",
            ("x", "router", "w_gate", "w_up", "w_down"),
            4,
            (("top_k", 2), ("score", "softmax"), ("capacity_factor", 0.0), ("aux_loss", 0.0),
             ("bias_update", 0.0), ("normalize", True), ("bias_state", ""), ("count_state", "")),
            doc="routed experts: router[hidden, experts], w_*[experts, ...]; SwiGLU with 5 args, GELU with 4. "
                "Each token goes to its top_k experts by score (softmax|sigmoid), gates normalised to sum 1; "
                "capacity_factor left out: dropless, given (> 0): each expert keeps ceil(factor x tokens per "
                "sequence x top_k / experts) per sequence; aux_loss: Switch balancing loss coefficient; "
                "bias_update: DeepSeek-V3 loss-free balancing rate (0: off); bias_state: a state [experts] added "
                "to the scores to choose (a module's routing bias); count_state: a state [experts] each "
                "training forward adds the whole batch's tokens per expert to (fivedc/ir/states.py). See "
                "passes/experts.py",
        ),
        OpSpec(
            "aten",
            ("tensors",),
            0,
            (("target", ""), ("call", ""), ("layouts", ""), ("out", ""), ("dtypes", ""), ("reason", ""), ("item", 0),
             ("rule", "replicated"), ("along", ""), ("rows", "")),
            doc="an ATen operator: computed whole on every rank (rule=replicated), or on shards where torch says "
                "it is pointwise or runs along some dims (a reduction, scan, slice): see fivedc/ir/aten_call.py",
            variadic=True,
        ),
    )
}


POINTWISE: dict[str, Pointwise] = {kind: spec.pointwise for kind, spec in OP_SPECS.items() if spec.pointwise}


def kinds_of(family: OpFamily) -> tuple[str, ...]:
    """The op kinds of `family`, in the vocabulary's order."""
    return tuple(kind for kind, spec in OP_SPECS.items() if spec.family == family)


LINEAR_KINDS = kinds_of(OpFamily.LINEAR)  # linear, matmul: a contraction with a weight (one kernel, one cost)

Rule = TypeVar("Rule")


def by_family(rules: Mapping[OpFamily, Rule], *, table: str) -> dict[str, Rule]:
    """Per op kind, the rule of its family: how `SHAPE_RULES` and `SHARDING_RULES` are made from
    their one rule per family. A family with no rule (or a rule for no family) is an error at
    import, naming the table."""
    missing, extra = set(OpFamily) - set(rules), set(rules) - set(OpFamily)
    if missing or extra:
        raise TypeError(f"{table}: no rule for the op families {sorted(map(str, missing))}" if missing
                        else f"{table}: rules for families no op has {sorted(map(str, extra))}")
    return {kind: rules[spec.family] for kind, spec in OP_SPECS.items()}


def counts_targets(op) -> bool:
    """A cross-entropy whose mean divides by the count of its targets other than ignore_index
    (with class weights: their sum) over the whole batch (an all-reduce over the token shards, or a pipeline's count up front);
    reduction='sum' divides by nothing."""
    return op.kind == "cross_entropy" and (op.attr("ignore_index") is not None or bool(op.attr("weight", ""))) \
        and op.attr("reduction", "mean") == "mean"
