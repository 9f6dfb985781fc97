"""A model given as Python: `path/to/file.py:factory`, where `factory()` returns (module, example_inputs).

`load_factory(spec)` imports the file (`import_file`: its folder first on `sys.path`,
so sibling imports work), calls the function and checks what it returned; `graph_from_spec`
traces the module into fivedc's IR. Every failure is a `FivedcError` the CLI
prints without a traceback, located at the user's line where there is one: a
missing file or function (with the functions the file does define), an exception
while importing the file or inside the factory, a factory that returns something
else, a model the tracer cannot follow. The function defaults to `factory` when
the spec has no `:name`.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import inspect
import sys
from collections.abc import Mapping
from pathlib import Path

from fivedc.errors import FivedcError, SourceLoc
from fivedc.ir.graph import Graph

DEFAULT_FACTORY = "factory"


def is_spec(text: str) -> bool:
    """True for `file.py:factory` or `file.py` (a Python model), False for a `.5d` file."""
    return parse_spec(text)[0].suffix == ".py"


def parse_spec(spec: str) -> tuple[Path, str]:
    """`dir/model.py:make` -> (path, "make"); the function defaults to `factory`."""
    path, sep, name = spec.rpartition(":")
    if not sep or not name.isidentifier() or not path:
        path, name = spec, DEFAULT_FACTORY
    return Path(path), name


def load_factory(spec: str, *, kwargs: Mapping[str, object] | None = None):
    """(module, example_inputs) from `file.py:factory` (called with `kwargs`, if given)."""
    from torch import Tensor, nn

    path, name = parse_spec(spec)
    where = SourceLoc(str(path), 1, 1)
    if not path.is_file():
        hint = "give a Python file and a function, e.g. examples/nanogpt.py:factory"
        raise FivedcError(f"{path} does not exist" if not path.exists() else f"{path} is not a file", hint=hint)
    if path.suffix != ".py":
        raise FivedcError(f"{path} is not a Python file", loc=where, hint="a .5d file is a DSL model, not a spec")
    source = import_file(path)
    factory = getattr(source, name, None)
    if not callable(factory):
        defined = [k for k, v in vars(source).items() if inspect.isfunction(v) and v.__module__ == source.__name__]
        close = difflib.get_close_matches(name, defined, n=3)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        what = " (it is not callable)" if hasattr(source, name) else ""
        raise FivedcError(f"{path} has no function {name!r}{what}", loc=where,
                          hint=hint + f"its functions: {', '.join(defined) or 'none'}")
    result = _call(factory, dict(kwargs or {}), f"{path}:{name}")
    loc = _def_loc(factory) or where
    if not (isinstance(result, tuple) and len(result) == 2):
        raise FivedcError(f"{name}() must return (module, example_inputs), got {_describe(result)}", loc=loc,
                          hint=f"end {name}() with `return model, (inputs, targets)`")
    module, inputs = result
    if not isinstance(module, nn.Module):
        raise FivedcError(f"{name}() returned {_describe(module)} where an nn.Module belongs", loc=loc,
                          hint=f"return (module, example_inputs) from {name}()")
    if isinstance(inputs, Tensor):
        inputs = (inputs,)
    if not isinstance(inputs, (tuple, list, dict)) or not inputs:
        raise FivedcError(f"{name}() returned example inputs of type {_describe(inputs)}", loc=loc,
                          hint="the example inputs are a tuple (or dict) of the forward's arguments")
    return module, dict(inputs) if isinstance(inputs, dict) else tuple(inputs)


def traced_from_spec(spec: str, *, kwargs: Mapping[str, object] | None = None,
                     stage_boundaries: tuple[str, ...] = (), weights: bool = True):
    """(module, example_inputs, TracedModel) of a `file.py:factory` spec; `stage_boundaries`:
    module-path patterns where a pipeline chunk begins (`trace_module`); `weights=False`: the
    factory runs under `fivedc.empty_weights()` (parameters on the meta device)."""
    import contextlib

    from fivedc.frontends.fx_module import trace_module
    from fivedc.frontends.weightless import empty_weights

    with contextlib.nullcontext() if weights else empty_weights():
        module, inputs = load_factory(spec, kwargs=kwargs)
    return module, inputs, trace_module(module, inputs, stage_boundaries=stage_boundaries)


def graph_from_spec(spec: str, *, stage_boundaries: tuple[str, ...] = (), weights: bool = True) -> Graph:
    """The IR graph of the module `file.py:factory` builds, traced on its example inputs."""
    return traced_from_spec(spec, stage_boundaries=stage_boundaries, weights=weights)[2].graph


def import_file(path: str | Path):
    """Import a Python file as a module, its folder first on `sys.path` while it runs
    (so it can import its siblings); imported once per path. A failure is a
    `FivedcError` at the user's line."""
    path = Path(path)
    resolved = path.resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:10]
    name = f"fivedc_user_{resolved.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    sys.path.insert(0, str(resolved.parent))
    try:
        spec.loader.exec_module(module)
    except SyntaxError as error:
        del sys.modules[name]
        loc = SourceLoc(error.filename or str(path), error.lineno or 1, error.offset or 1, error.text or "")
        raise FivedcError(f"{path} does not parse: {error.msg}", loc=loc) from None
    except BaseException as error:
        del sys.modules[name]
        if isinstance(error, FivedcError):
            raise
        if isinstance(error, KeyboardInterrupt):
            raise
        if isinstance(error, SystemExit):
            raise _exit_error(f"{path} exited during import", error) from None
        raise _user_error(f"importing {path} failed", error) from None
    finally:
        sys.path.remove(str(resolved.parent))
    return module


# ---- internals -------------------------------------------------------------------------
def _call(factory, kwargs: dict, what: str):
    try:
        return factory(**kwargs)
    except FivedcError:
        raise
    except SystemExit as error:
        raise _exit_error(f"{what}() exited", error,
                          hint="return (module, example_inputs) from it; raise an exception to refuse") from None
    except Exception as error:
        raise _user_error(f"{what}() failed", error) from None


def _user_error(what: str, error: BaseException) -> FivedcError:
    from fivedc.frontends.fx.locs import error_loc

    return FivedcError(f"{what}: {type(error).__name__}: {error}", loc=error_loc(error))


def _exit_error(what: str, error: SystemExit, *,
                hint: str = 'move the script\'s code under `if __name__ == "__main__":`') -> FivedcError:
    """A model file that calls `sys.exit` (or `exit`) while fivedc reads it: bad input at the call,
    never fivedc's own exit status."""
    from fivedc.frontends.fx.locs import error_loc

    return FivedcError(f"{what} (SystemExit({error.code!r})): a model file must define the model, not end the "
                       "process", loc=error_loc(error), hint=hint)


def _def_loc(fn) -> SourceLoc | None:
    from fivedc.frontends.fx.locs import def_loc

    return def_loc(fn)


def _describe(value: object) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)}"
    return type(value).__name__
