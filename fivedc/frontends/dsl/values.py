"""Values in the DSL: literals (numbers, strings, true/false) and integer dim expressions.

`Values` is the base of the lowering in `fivedc/frontends/dsl/lower.py`: it evaluates what the
grammar leaves as text, with every mistake a `DslError` at its token (a number out
of range, a float where a dim needs an integer, a division that is not exact). It
needs `self.src` (a `Source`) and `self.dim_value(name)` from the lowering.
`show` and `close` write numbers and did-you-mean suggestions for messages.
"""

from __future__ import annotations

import difflib
import math

from lark import Token, Tree

from fivedc.ir.graph import Scalar

MAX_DEPTH = 64  # nested calls or parentheses; keeps the walk far from Python's recursion limit


class Values:
    def literal(self, node: Tree | Token, *, words: bool) -> Scalar:
        if isinstance(node, Token):  # STRING
            return node[1:-1]
        if node.data == "signed":
            return self.number(node)
        word = str(node.children[0])
        if word in ("true", "false"):
            return word == "true"
        if words:
            return word
        message = f'expected a number, a "string", true or false, got {word}'
        raise self.src.error(node, message, f'quote it: "{word}"')

    def number(self, tree: Tree) -> int | float:
        *sign, token = tree.children
        value = self.int_token(token) if token.type == "INT" else float(token)
        if not math.isfinite(value):
            raise self.src.error(token, f"number {token[:20]} is out of range")
        return -value if sign else value

    def int_token(self, token: Token) -> int:
        try:
            return int(token)
        except ValueError:  # more digits than Python converts
            raise self.src.error(token, f"number {token[:20]}... has too many digits") from None

    def as_float(self, node: Tree | Token, value: int | float) -> float:
        try:
            return float(value)
        except OverflowError:
            raise self.src.error(node, f"number {show(value)} is too large") from None

    def expr(self, node: Tree, depth: int) -> int:
        if depth > MAX_DEPTH:
            raise self.src.error(node, f"expression is nested more than {MAX_DEPTH} deep")
        kind, children = node.data, node.children
        if kind == "int_lit":
            return self.int_token(children[0])
        if kind == "float_lit":
            raise self.src.error(node, f"dims are integers, got {children[0]}")
        if kind == "dim_ref":
            return self.dim_value(children[0])
        if kind == "paren":
            return self.expr(children[0], depth + 1)
        value = self.expr(children[0], depth + 1)
        for i in range(1, len(children), 2):
            op, right = children[i], self.expr(children[i + 1], depth + 1)
            value = self.apply(op, value, right, children[0], children[i - 1], children[i + 1])
        return value

    def apply(self, op: Token, left: int, right: int, first: Tree, last: Tree, rhs: Tree) -> int:
        if op == "+":
            return left + right
        if op == "-":
            return left - right
        if op == "*":
            return left * right
        shown = f"{self.src.span(first, last)} / {self.src.span(rhs, rhs)}"
        shown += f" = {show(left)} / {show(right)}"
        if right == 0:
            raise self.src.error(op, f"{shown} divides by zero")
        if left % right:
            raise self.src.error(op, f"{shown} is not an integer")
        return left // right


def show(value: Scalar) -> str:
    """A number for a message; Python refuses str() of ints past 4300 digits."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"a {value.bit_length()}-bit number"
    return str(value).lower() if isinstance(value, bool) else str(value)


def close(word: str, choices) -> str:
    """`did you mean 'x'?` for the nearest of `choices`, or ""."""
    match = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1)
    return f"did you mean '{match[0]}'?" if match else ""
