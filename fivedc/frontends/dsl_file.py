"""The DSL frontend: model text (`examples/*.5d`) to a `fivedc.ir.graph.Graph`.

`parse_model` parses with one cached LALR parser built from `grammars/fivedc.lark`
and hands the tree to `fivedc.frontends.dsl.lower`, which checks names, dims and op calls and
builds the IR. A syntax error becomes a `DslError` at the offending character with
the expected tokens in plain words; no lark exception, and no other exception type,
ever leaves `parse_model`, whatever the text.
"""

from __future__ import annotations

import functools
from importlib.resources import files
from pathlib import Path

import lark
from lark.exceptions import LarkError, UnexpectedCharacters, UnexpectedInput, UnexpectedToken

from fivedc.frontends.dsl.lower import Source, lower
from fivedc.errors import DslError
from fivedc.ir.graph import Graph

# How the terminals of the grammar read in a message; the others are quoted literally.
_WORDS = {
    "NAME": "a name",
    "INT": "a number",
    "FLOAT": "a number",
    "STRING": "a string",
    "$END": "the end of the file",
}
_ORDER = ("a name", "a number", "a string")
_KINDS = {"NAME": "name ", "INT": "number ", "FLOAT": "number ", "STRING": "string "}


@functools.cache
def _parser() -> lark.Lark:
    grammar = files("fivedc.grammars").joinpath("fivedc.lark").read_text(encoding="utf-8")
    return lark.Lark(grammar, parser="lalr", propagate_positions=True)


def parse_model(text: str, *, filename: str = "<model>") -> Graph:
    """Parse and lower one model; every problem with the text raises `DslError`."""
    source = Source.of(text, filename)
    try:
        tree = _parser().parse(text)
    except UnexpectedInput as error:
        raise _syntax_error(error, source) from None
    except LarkError as error:  # not expected from an LALR parse, but never let one out
        raise DslError(f"cannot parse the model: {error}", loc=source.loc(1, 1)) from None
    try:
        return lower(tree, source)
    except RecursionError:
        raise DslError("the model is nested too deeply", loc=source.loc(1, 1)) from None


def load_model(path: str | Path) -> Graph:
    """Read and parse a model file; `Graph.source` is `path` as given."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DslError(f"model file {path} does not exist") from None
    except UnicodeDecodeError:
        raise DslError(f"model file {path} is not UTF-8 text") from None
    except OSError as error:
        raise DslError(f"cannot read model file {path}: {error.strerror or error}") from None
    return parse_model(text, filename=str(path))


def _syntax_error(error: UnexpectedInput, source: Source) -> DslError:
    if isinstance(error, UnexpectedToken):
        token = error.token
        if token.type == "$END":
            loc = source.loc(getattr(token, "end_line", None), getattr(token, "end_column", None))
        else:
            loc = source.loc(token.line, token.column)
        found = _describe_token(token)
        expected = _accepted(error)
    elif isinstance(error, UnexpectedCharacters):
        loc = source.loc(error.line, error.column)
        found = f"character {_show_char(error.char)}"
        expected = set(error.allowed or ())
    else:  # UnexpectedEOF, which the LALR parser reports as an UnexpectedToken
        loc, found, expected = source.loc(error.line, error.column), "end of the file", set()
    words = _expected_words(expected)
    return DslError(f"unexpected {found}" + (f": expected {words}" if words else ""), loc=loc)


def _accepted(error: UnexpectedToken) -> set[str]:
    """The terminals that would really have been accepted (lark's `accepts`), else `expected`."""
    try:
        return set(error.accepts or error.expected)
    except Exception:  # computing `accepts` replays the parser; fall back to the raw set
        return set(error.expected)


def _describe_token(token: lark.Token) -> str:
    if token.type == "$END":
        return "end of the file"
    text = token.value if len(token.value) <= 20 else token.value[:20] + "..."
    kind = _KINDS.get(token.type, "")
    return f"{kind}{text}" if token.type == "STRING" else f"{kind}'{text}'"


def _expected_words(names: set[str]) -> str:
    words: set[str] = set()
    for name in names:
        if name in _WORDS:
            words.add(_WORDS[name])
            continue
        try:
            pattern = _parser().get_terminal(name).pattern
        except KeyError:
            continue
        if pattern.type == "str":
            words.add(f"'{pattern.value}'")
    ordered = sorted(words, key=lambda w: (_ORDER.index(w) if w in _ORDER else len(_ORDER), w))
    if len(ordered) < 2:
        return "".join(ordered)
    return ", ".join(ordered[:-1]) + " or " + ordered[-1]


def _show_char(char: str) -> str:
    return f"'{char}'" if char.isprintable() else f"U+{ord(char):04X}"
