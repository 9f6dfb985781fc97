"""Schedules are known by their properties outside `fivedc/schedule/`, and the properties are true.

`fivedc/schedule/kinds.py` is the one place that says what each schedule is (chunks per
rank, placement, model copies, split backward, what it needs of p and m). Every other
module asks `schedule_kind(name)`: no string literal equal to a schedule's name appears
in `fivedc/` outside `fivedc/schedule/` (docstrings aside; messages may name a schedule
inside a longer sentence, the CLI's help reads the names from the registry). And each
property is checked against the schedules the generators build.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from package_files import package_files

from fivedc.schedule import (DEFAULT_SCHEDULE, SCHEDULES, ActionKind, Placement, ScheduleError, make_schedule,
                             schedule_kind, schedules_help)
from fivedc.schedule.generators import placement



def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _name_literals(path: Path, root: Path = Path(__file__).resolve().parent.parent) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = _docstrings(tree)
    return [f"{path.relative_to(root)}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in SCHEDULES
            and id(node) not in skip]


def test_no_schedule_name_outside_the_schedule_folder():
    found = [hit for name, path in package_files() if not name.startswith("schedule/")
             for hit in _name_literals(path)]
    assert found == [], "ask schedule_kind(name) for a property instead of comparing names:\n" + "\n".join(found)


def test_the_scan_sees_a_comparison(tmp_path):
    source = tmp_path / "example.py"
    source.write_text('"""A docstring may say 1f1b."""\nsplit = schedule in ("zb-h1", "dualpipe")\n')
    assert [hit.split(": ")[1] for hit in _name_literals(source, root=tmp_path)] == ["'zb-h1'", "'dualpipe'"]


def _forwards_first(actions) -> bool:
    """Every forward of the rank before its first backward."""
    order = [a.kind for a in actions if a.kind in (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT)]
    return all(k is ActionKind.FORWARD for k in order[:order.count(ActionKind.FORWARD)])


@pytest.mark.parametrize("name", SCHEDULES)
def test_properties_match_the_built_schedule(name):
    kind = schedule_kind(name)
    for p in (2, 3, 4) if kind.pipelines == 1 else (2, 4):
        v = 3 if kind.takes_virtual else None
        m = max(kind.min_microbatches(p), p) * 2
        schedule = make_schedule(name, p, m, v)
        assert schedule.v == kind.per_rank(v)
        assert schedule.pipelines == kind.pipelines
        assert (schedule.placement, schedule.pipelines) == placement(name, p, v)
        if kind.placement is Placement.LOOP:
            assert schedule.placement == tuple(c % p for c in range(p * schedule.v))
        else:
            assert schedule.placement[:p] == tuple(range(p)) and schedule.placement[p:] == tuple(reversed(range(p)))
        kinds = {a.kind for acts in schedule.ranks for a in acts}
        assert (ActionKind.BACKWARD_WEIGHT in kinds) == kind.split_backward
        assert all(_forwards_first(acts) for acts in schedule.ranks) == kind.forwards_first

@pytest.mark.parametrize("name", SCHEDULES)
def test_least_microbatches_and_ranks(name):
    kind = schedule_kind(name)
    p = 4
    least = kind.min_microbatches(p)
    make_schedule(name, p, least + least % kind.pipelines, 2 if kind.takes_virtual else None)
    if least > 1:
        with pytest.raises(ScheduleError, match="at least|a multiple of p"):
            make_schedule(name, p, least - 1, 2 if kind.takes_virtual else None)
    if kind.min_p > 1:
        with pytest.raises(ScheduleError, match="at least 2 pp ranks"):
            make_schedule(name, 1, least, 2 if kind.takes_virtual else None)


def test_registry():
    assert schedule_kind(DEFAULT_SCHEDULE).chunks_per_rank == 1
    assert [schedule_kind(n).name for n in SCHEDULES] == list(SCHEDULES)
    with pytest.raises(ScheduleError, match="unknown pipeline schedule 'pipedream'"):
        schedule_kind("pipedream")
    assert schedules_help() == ("gpipe, 1f1b (default), interleaved, zb-h1, dualpipev, "
                                "dualpipe (two model copies)")
    folded = [n for n in SCHEDULES if schedule_kind(n).folded]
    closed = [n for n in SCHEDULES if schedule_kind(n).has_closed_form]
    assert folded == ["dualpipev"] and closed == ["gpipe", "1f1b", "interleaved"]
