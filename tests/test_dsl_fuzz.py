"""Property tests of the DSL frontend: whatever the text, `parse_model` returns a `Graph` or
raises a `FivedcError` subclass, never another exception.

The inputs are random text (any unicode, and text drawn from the language's own characters)
and the example models mutated by deleting, inserting and replacing characters or tokens and
by swapping lines. A graph that does come back must keep the SSA contract: every value name
is defined once in the graph and every op argument names a value or param in scope.
"""

from __future__ import annotations

import re
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fivedc.errors import FivedcError
from fivedc.frontends.dsl_file import parse_model
from fivedc.ir.graph import Block, Graph, Op, Repeat

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.5d"))
TEXTS = [path.read_text() for path in EXAMPLES]
TOKENS = [
    "{", "}", "(", ")", "[", "]", ",", "=", ":", "@", "-", "/", "*", "+", "#", "\n", '"s"',
    "model", "dims", "input", "param", "repeat", "as", "return", "int", "float", "ones",
    "normal(0.5)", "true", "x", "hidden", "layers", "0", "7", "1.5", "1e-9", "@col", "@cp(ring)",
    "relu(", "linear(x, w)", "repeat 2 as r {", "\x00", "\u00e9",
]
ALPHABET = list('{}()[],=:@#\n 0123456789.-+*/"xyz_') + TOKENS
LEXEME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9.eE+-]+|\s+|.", re.S)
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _check(text: str) -> None:
    try:
        graph = parse_model(text, filename="fuzz.5d")
    except FivedcError as error:
        error.render()
        assert error.loc is None or (error.loc.line >= 1 and error.loc.col >= 1)
        return
    _check_graph(graph)


def _check_graph(graph: Graph) -> None:
    defined = [i.name for i in graph.inputs]
    _check_block(graph.body, set(defined), set(), defined)
    assert len(defined) == len(set(defined)), "an SSA name is defined twice"
    assert graph.output in defined


def _check_block(block: Block, visible: set[str], params: set[str], defined: list[str]) -> None:
    visible = visible | set(block.args)
    params = params | {p.name for p in block.params}
    defined.extend(block.args)
    for item in block.items:
        if isinstance(item, Op):
            assert set(item.reads) <= visible | params, item
            visible.add(item.out)
            defined.append(item.out)
        else:
            assert isinstance(item, Repeat) and set(item.carried) <= visible
            _check_block(item.body, visible, params, defined)
            visible |= set(item.results)
            defined.extend(item.results)
    assert set(block.yields) <= visible


@st.composite
def _mutated(draw: st.DrawFn) -> str:
    text = draw(st.sampled_from(TEXTS))
    for _ in range(draw(st.integers(1, 4))):
        text = draw(_mutation(text))
    return text


def _mutation(text: str) -> st.SearchStrategy[str]:
    at = st.integers(0, len(text))
    piece = st.one_of(st.sampled_from(TOKENS), st.characters(), st.text(max_size=3))
    lexemes = LEXEME.findall(text)
    lines = text.split("\n")
    line = st.integers(0, len(lines) - 1)
    return st.one_of(
        st.builds(lambda i, n: text[:i] + text[i + n :], at, st.integers(1, 12)),  # delete
        st.builds(lambda i, p: text[:i] + p + text[i:], at, piece),  # insert
        st.builds(lambda i, p: text[:i] + p + text[i + 1 :], at, piece),  # replace
        st.builds(lambda i: "".join(lexemes[:i] + lexemes[i + 1 :]), st.integers(0, len(lexemes))),
        st.builds(
            lambda i, t: "".join(lexemes[:i] + [t] + lexemes[i + 1 :]),
            st.integers(0, len(lexemes)),
            st.sampled_from(TOKENS),
        ),
        st.builds(lambda i, j: _swap(lines, i, j), line, line),
    )


def _swap(lines: list[str], i: int, j: int) -> str:
    lines = list(lines)
    lines[i], lines[j] = lines[j], lines[i]
    return "\n".join(lines)


@SETTINGS
@given(st.text())
def test_random_text(text: str) -> None:
    _check(text)


@SETTINGS
@given(st.lists(st.sampled_from(ALPHABET), max_size=80).map("".join))
def test_random_text_from_the_language_alphabet(text: str) -> None:
    _check(text)


@SETTINGS
@given(_mutated())
def test_mutated_examples(text: str) -> None:
    _check(text)


def test_the_examples_keep_the_ssa_contract() -> None:
    for text in TEXTS:
        _check_graph(parse_model(text))
