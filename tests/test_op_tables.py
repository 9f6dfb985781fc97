"""Every op kind of the vocabulary (`fivedc/ir/ops.OP_SPECS`) has every rule, and no table keys
an op the vocabulary lacks: its shape rule and sharding rule (one per family, issue 39), its
kernel and its save rule (per kind)."""

from __future__ import annotations

import pytest

from fivedc.estimates.saved import SAVE_RULES
from fivedc.ir.ops import OP_SPECS, OpFamily, by_family
from fivedc.passes.layout import PASS_THROUGH
from fivedc.passes.rules import SHARDING_RULES
from fivedc.passes.shapes import SHAPE_RULES
from fivedc.runtime.kernels import KERNELS

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
