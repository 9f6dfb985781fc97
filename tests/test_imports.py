"""The package's import graph has no cycles, and no module imports from a layer above it.

Every module of `fivedc` is parsed, and each import of another fivedc module is an edge,
imports inside functions included (a lazy import that closes a cycle is still a
cycle a reader must untangle). Imports under `if TYPE_CHECKING:` only name types
and are not run, so they are left out; so is the root package's `__getattr__`,
which makes `fivedc.parallelize` available lazily without importing the compiler.

The folders are layers (each folder's `__init__.py` says which): a module may import
its own folder and the layers below, never one above. The optional model libraries
(torchtitan, torchtune) are imported by no fivedc module and by no test module before its
`pytest.importorskip`, so that the suite runs without them.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"fivedc": ROOT / "fivedc", "fivedc.passes": ROOT / "passes", "fivedc.runtime": ROOT / "runtime",
            "fivedc.grammars": ROOT / "grammars"}  # the design card's top level (pyproject's package-dir)
LAYERS = (  # bottom to top
    ("fivedc.errors", "fivedc.files", "fivedc.outputs", "fivedc.log_file", "fivedc.grammars"),
    ("fivedc.ir",),
    ("fivedc.schedule",),
    ("fivedc.passes",),
    ("fivedc.instructions",),
    ("fivedc.estimates",),
    ("fivedc.plan",),
    ("fivedc.proof",),
    ("fivedc.pipeline",),
    ("fivedc.search",),
    ("fivedc.frontends",),
    ("fivedc.runtime",),
    ("fivedc.parallel",),
    ("fivedc.cli", "fivedc.__main__"),  # __main__: `python -m fivedc`, the command
)


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def imports(tree: ast.AST, known: dict[str, Path]) -> set[str]:
    """The fivedc modules `tree` imports (outside `if TYPE_CHECKING:` blocks)."""
    out: set[str] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if _is_type_checking(node):
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{a.name}" for a in node.names} & known.keys()  # from fivedc import ir
            out |= submodules or ({node.module} & known.keys())
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names} & known.keys()
        stack.extend(ast.iter_child_nodes(node))
    return out


def import_graph() -> nx.DiGraph:
    known = modules()
    graph = nx.DiGraph()
    for name, path in known.items():
        tree = ast.parse(path.read_text())
        if name == "fivedc":  # the root's lazy __getattr__ (see the docstring)
            tree.body = [n for n in tree.body if not (isinstance(n, ast.FunctionDef) and n.name == "__getattr__")]
        graph.add_node(name)
        graph.add_edges_from((name, target) for target in imports(tree, known) if target != name)
    return graph


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph()
    assert graph.number_of_nodes() > 80  # every module was found
    cycles = sorted(nx.simple_cycles(graph), key=len)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c + c[:1]) for c in cycles[:10])


def test_the_checker_sees_a_cycle() -> None:
    known = {"fivedc.a": Path("a.py"), "fivedc.b": Path("b.py")}
    lazy = ast.parse("def f():\n    from fivedc.b import g\n")
    typed = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fivedc.b import g\n")
    assert imports(lazy, known) == {"fivedc.b"} and imports(typed, known) == set()


def layer_of(module: str) -> int | None:
    for index, owners in enumerate(LAYERS):
        if any(module == owner or module.startswith(owner + ".") for owner in owners):
            return index
    return None  # the root package itself


def test_no_module_imports_from_a_layer_above_it() -> None:
    graph = import_graph()
    assert all(layer_of(m) is not None for m in graph.nodes if m != "fivedc"), \
        [m for m in graph.nodes if m != "fivedc" and layer_of(m) is None]  # every folder has its layer
    upward = sorted(f"{a} -> {b}" for a, b in graph.edges
                    if b != "fivedc" and layer_of(a) is not None and layer_of(b) > layer_of(a))
    assert not upward, "imports from a layer above:\n" + "\n".join(upward)


def test_compiling_and_searching_a_dsl_model_does_not_import_torch(tmp_path) -> None:
    """torch takes seconds to import: a plan or a layout search of a .5d model needs none of it
    (the 405B search's budget is 10 s), only a run does."""
    script = (
        "import sys\n"
        "from fivedc.cli.main import main\n"
        f"for argv in (['compile', 'examples/tiny_llama.5d', '--mesh', '2x2x2x1x1', '-o', {str(tmp_path / 'p.json')!r}],\n"
        "             ['search', 'examples/tiny_llama.5d', '--gpus', '8', '--gpu', 'h100', '--top', '1']):\n"
        "    assert main(argv) == 0, argv\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout[-2000:]


OPTIONAL = ("torchtitan", "torchtune")  # not in the `test` extra: the suite must run without them


def optional_imports(tree: ast.Module, *, anywhere: bool) -> list[tuple[int, str]]:
    """(line, library) of each import of an optional model library: all of them (`anywhere`),
    or those that run on import of the module (function bodies left out) and come before the
    module's `pytest.importorskip` of that library."""
    skips = {node.value.args[0].value: node.lineno for node in tree.body
             if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
             and ast.unparse(node.value.func) == "pytest.importorskip" and node.value.args
             and isinstance(node.value.args[0], ast.Constant)}
    out, stack = [], list(tree.body)
    while stack:
        node = stack.pop()
        if not anywhere and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
        out += [(node.lineno, top) for top in (n.split(".")[0] for n in names)
                if top in OPTIONAL and (anywhere or node.lineno < skips.get(top, node.lineno + 1))]
        stack.extend(ast.iter_child_nodes(node))
    return sorted(out)


def test_the_optional_model_libraries_are_imported_only_behind_a_skip() -> None:
    """fivedc never imports torchtitan or torchtune; a test module may, at its top, only after
    `pytest.importorskip` of the library (tests/test_titan_tune_models.py), so that without
    them the rest of the suite is collected and runs."""
    found = []
    package = [path for folder in PACKAGES.values() for path in folder.rglob("*.py")]
    for files, anywhere in ((package, True), ((ROOT / "tests").glob("*.py"), False)):
        for path in sorted(files):
            imported = optional_imports(ast.parse(path.read_text()), anywhere=anywhere)
            found += [f"{path.relative_to(ROOT)}:{line}: {name}" for line, name in imported]
    assert not found, "optional libraries imported unconditionally:\n" + "\n".join(found)
    guarded = ast.parse("import pytest\npytest.importorskip('torchtune')\nimport torchtune\n"
                        "def f():\n    import torchtitan\n")
    bare = ast.parse("import torchtitan.models\nfrom torchtune.models import llama3\n")
    assert optional_imports(guarded, anywhere=False) == []
    assert optional_imports(guarded, anywhere=True) == [(3, "torchtune"), (5, "torchtitan")]
    assert optional_imports(bare, anywhere=False) == [(1, "torchtitan"), (2, "torchtune")]
