"""Tests of the DSL frontend's user errors: each mistake is a `DslError` with the right
message at the right line:col (found with `_at` from tests/test_dsl.py), rendered with the
source line and a caret; syntax errors name what was expected in plain words. The errors
of pipeline marks (`@stage`) are in tests/test_stage_marks.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fivedc.errors import DslError
from fivedc.frontends.dsl_file import load_model
from test_dsl import _at, _error, _model, _where


# ---- errors: names, dims, calls -----------------------------------------------------------
def test_unknown_op_suggests_a_name() -> None:
    text = _model("  y = lienar(t, w)\n  return y")
    error = _error(text)
    assert (error.message, error.hint) == ("unknown op 'lienar'", "did you mean 'linear'?")
    assert _where(error) == _at(text, "lienar")


@pytest.mark.parametrize(
    "call, message",
    [
        ("add(t)", "add takes 2 arguments (a, b), got 1"),
        ("relu(t, t)", "relu takes 1 argument (x), got 2"),
        ("layernorm(t, w, w, w)", "layernorm takes 2 to 3 arguments (x, w, b), got 4"),
    ],
)
def test_argument_count(call: str, message: str) -> None:
    text = _model(f"  y = add(t, {call})\n  return y")
    error = _error(text)
    assert error.message == message
    assert _where(error) == _at(text, call)


def test_unknown_keyword_lists_the_allowed_ones() -> None:
    text = _model("  y = rmsnorm(t, w, epsilon=1e-5)\n  return y")
    error = _error(text)
    assert error.message == "rmsnorm has no keyword 'epsilon'; allowed: eps"
    assert _where(error) == _at(text, "epsilon")
    error = _error(_model("  y = relu(t, k=1)\n  return y"))
    assert error.message == "relu has no keyword 'k'; it takes no keyword arguments"


def test_keyword_value_of_the_wrong_type() -> None:
    text = _model("  y = moe(t, w, w, w, top_k=2.5)\n  return y")
    error = _error(text)
    assert error.message == "moe's top_k takes an integer, got 2.5"
    assert _where(error) == _at(text, "2.5")
    error = _error(_model("  y = attention(t, t, t, causal=yes)\n  return y"))
    assert error.message == 'expected a number, a "string", true or false, got yes'


def test_undefined_name() -> None:
    text = _model("  y = add(t, wx)\n  return y")
    error = _error(text)
    assert error.message == "undefined name 'wx'"
    assert _where(error) == _at(text, "wx")
    assert error.hint == "did you mean 'w'?"


def test_positional_after_keyword() -> None:
    text = _model("  y = rmsnorm(t, eps=1e-5, w)\n  return y")
    assert _where(_error(text)) == _at(text, "w)")


@pytest.mark.parametrize(
    "body, marker, message",
    [
        ("  param w: [h]\n  return t", "w: [h]\n  return", "param w is declared twice (first at m.5d:8:3)"),
        ("  param t: [h]\n  return t", "t: [h]", "param t clashes with the input t defined at m.5d:7:9"),
        (
            "  y = relu(t)\n  param y: [h]\n  return y",
            "y: [h]",
            "param y clashes with the value y defined at m.5d:9:3",
        ),
        (
            "  w = relu(t)\n  return w",
            "w = relu",
            "w is already a param (declared at m.5d:8:9); name the value differently",
        ),
        (
            "  repeat b { param w: [h] }\n  return t",
            "w: [h] }",
            "param w is declared twice (first at m.5d:8:3)",
        ),
    ],
)
def test_name_clashes(body: str, marker: str, message: str) -> None:
    text = _model(body)
    error = _error(text)
    assert error.message == message
    assert _where(error) == _at(text, marker)


def test_undefined_dim_in_a_shape_and_in_an_expression() -> None:
    text = _model("  param v: [h, hh]\n  return t")
    error = _error(text)
    assert (error.message, error.hint) == ("undefined dim hh", "did you mean 'h'?")
    assert _where(error) == _at(text, "hh")
    text = "model m {\n  dims {\n    a = 2 * later\n    later = 3\n  }\n}"
    error = _error(text)
    assert error.message == "undefined dim later" and _where(error) == (3, 13)


def test_dim_defined_twice() -> None:
    text = "model m {\n  dims {\n    a = 2\n    a = 3\n  }\n}"
    error = _error(text)
    assert error.message == "dim a is defined twice (first at m.5d:3:5)"
    assert _where(error) == (4, 5)


@pytest.mark.parametrize(
    "expr, message",
    [("0", "dim d = 0 must be at least 1"), ("2 - 4", "dim d = 2 - 4 = -2 must be at least 1")],
)
def test_dim_must_be_positive(expr: str, message: str) -> None:
    text = f"model m {{\n  dims {{\n    d = {expr}\n  }}\n}}"
    error = _error(text)
    assert error.message == message and _where(error) == (3, 5)


def test_division_must_be_exact() -> None:
    text = "model m {\n  dims {\n    hidden = 64\n    heads = 5\n    head_dim = hidden / heads\n  }\n}"
    error = _error(text)
    assert error.message == "hidden / heads = 64 / 5 is not an integer"
    assert _where(error) == _at(text, "/")
    error = _error("model m { dims { a = (2 + 4) / (3 - 3) } }")
    assert error.message == "(2 + 4) / (3 - 3) = 6 / 0 divides by zero"


def test_dims_are_integers() -> None:
    error = _error("model m { dims { a = 1.5 } }")
    assert error.message == "dims are integers, got 1.5" and _where(error) == (1, 22)


# ---- errors: structure --------------------------------------------------------------------
def test_return_must_name_a_value() -> None:
    text = _model("  return nothing")
    error = _error(text)
    assert error.message == "undefined name 'nothing'" and _where(error) == _at(text, "nothing")
    error = _error(_model("  return w"))
    assert error.message == "return needs a value, but w is a param"


def test_return_must_be_last() -> None:
    text = _model("  return t\n  y = relu(t)")
    error = _error(text)
    assert error.message == "return must be the last statement of the model"
    assert _where(error) == _at(text, "return")


def test_missing_return_is_reported_at_the_closing_brace() -> None:
    text = _model("  y = relu(t)")
    error = _error(text)
    assert error.message == "model m has no return"
    assert _where(error) == (10, 1) and error.loc.text == "}"


def test_nested_repeat() -> None:
    text = _model("  repeat b {\n    repeat s { }\n  }\n  return t")
    error = _error(text)
    assert error.message == "nested repeat is not supported"
    assert _where(error) == _at(text, "repeat s")


def test_repeat_prefixes() -> None:
    text = _model("  repeat b { }\n  repeat 2 as b { }\n  return t")
    error = _error(text)
    assert error.message == "two repeats are named b (the first at m.5d:9:3)"
    assert _where(error) == _at(text, "b { }", 1)
    text = _model("  repeat 2 * b { }\n  return t")
    error = _error(text)
    assert error.message == "name this repeat: `repeat N as NAME { ... }`"
    assert _where(error) == _at(text, "2 * b")


def test_inputs_must_share_the_batch_dim() -> None:
    text = _model("  input u: int[s, b]\n  return t")
    error = _error(text)
    assert error.message == (
        "input u starts with dim s, but every input must start with the batch dim b "
        "(the first dim of input t)"
    )
    assert _where(error) == _at(text, "input u")


def test_model_without_inputs() -> None:
    error = _error("model m {\n  dims { b = 2 }\n  param w: [b]\n  y = relu(w)\n  return y\n}")
    assert error.message == "model m has no inputs" and _where(error) == (1, 1)


@pytest.mark.parametrize("where", ["call", "model", "repeat"])
def test_unknown_annotation(where: str) -> None:
    text = {"call": _model("  y = relu(t) @tp\n  return y"), "model": "model m @tp { }",
            "repeat": _model("  repeat 2 as r @tp { }\n  return t")}[where]
    error = _error(text)
    expected = "unknown annotation @tp; allowed: @col, @row, @replicate, @sp, @cp, @ep, @stage, @recompute"
    assert error.message == expected
    assert _where(error) == _at(text, "@tp")


# ---- errors: syntax -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, marker, message",
    [
        ("model m { dims { a = } }", "} }", "unexpected '}': expected a name, a number or '('"),
        ("model m { x = 3 }", "3", "unexpected number '3': expected a name"),
        ("model m { $ }", "$", "unexpected character '$': expected a name or '}'"),
        ("model m {\n  x = relu(t))\n}", "))", None),
        ("model m { return x } extra", "extra", "unexpected name 'extra': expected the end of the file"),
    ],
)
def test_syntax_errors(text: str, marker: str, message: str | None) -> None:
    error = _error(text)
    if message is not None:
        assert error.message == message
    line, col = _at(text, marker)
    assert _where(error) == ((line, col + 1) if marker == "))" else (line, col))


def test_syntax_error_at_the_end_of_the_file() -> None:
    error = _error("model m {\n  dims { a = 2 }\n")
    assert error.message.startswith("unexpected end of the file: expected a name, 'dims'")
    assert _where(error) == (2, 17)
    error = _error("")
    assert error.message == "unexpected end of the file: expected 'model'" and _where(error) == (1, 1)


def test_nesting_too_deep_is_an_error() -> None:
    call = "relu(" * 500 + "t" + ")" * 500
    assert "nested" in _error(_model(f"  y = {call}\n  return y")).message
    expr = "(" * 5000 + "2" + ")" * 5000
    assert "nested" in _error(f"model m {{ dims {{ a = {expr} }} }}").message


def test_huge_numbers_are_errors() -> None:
    assert "too many digits" in _error(f"model m {{ dims {{ a = {'9' * 5000} }} }}").message
    assert "out of range" in _error(_model("  y = add(t, 1e999)\n  return y")).message
    assert "too large" in _error("model m { dims { a = 99999999999 * 99999999999 } }").message


# ---- rendering and files ------------------------------------------------------------------
def test_render_shows_file_line_column_and_a_caret() -> None:
    text = _model("  y = lienar(t, w)\n  return y")
    lines = _error(text).render().splitlines()
    assert lines[0] == "m.5d:9:7: error: unknown op 'lienar'"
    assert lines[1] == "      y = lienar(t, w)"
    assert lines[2] == "    " + " " * 6 + "^"
    assert lines[3] == "hint: did you mean 'linear'?"


def test_load_model_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DslError, match="does not exist"):
        load_model(tmp_path / "nope.5d")


def test_load_model_sets_the_source(tmp_path: Path) -> None:
    path = tmp_path / "m.5d"
    path.write_text(_model("  return t"))
    assert load_model(path).source == str(path)
    graph = load_model(str(path))
    assert graph.source == str(path) and graph.inputs[0].loc.file == str(path)


def test_a_dim_appears_once_per_shape() -> None:
    text = _model("  param v: [h, h]\n  return t")
    error = _error(text)
    assert error.message == "dim h appears twice in one shape" and _where(error) == _at(text, "h]\n  return")
