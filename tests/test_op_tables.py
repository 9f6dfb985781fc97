"""Every op kind of the vocabulary (`fivedc/ir/ops.OP_SPECS`) has every rule, and no table keys
an op the vocabulary lacks: its shape rule and sharding rule (one per family, issue 39), its
kernel and its save rule (per kind). A pointwise op's kernel, save rule, fx names and kind-set
memberships are built from its one definition (`fivedc/ir/pointwise.Pointwise`): the tests
hold each table to the definitions, and register a new pointwise op (softplus) in a fresh
interpreter to see that the one entry is all it takes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fivedc.estimates.saved import POINTWISE_SAVES, SAVE_RULES
from fivedc.ir.ops import OP_SPECS, POINTWISE, OpFamily, OpSpec, by_family
from fivedc.ir.pointwise import Pointwise, Saves, resolve
from fivedc.passes.layout import PASS_THROUGH
from fivedc.passes.rules import SHARDING_RULES
from fivedc.passes.shapes import SHAPE_RULES
from fivedc.instructions.unit_program import SAVES_NOTHING
from fivedc.runtime.kernels import KERNELS

ROOT = Path(__file__).resolve().parent.parent
TABLES = {"SHAPE_RULES": SHAPE_RULES, "SHARDING_RULES": SHARDING_RULES, "KERNELS": KERNELS,
          "SAVE_RULES": SAVE_RULES}


@pytest.mark.parametrize("name", sorted(TABLES))
def test_every_op_kind_has_a_rule_in_every_table(name):
    table = TABLES[name]
    assert set(OP_SPECS) - set(table) == set(), f"{name} lacks a rule for these op kinds"
    assert set(table) - set(OP_SPECS) == set(), f"{name} has rules for kinds that are no op"
    assert all(callable(rule) for rule in table.values())


def test_every_family_has_ops_and_the_ops_of_a_family_share_their_rules():
    assert {spec.family for spec in OP_SPECS.values()} == set(OpFamily)
    for family in OpFamily:
        kinds = [k for k, spec in OP_SPECS.items() if spec.family == family]
        assert len({SHAPE_RULES[k] for k in kinds}) == 1 and len({SHARDING_RULES[k] for k in kinds}) == 1, family
    assert OP_SPECS["matmul"].family == OpFamily.LINEAR and OP_SPECS["rope"].family == OpFamily.ROPE


def test_a_table_missing_a_family_fails_at_import_naming_it():
    rules = {f: (lambda: f) for f in OpFamily if f != OpFamily.NORM}
    with pytest.raises(TypeError, match=r"SOME_TABLE: no rule for the op families \['norm'\]"):
        by_family(rules, table="SOME_TABLE")
    table = by_family({**rules, OpFamily.NORM: len}, table="SOME_TABLE")
    assert table["rmsnorm"] is table["layernorm"] is len and set(table) == set(OP_SPECS)


def test_a_split_dim_stays_split_through_the_elementwise_ops_and_activations():
    assert PASS_THROUGH == {"gelu", "silu", "relu", "tanh", "sigmoid", "swiglu", "add", "sub", "mul", "div"}


# ---- the pointwise ops: one definition each ------------------------------------------------
def test_the_pointwise_ops_are_the_unary_and_elementwise_families_each_with_a_definition():
    assert set(POINTWISE) == {"gelu", "silu", "relu", "tanh", "sigmoid", "add", "sub", "mul", "div"}
    assert set(POINTWISE) == {k for k, s in OP_SPECS.items() if s.family in (OpFamily.UNARY, OpFamily.ELEMENTWISE)}
    with pytest.raises(TypeError, match="'softplus' of family unary: a pointwise definition .* is required"):
        OpSpec("softplus", ("x",), 1, family=OpFamily.UNARY)  # a pointwise op without its definition
    with pytest.raises(TypeError, match="'odd' of family norm: a pointwise definition .* is only for"):
        OpSpec("odd", ("x", "w"), 2, family=OpFamily.NORM, pointwise=POINTWISE["relu"])
    with pytest.raises(TypeError, match="'pair': elementwise ops take 2 arguments, not 1"):
        OpSpec("pair", ("x",), 1, family=OpFamily.ELEMENTWISE, pointwise=POINTWISE["add"])
    with pytest.raises(ValueError, match="not a qualified name"):
        Pointwise("softplus", Saves.INPUT)
    with pytest.raises(ValueError):
        Pointwise("torch.nn.functional.softplus", "its grandmother")  # no such save form


def test_every_save_form_has_a_rule_and_each_pointwise_ops_rule_is_its_forms():
    assert set(POINTWISE_SAVES) == set(Saves)
    for kind, pointwise in POINTWISE.items():
        assert SAVE_RULES[kind] is POINTWISE_SAVES[pointwise.saves], kind
    assert SAVES_NOTHING == {"add", "sub"}
    assert {k: p.saves for k, p in POINTWISE.items()} == {
        "add": "nothing", "sub": "nothing", "mul": "other operand", "div": "quotient operands",
        "gelu": "input", "silu": "input", "relu": "output", "tanh": "output", "sigmoid": "output"}


def test_every_pointwise_kernel_computes_its_torch_function():
    import torch
    import torch.nn.functional as F

    from fivedc.ir.graph import Op

    x, y = torch.randn(2, 3, 4, dtype=torch.float64), torch.rand(3, 4, dtype=torch.float64) + 0.5
    for kind, pointwise in POINTWISE.items():
        fn = resolve(pointwise.torch)
        op = Op(kind, kind, (), ())
        if OP_SPECS[kind].family == OpFamily.ELEMENTWISE:
            got = KERNELS[kind](None, op, [x, y], [("b", "s", "h"), ("s", "h")])
            assert torch.equal(got, fn(x, y)), kind
            assert torch.equal(KERNELS[kind](None, op, [x, 2.0], [("b", "s", "h"), ()]), fn(x, 2.0)), kind
        else:
            assert torch.equal(KERNELS[kind](None, op, [x], [("b", "s", "h")]), fn(x)), kind
    tanh_gelu = Op("gelu", "gelu", (), (("approximate", "tanh"),))
    assert torch.equal(KERNELS["gelu"](None, tanh_gelu, [x], [("b", "s", "h")]), F.gelu(x, approximate="tanh"))


def test_the_fx_frontend_reads_every_pointwise_op_as_its_definition_says():
    import torch

    from fivedc.frontends.fx import export, recognise
    from fivedc.frontends.fx.ops import HANDLERS

    for kind, pointwise in POINTWISE.items():
        assert kind in HANDLERS, kind
        assert pointwise.callables and all(recognise._FUNCTIONS[resolve(f)] == kind for f in pointwise.callables)
        assert all(recognise._MODULES[resolve(m)] == kind for m in pointwise.modules), kind
        assert all(recognise._METHODS[m] == kind for m in pointwise.methods), kind
        assert pointwise.aten, f"{kind}: no ATen operator named (torch.export's graphs would not read as it)"
        for name in pointwise.aten:
            assert recognise._FUNCTIONS[export._SAME[getattr(torch.ops.aten, name)]] == kind, (kind, name)
    assert all(pointwise.modules for kind, pointwise in POINTWISE.items() if OP_SPECS[kind].family == OpFamily.UNARY)


# ---- a new pointwise op is one entry -------------------------------------------------------
SOFTPLUS = '''
import torch, torch.nn as nn, torch.nn.functional as F
from fivedc.ir import ops
from fivedc.ir.pointwise import Pointwise, Saves

spec = ops.OpSpec("softplus", ("x",), 1, (("beta", 1.0), ("threshold", 20.0)), doc="softplus activation",
                  pointwise=Pointwise("torch.nn.functional.softplus", Saves.INPUT, modules=("torch.nn.Softplus",),
                                      aten=("softplus",)))
ops.OP_SPECS[spec.kind], ops.POINTWISE[spec.kind] = spec, spec.pointwise  # the one new entry, before any table

from fivedc.estimates.saved import SAVE_RULES, POINTWISE_SAVES
from fivedc.passes.layout import PASS_THROUGH
from fivedc.passes.rules import SHARDING_RULES
from fivedc.passes.shapes import SHAPE_RULES
from fivedc.runtime.kernels import KERNELS
from fivedc.frontends.fx_module import trace_module
from fivedc.ir.graph import Op, walk_ops
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from fivedc.runtime.kernel_context import KernelContext
from fivedc.runtime.program import Program
from fivedc.runtime.verify import single_device_mesh

assert SHAPE_RULES["softplus"] is SHAPE_RULES["gelu"] and SHARDING_RULES["softplus"] is SHARDING_RULES["gelu"]
assert SAVE_RULES["softplus"] is POINTWISE_SAVES[Saves.INPUT] and "softplus" in PASS_THROUGH

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.act, self.head = nn.Embedding(16, 8), nn.Softplus(beta=0.5), nn.Linear(8, 16)

    def forward(self, idx, targets):
        h = F.softplus(self.act(self.emb(idx)), beta=2.0)
        return F.cross_entropy(self.head(h).view(-1, 16), targets.view(-1))

torch.manual_seed(0)
module, inputs = Net().double(), (torch.randint(0, 16, (2, 4)), torch.randint(0, 16, (2, 4)))
tm = trace_module(module, inputs)
acts = [n for n, _ in walk_ops(tm.graph.body) if isinstance(n, Op) and n.kind == "softplus"]
assert [a.attr("beta") for a in acts] == [0.5, 2.0], [a.attrs for a in acts]
plan = compile_graph(tm.graph, CompileOptions(mesh=single_device_mesh(), dtype="fp64"))
ctx = KernelContext(plan.graph, plan.mesh, plan.mesh.coords(0))
params = {k: v.detach().clone().requires_grad_(True) for k, v in tm.to_ir_params(module.state_dict()).items()}
loss = Program(plan.graph, ctx).loss(params, {i.name: t for i, t in zip(tm.graph.inputs, inputs)})
loss.backward()
expected = module(*inputs)
expected.backward()
assert abs(loss.item() - expected.item()) <= 1e-12 * abs(expected.item()), (loss.item(), expected.item())
grads = tm.from_ir_params({k: p.grad for k, p in params.items()})
for name, p in module.named_parameters():
    assert (grads[name] - p.grad).abs().max().item() <= 1e-12 * max(1.0, p.grad.abs().max().item()), name
print("softplus: one entry")
'''


def test_a_new_pointwise_op_is_one_entry_that_every_table_and_the_fx_frontend_take_up():
    """softplus, registered before any table is built (a fresh interpreter): its shape, sharding,
    save rule and kernel exist, a traced nn.Softplus and F.softplus(beta=) lower to it, and the
    traced model's loss and gradients are the module's in float64."""
    done = subprocess.run([sys.executable, "-c", SOFTPLUS], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and "softplus: one entry" in done.stdout, done.stderr[-3000:]
