"""What an IR node reads and writes is asked of the node (issue 39): `Op.reads`, `reads_at`,
`arg_names`, `read`, `map_reads`, `writes`; `Redistribute.reads`/`writes`; `Repeat.writes`;
`readers` and `outer_reads` over a block. No module of fivedc/ tells an op's names from its
number literals with `isinstance(arg, str)` itself: an AST scan finds such a test over an op's
args (`.args[i]`, a name bound from `.args`, a parameter called `arg`). Run on the tree before
this interface it found 31 of its 32 such tests (not a renaming function handed to
`map(f, item.args)`, cli/plan_check.py's, which reads `Op.map_reads` now too); the forms are
held here on small sources."""

from __future__ import annotations

import ast

import pytest
from package_files import package_files

from fivedc.ir.graph import Block, Op, Redistribute, Repeat, TensorType, outer_reads, readers
from fivedc.ir.sharding import Sharding


# (file under fivedc/, enclosing function): why its isinstance(..., str) over `.args` is not an op's args
ALLOWED = {
    ("ir/graph.py", "_name"): "the one place that tells an op's names from its number literals",
    ("passes/experts.py", "PlaceExperts.run"): "an @ep annotation's arguments (a rank list may be text '0,1')",
}


# ---- the interface --------------------------------------------------------------------------
def _op(out, kind, *args) -> Op:
    return Op(out=out, kind=kind, args=args)


def test_an_op_reads_its_names_in_argument_order_and_leaves_numbers_out():
    op = _op("y", "mul", "x", 2.0, "x")
    assert op.reads == ("x", "x")
    assert op.reads_at == ((0, "x"), (2, "x"))
    assert op.arg_names == ("x", None, "x")
    assert [op.read(i) for i in range(3)] == ["x", None, "x"]
    assert op.map_reads(str.upper) == ("X", 2.0, "X")
    assert op.writes == ("y",)
    assert _op("z", "add", 1.0, 0).reads == ()


def test_a_redistribution_reads_its_source_and_a_repeat_writes_its_results():
    moved = Redistribute(out="x2", src="x", type=TensorType(("batch",)), src_sharding=Sharding(),
                         sharding=Sharding(), grad_partial=(), forward=(), backward=())
    assert (moved.reads, moved.writes) == (("x",), ("x2",))
    body = Block(args=("h",), items=(_op("h2", "add", "h", "w"),), yields=("h2",))
    repeat = Repeat(name="layers", count=2, carried=("x2",), body=body, results=("out",))
    assert repeat.writes == ("out",)
    block = Block(items=(moved, repeat, _op("loss", "mul", "out", 0.5), _op("twice", "add", "x2", "x2")))
    assert outer_reads(block) == {"x", "w"}  # w: a parameter, not defined by a node
    assert outer_reads(body) == {"h", "w"}  # a repeat body's own args are among its outer reads
    uses = readers(block)
    assert [(n.out, i) for n, i in uses["x2"]] == [("twice", 0), ("twice", 1)]
    assert [(n.out, i) for n, i in uses["x"]] == [("x2", 0)]
    assert [(n.out, i) for n, i in uses["h"]] == [("h2", 0)]
    assert "x2" not in {n for n, _ in readers(Block(items=(repeat,))).items()}  # carried: the repeat's, not a node's


# ---- the scan ---------------------------------------------------------------------------------
def _is_str_test(call: ast.AST) -> bool:
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "isinstance"
            and len(call.args) == 2):
        return False
    kinds = call.args[1].elts if isinstance(call.args[1], ast.Tuple) else [call.args[1]]
    return any(isinstance(k, ast.Name) and k.id == "str" for k in kinds)


def _reads_args(node: ast.AST) -> bool:
    """Whether an expression reads some `<x>.args` (an op's, a node's, an annotation's)."""
    return any(isinstance(n, ast.Attribute) and n.attr == "args" for n in ast.walk(node))


def _names(target: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


def _from_args(scope: ast.AST) -> set[str]:
    """Names a function (or module) binds from `.args`: loop and comprehension targets over an
    expression that reads them, assignments from one; and a parameter called `arg`."""
    bound: set[str] = set()
    for node in ast.walk(scope):
        if isinstance(node, (ast.For, ast.comprehension)) and _reads_args(node.iter):
            bound |= _names(node.target)
        elif isinstance(node, ast.Assign) and _reads_args(node.value):
            bound |= set().union(*map(_names, node.targets))
        elif isinstance(node, (ast.FunctionDef, ast.Lambda)):
            bound |= {a.arg for a in node.args.args if a.arg == "arg"}
    return bound


def scan(source: str) -> list[tuple[str, int]]:
    """(enclosing function, line) of every `isinstance(<x>, str)` whose x is some `.args[...]`
    or a name bound from `.args`."""
    found = []

    def visit(node: ast.AST, where: str, bound: set[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{where}.{child.name}" if where else child.name
                visit(child, name, bound | _from_args(child) if not isinstance(child, ast.ClassDef) else bound)
                continue
            if _is_str_test(child):
                x = child.args[0]
                if (isinstance(x, ast.Subscript) and _reads_args(x.value)) or (
                        isinstance(x, ast.Name) and x.id in bound):
                    found.append((where, child.lineno))
            visit(child, where, bound)

    tree = ast.parse(source)
    visit(tree, "", _from_args(tree))
    return found


def test_the_scan_finds_the_forms_the_tree_had():
    """Each form the scans of issue 39 took (before `Op.reads`) is found; others are not."""
    bad = '''
def a(node):
    return {x for x in node.args if isinstance(x, str)}
def b(op, env):
    return [env[x] if isinstance(x, str) else None for x in op.args]
def c(item, scope):
    for index, (arg, spec) in enumerate(zip(item.args, item.arg_specs)):
        if spec is None or not isinstance(arg, str):
            continue
def d(op):
    if not isinstance(op.args[1], str):
        return 1
def e(op):
    a, b = op.args[0], op.args[1]
    return isinstance(b, str)
def f(c, arg):
    return isinstance(arg, str) and arg not in c
'''
    assert [where for where, _ in scan(bad)] == ["a", "b", "c", "d", "e", "f"]
    fine = '''
def g(data, value):
    return isinstance(data, str) or isinstance(value.name, str)
'''
    assert scan(fine) == []


def test_no_module_tells_an_ops_names_from_its_numbers_itself():
    found = []
    for rel, path in package_files():
        for where, line in scan(path.read_text()):
            if (rel, where) not in ALLOWED:
                found.append(f"{path}:{line} ({where})")
    assert not found, ("isinstance(<arg>, str) over an op's args: ask the node instead (Op.reads, reads_at, "
                       "arg_names, read, map_reads; fivedc/ir/graph.py): " + ", ".join(found))


@pytest.mark.parametrize("key", sorted(ALLOWED))
def test_each_allowed_exception_is_still_there(key):
    """An exception named here that the code no longer needs is taken off the list."""
    rel, where = key
    path = dict(package_files())[rel]
    assert where in {w for w, _ in scan(path.read_text())}, f"{key} no longer scans args: drop it"
