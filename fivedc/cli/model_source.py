"""The model a plan was made from: recorded at compile, compared by `fivedc check` and `fivedc run`.

`fivedc/cli/plan_check.py` proves a plan is what this fivedc compiles from the model
*inside* the plan; an edit that changes the model consistently (attention's `causal`,
GELU's `approximate`) still passes that. So a compile records the file it read and the
SHA-256 of its bytes (`Graph.model_file`, `Graph.model_hash`: `stamp`), and a plan's
reader compares them with the file (`check_source`), the one the plan names or the one
`--source PATH` gives:

- a file whose bytes differ from the recorded hash: bad input, naming the file and both
  hashes;
- a `.5d` file with the recorded bytes is compiled again with the plan's options (and
  its batch and sequence sizes, which `--global-batch`/`--seq` may have changed), and the
  plan must be exactly that plan: its model can be no other;
- a `.py` file with the recorded bytes is not imported: running code a plan names is what
  a plan from elsewhere must never cause, so its traced model is not compared, and the
  line printed says so;
- no file found, or none recorded: the line printed says the model part cannot be
  checked against its source.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from fivedc.errors import FivedcError, PlanError

SUFFIXES = (".5d", ".py")  # a plan names a model file only; nothing else is read


def file_hash(path: str | Path) -> str:
    """`sha256:HEX` of a file's bytes."""
    return "sha256:" + hashlib.sha256(Path(path).read_bytes()).hexdigest()


def stamp(graph, path: str | Path):
    """The graph with the model file it was read from and that file's hash."""
    return dataclasses.replace(graph, model_file=str(path), model_hash=file_hash(path))


def check_source(plan, *, plan_name: str, source: str | None = None) -> str:
    """The line to print about the plan's model and its source; a `PlanError` where they differ."""
    from fivedc.frontends.python_file import parse_spec

    graph = plan.graph
    if not source and not graph.model_file:
        return "model: the plan records no model file: its model cannot be checked against a source"
    path = parse_spec(source)[0] if source else Path(graph.model_file)  # file.py:factory -> file.py
    if path.suffix not in SUFFIXES:
        raise PlanError(f"{plan_name} names model file {path}, which is not a .5d or .py file",
                        hint="recompile the model with fivedc compile")
    if not path.is_file():
        return (f"model: {path} not found: the plan's model cannot be checked against its source "
                "(--source PATH gives it)")
    actual = file_hash(path)
    if graph.model_hash and actual != graph.model_hash:
        raise PlanError(f"{path} is not the model {plan_name} was compiled from: the plan records "
                        f"{graph.model_hash[:23]}..., the file is {actual[:23]}...",
                        hint=f"recompile: fivedc compile {path} --mesh {plan.mesh} -o {plan_name}")
    if path.suffix == ".py":
        return (f"model: {path} ({actual[:15]}...) is the file the plan was compiled from; its traced "
                "model is not compared (fivedc does not run a file a plan names)")
    _same_as_compiled(plan, path, plan_name)
    return f"model: {path} ({actual[:15]}...) compiles to this plan, model and all"


def _same_as_compiled(plan, path: Path, plan_name: str) -> None:
    """A `.5d` source compiled again with the plan's options must give the plan."""
    from fivedc.cli.plan_check import RECOMPILE_HINT, first_difference, options_of, show
    from fivedc.frontends.dsl_file import parse_model
    from fivedc.pipeline import compile_graph

    graph = plan.graph
    sizes = {name: graph.dim(name) for name in (graph.batch_dim, graph.seq_dim) if name}
    try:
        text = path.read_text(encoding="utf-8")  # located as the plan's own (its path as given at compile)
        fresh_graph = parse_model(text, filename=graph.model_file or graph.source)
        fresh_graph = dataclasses.replace(fresh_graph, model_file=graph.model_file, model_hash=file_hash(path))
        fresh_graph = dataclasses.replace(fresh_graph, dims=tuple((k, sizes.get(k, v)) for k, v in fresh_graph.dims))
        fresh = compile_graph(fresh_graph, options_of(plan))
    except (FivedcError, UnicodeDecodeError) as error:
        raise PlanError(f"{path} does not compile with {plan_name}'s options: {getattr(error, 'message', error)}",
                        hint=RECOMPILE_HINT) from None
    difference = first_difference(plan, fresh, "plan")
    if difference is not None:
        where, saved, compiled = difference
        raise PlanError(f"{plan_name} is not the plan {path} compiles to: {where} is {show(saved)} in the plan, "
                        f"{show(compiled)} from the model file", hint=RECOMPILE_HINT)
