"""The ``math`` reward: is the response's boxed answer equivalent to the ground truth?

The answer is the last ``\\boxed{}`` of the last ``<answer>`` block, or of the whole response
when it has no answer block (``text.final_answer``; tool results are never the answer).

Equivalence, tried in order:
1. Both sides, after LaTeX clean-up, parse as exact values and the values are equal. Values
   are sums of rational multiples of square roots, ``q0 + q1*sqrt(r1) + ...`` with square-free
   integer radicands, held as ``{radicand: Fraction}``; so ``0.5 == \\frac{1}{2} == 1/2``,
   ``\\sqrt{8} == 2\\sqrt{2}`` and ``\\frac{1}{\\sqrt{2}} == \\frac{\\sqrt{2}}{2}``. Parsed:
   integers, decimals, thousands separators (``1,000``), ``\\frac``/``\\dfrac``/``\\tfrac``,
   ``a/b``, ``\\sqrt{}``, ``+ - * / \\cdot \\times``, implicit products (``3\\sqrt{3}``),
   integer powers, parentheses and braces.
2. Tuples and intervals (``(3, \\frac{\\pi}{2})``, ``[1, 2)``): same brackets, same number of
   items, items equivalent in order.
3. The cleaned-up strings are identical (``\\frac{\\pi}{2}``, ``x^2+1``, a letter choice).

Clean-up drops ``$``, spaces, ``\\left``/``\\right``, LaTeX spacing, ``\\text{}`` wrappers,
degree signs, percent signs (``50\\%`` == ``50``: the percent is read as a unit), trailing
unit words after a number (``5 cm``, ``90 degrees``) and a leading ``x =``. Cleaned-up answers
over 1,000 characters are compared as strings only, and every clean-up pattern is linear
(bounded time on adversarial output).
Not supported, on purpose (no sympy): symbolic algebra, pi/e arithmetic, unordered sets,
nested radicals and division by sums of radicals (these fall back to string comparison).
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from .base import RewardResult, as_ground_truths, register_reward
from .text import ToolSpans, final_answer, ground_truth_answer, strip_latex_wrappers

__all__ = ["math_reward", "math_equal", "normalize_math", "parse_value"]

# ---------------------------------------------------------------------------------------------
# Clean-up of LaTeX answers.

_DROP = ("\\left", "\\right", "\\displaystyle", "\\!", "\\,", "\\;", "\\:", "\\ ", "\\$",
         "$", "^\\circ", "^{\\circ}", "°", "\\%", "%")
# Unit words after a number: each word needs the whitespace before it, so a run of letters has
# one parse only (``(?:[a-zA-Z]{2,}\.?\s*)+`` split "aaaa" every way and took minutes on 40).
_UNIT = re.compile(r"(?<=[\d}])(?:\s+[a-zA-Z]{2,}\.?)+\s*$")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")


def normalize_math(text: str) -> str:
    """Canonical string form of a LaTeX answer (see the module docstring).

    Args:
        text: the answer, e.g. the content of ``\\boxed{}``.

    Returns:
        The cleaned-up string, without spaces.
    """
    text = strip_latex_wrappers(text.strip())
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("{,}", ",")
    for token in _DROP:
        text = text.replace(token, " ")
    text = _UNIT.sub("", text.strip())
    text = re.sub(r"^[a-zA-Z]\s*=(?!=)", "", text.strip())
    text = "".join(text.split()).rstrip(".")
    text = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", text)
    text = re.sub(r"\\sqrt(\d)", r"\\sqrt{\1}", text)
    return text.replace(",", "") if _THOUSANDS.match(text) else text


# ---------------------------------------------------------------------------------------------
# Exact values: {square-free radicand: rational coefficient}; radicand 1 is the rational part.

Value = dict[int, Fraction]
_MAX_RADICAND = 10**8  # trial division up to 10**4 then fully factors the square part
_MAX_EXPONENT = 64
_MAX_CHARS = 1000  # longer cleaned-up answers are only compared as strings
_MAX_BITS = 4096  # of any numerator/denominator built by a power: \boxed{(10^{64})^{64}} etc.


class Unsupported(ValueError):
    """The expression is outside the exact-value grammar."""


def _square_free(n: int) -> tuple[int, int]:
    """Write n = s*s*f with f square-free; return (s, f)."""
    if n > _MAX_RADICAND:
        raise Unsupported("radicand too large")
    s, f, i = 1, n, 2
    while i * i <= f:
        while f % (i * i) == 0:
            f //= i * i
            s *= i
        i += 1
    return s, f


def _clean(value: Value) -> Value:
    return {r: c for r, c in value.items() if c != 0}


def _add(a: Value, b: Value, sign: int = 1) -> Value:
    out = dict(a)
    for r, c in b.items():
        out[r] = out.get(r, Fraction(0)) + sign * c
    return _clean(out)


def _mul(a: Value, b: Value) -> Value:
    out: Value = {}
    for r1, c1 in a.items():
        for r2, c2 in b.items():
            s, f = _square_free(r1 * r2)
            out[f] = out.get(f, Fraction(0)) + c1 * c2 * s
    return _clean(out)


def _reciprocal(a: Value) -> Value:
    if len(a) != 1:
        raise Unsupported("division by zero or by a sum of radicals")
    (r, c), = a.items()
    return {r: 1 / (c * r)}  # 1 / (c sqrt r) = sqrt r / (c r)


def _sqrt(a: Value) -> Value:
    if not a:
        return {}
    if set(a) != {1} or a[1] < 0:
        raise Unsupported("nested or negative radical")
    q = a[1]  # sqrt(p/d) = sqrt(p*d) / d
    s, f = _square_free(q.numerator * q.denominator)
    return {f: Fraction(s, q.denominator)}


def _power(base: Value, exponent: Value) -> Value:
    if set(exponent) - {1} or exponent.get(1, Fraction(0)).denominator != 1:
        raise Unsupported("non-integer exponent")
    n = int(exponent.get(1, 0))
    if abs(n) > _MAX_EXPONENT:
        raise Unsupported("exponent too large")
    out: Value = {1: Fraction(1)}
    for _ in range(abs(n)):
        out = _mul(out, base)
        if any(max(c.numerator.bit_length(), c.denominator.bit_length()) > _MAX_BITS
               for c in out.values()):
            raise Unsupported("number too large")
    return _reciprocal(out) if n < 0 else out


# ---------------------------------------------------------------------------------------------
# A recursive-descent parser for the exact-value grammar:
#   expr  := term (('+' | '-') term)*
#   term  := unary (('*' | '/' | '\cdot' | '\times')? unary)*     (no operator: implicit product)
#   unary := ('-' | '+') unary | power
#   power := atom ('^' unary)?
#   atom  := number | '(' expr ')' | '{' expr '}' | '\frac' atom atom | '\sqrt' atom

_TOKEN = re.compile(r"\d+\.?\d*|\.\d+|\\[a-zA-Z]+|[-+*/^(){}]")
_PRODUCT_OPS = {"*", "\\cdot", "\\times"}
_ATOM_START = {"(", "{", "\\frac", "\\sqrt"}


def _tokenize(text: str) -> list[str]:
    tokens = _TOKEN.findall(text)
    if "".join(tokens) != text:
        raise Unsupported(f"unknown symbols in {text!r}")
    return tokens


class _Parser:
    def __init__(self, text: str):
        self.tokens, self.pos = _tokenize(text), 0

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if token is None or (expected is not None and token != expected):
            raise Unsupported(f"expected {expected or 'a token'}, got {token!r}")
        self.pos += 1
        return token

    def expr(self) -> Value:
        value = self.term()
        while self.peek() in ("+", "-"):
            sign = 1 if self.take() == "+" else -1
            value = _add(value, self.term(), sign)
        return value

    def term(self) -> Value:
        value = self.unary()
        while True:
            token = self.peek()
            if token in _PRODUCT_OPS or token == "/":
                self.take()
                rhs = self.unary()
                value = _mul(value, _reciprocal(rhs) if token == "/" else rhs)
            elif token is not None and (token in _ATOM_START or token[0].isdigit()):
                value = _mul(value, self.unary())
            else:
                return value

    def unary(self) -> Value:
        if self.peek() in ("-", "+"):
            sign = 1 if self.take() == "+" else -1
            return _mul({1: Fraction(sign)}, self.unary())
        return self.power()

    def power(self) -> Value:
        base = self.atom()
        if self.peek() == "^":
            self.take()
            return _power(base, self.unary())
        return base

    def atom(self) -> Value:
        token = self.take()
        if token[0].isdigit() or token[0] == ".":
            return _clean({1: Fraction(token)})
        if token in ("(", "{"):
            value = self.expr()
            self.take(")" if token == "(" else "}")
            return value
        if token == "\\frac":
            numerator = self.atom()
            return _mul(numerator, _reciprocal(self.atom()))
        if token == "\\sqrt":
            return _sqrt(self.atom())
        raise Unsupported(f"unexpected {token!r}")


def parse_value(text: str) -> Value | None:
    """Exact value of a cleaned-up answer, or ``None`` outside the grammar.

    Args:
        text: output of :func:`normalize_math`.

    Returns:
        ``{square-free radicand: coefficient}`` (zero is ``{}``), or ``None``.
    """
    try:
        parser = _Parser(text)
        value = parser.expr()
        return value if parser.peek() is None else None
    except (Unsupported, ZeroDivisionError, RecursionError):  # RecursionError: "((((...1"
        return None


# ---------------------------------------------------------------------------------------------
# Equivalence and the reward.

def _split_items(text: str) -> tuple[str, list[str], str]:
    """Split ``(a,b)`` / ``[a,b)`` / ``a,b`` at top-level commas: (open, items, close)."""
    opening, closing = "", ""
    if len(text) >= 2 and text[0] in "([" and text[-1] in ")]":
        opening, closing, text = text[0], text[-1], text[1:-1]
    items, depth, start = [], 0, 0
    for pos, ch in enumerate(text):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            items.append(text[start:pos])
            start = pos + 1
    return opening, items + [text[start:]], closing


def _value_float(value: Value) -> float:
    return sum(float(c) * r ** 0.5 for r, c in value.items())


def math_equal(prediction: str, ground_truth: str, rel_tol: float = 0.0) -> bool:
    """Whether two maths answers are equivalent (rules in the module docstring).

    Args:
        prediction: the model's answer (content of ``\\boxed{}``).
        ground_truth: the ground-truth answer.
        rel_tol: 0 compares parsed values exactly; > 0 compares them as floats with this
            relative tolerance (for ground truths rounded to a few decimals).

    Returns:
        ``True`` if equivalent.
    """
    pred, truth = normalize_math(prediction), normalize_math(ground_truth)
    if pred == truth:
        return True
    if max(len(pred), len(truth)) > _MAX_CHARS:
        return False
    pred_value, truth_value = parse_value(pred), parse_value(truth)
    if pred_value is not None and truth_value is not None:
        if rel_tol <= 0:
            return pred_value == truth_value
        a, b = _value_float(pred_value), _value_float(truth_value)
        return abs(a - b) <= rel_tol * max(abs(a), abs(b))
    pred_open, pred_items, pred_close = _split_items(pred)
    truth_open, truth_items, truth_close = _split_items(truth)
    if len(truth_items) < 2 or (pred_open, pred_close) != (truth_open, truth_close):
        return False
    return len(pred_items) == len(truth_items) and all(
        math_equal(p, r, rel_tol) for p, r in zip(pred_items, truth_items))


@register_reward("math")
def math_reward(response: str, ground_truth: Any, *, rel_tol: float = 0.0,
                tool_spans: ToolSpans | None = None) -> RewardResult:
    """1.0 if the response's boxed answer (module docstring) is equivalent to any ground truth, else 0.0.

    Args:
        response: the model's text.
        ground_truth: a string, a list of strings, or a JSON-encoded list of strings.
        rel_tol: see :func:`math_equal`.
        tool_spans: where the engine put the tool results (``rewards.text.strip_tool_results``).

    Returns:
        ``RewardResult(score, correct, details={answer})``; a response without ``\\boxed{}``
        scores 0 with ``details["format_error"]``.
    """
    answer = final_answer(response, require_box=True, tool_spans=tool_spans)
    if answer is None:
        return RewardResult(0.0, False, {"format_error": "no \\boxed{}"})
    truths = [ground_truth_answer(truth) for truth in as_ground_truths(ground_truth)]
    correct = any(math_equal(answer, truth, rel_tol) for truth in truths)
    return RewardResult(float(correct), correct, {"answer": answer})
