"""Source locations for the fx frontend: the user's file and line of an fx node or a failure.

An IR node made from an fx node carries the location of the innermost frame of
*user* code that created it: not torch, not fivedc, not the standard library
(installed packages count as user code). The tracer records it per node
(`fivedc.frontends.fx.trace._Tracer.create_node`) in the fx node's `stack_trace`, in the
format torch uses, and `torch.export` fills the same field.
"""

from __future__ import annotations

import functools
import inspect
import linecache
import os
import re
import sys
import sysconfig
import traceback

import torch
import torch.fx as fx

import fivedc
from fivedc.errors import SourceLoc

_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_LIBS = (os.path.dirname(torch.__file__) + os.sep, *(str(folder) + os.sep for folder in fivedc.folders()))
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep
_INSTALLED = tuple({sysconfig.get_paths()[k] + os.sep for k in ("purelib", "platlib")})


def make_loc(file: str, line: int) -> SourceLoc:
    text = linecache.getline(file, line).rstrip("\n")
    return SourceLoc(file, line, len(text) - len(text.lstrip()) + 1, text)


def user_loc(frames: list[tuple[str, int]]) -> SourceLoc | None:
    """The innermost frame of user code (not torch, not fivedc, not the standard library)."""
    for file, line in reversed(frames):
        if _is_user(file):
            return make_loc(file, line)
    return None


@functools.lru_cache(maxsize=8192)
def _is_user(file: str) -> bool:
    """Asked for every frame of every traced node: millions of times for a library model
    (hundreds of frames deep), so cached by the frame's file name."""
    if file.startswith("<"):
        return False
    path = os.path.abspath(file)
    installed = path.startswith(_INSTALLED) or any(part in ("site-packages", "dist-packages")
                                                  for part in path.split(os.sep))  # a venv's base packages too
    stdlib = path.startswith(_STDLIB) and not installed
    return not stdlib and not path.startswith(_LIBS)


def node_loc(node: fx.Node) -> SourceLoc | None:
    trace = node.stack_trace or node.meta.get("stack_trace") or ""
    return user_loc([(f, int(n)) for f, n in _FRAME.findall(trace)])


def error_loc(error: BaseException) -> SourceLoc | None:
    return user_loc([(f.filename, f.lineno or 1) for f in traceback.extract_tb(error.__traceback__)])


def def_loc(fn) -> SourceLoc | None:
    try:
        return make_loc(inspect.getsourcefile(fn) or "<unknown>", inspect.getsourcelines(fn)[1])
    except (OSError, TypeError):
        return None


def caller_loc() -> SourceLoc | None:
    """`user_loc(frames())` without listing every frame: the innermost user frame calling this."""
    frame = sys._getframe(1)
    while frame is not None:
        if _is_user(frame.f_code.co_filename):
            return make_loc(frame.f_code.co_filename, frame.f_lineno)
        frame = frame.f_back
    return None


def frames() -> list[tuple[str, int]]:
    """(file, line) of the Python frames calling this, outermost first."""
    found, frame = [], sys._getframe(1)
    while frame is not None:
        found.append((frame.f_code.co_filename, frame.f_lineno))
        frame = frame.f_back
    return found[::-1]


def scope(node: fx.Node) -> tuple[str, ...]:
    """The module paths a node was traced in, outermost first (the tracer's `nn_module_stack`)."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = [v[0] for v in stack.values() if isinstance(v, tuple) and v and v[0]]
    if node.op == "call_module" and str(node.target) not in paths:
        paths.append(str(node.target))
    return tuple(paths)
