"""Derived expressions: numbers, metric names, ``+ - * /`` and parentheses.

Parsed by a small recursive-descent parser (never ``eval``) into a tree that is
evaluated exactly over :class:`~fractions.Fraction` values and rounded once by the
caller. Decimal literals are exact (``0.1`` means one tenth). An operand that is
non-finite switches that operation to IEEE float arithmetic, so NaN and the
infinities propagate as they would in float64; a zero denominator makes the
result undefined, with the reason.

Evaluation is bounded (:class:`Budget`): an operand whose exact value has more than
``MAX_VALUE_BITS`` bits makes its expression undefined, and so does every operation
past a step's work budget, so no spec, however it got into a database, can keep a
thread busy for long. :func:`cost` measures a spec before it is accepted.
"""

from __future__ import annotations

import contextlib
import math
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction

from steptally.client.algebra.errors import ExpressionError

Exact = Fraction | float  # a float here is always NaN or an infinity

_TOKEN = re.compile(
    r"\s*(?:(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)|([A-Za-z_]\w*)|(.))"
)
MAX_LENGTH = 1000
MAX_DIGITS = 64  # a literal's digits, and the size of its decimal exponent: a literal is
MAX_EXPONENT = 400  # exact, so 1e999999999 would be a billion-digit integer
MAX_DEPTH = 100  # nested signs and parentheses
MAX_VALUE_BITS = 1 << 16  # an exact operand's numerator and denominator bits (~8 ms a product)
WORK_BUDGET = 1 << 14  # work units of one evaluation of all of a step's derived values


class Undefined(Exception):
    """Raised during evaluation when a value is undefined; ``args[0]`` is the reason."""


@dataclass(frozen=True, slots=True)
class Num:
    value: Fraction

    def __str__(self) -> str:
        return str(self.value) if self.value.denominator == 1 else f"({self.value})"


@dataclass(frozen=True, slots=True)
class Name:
    name: str

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True, slots=True)
class Neg:
    operand: Node

    def __str__(self) -> str:
        return f"(-{self.operand})"


@dataclass(frozen=True, slots=True)
class BinOp:
    op: str
    left: Node
    right: Node

    def __str__(self) -> str:
        return f"({self.left} {self.op} {self.right})"


Node = Num | Name | Neg | BinOp


def _tokenize(text: str) -> list[tuple[str, str]]:
    tokens: list[tuple[str, str]] = []
    pos = 0
    stripped = text.rstrip()
    while pos < len(stripped):
        m = _TOKEN.match(stripped, pos)
        assert m is not None  # the last alternative matches any character
        number, name, other = m.groups()
        if number is not None:
            tokens.append(("num", number))
        elif name is not None:
            tokens.append(("name", name))
        elif other in "+-*/()":
            tokens.append(("op", other))
        else:
            raise ExpressionError(f"unexpected character {other!r} at position {m.start(3)}")
        pos = m.end()
    return tokens


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = _tokenize(text)
        self.pos = 0
        self.depth = 0

    def _peek(self) -> tuple[str, str] | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _fail(self, what: str) -> ExpressionError:
        return ExpressionError(f"expression {self.text!r}: {what}")

    def parse(self) -> Node:
        if not self.tokens:
            raise self._fail("it is empty")
        node = self._sum()
        if self._peek() is not None:
            raise self._fail(f"unexpected {self._peek()[1]!r}")  # type: ignore[index]
        return node

    def _sum(self) -> Node:
        node = self._product()
        while (tok := self._peek()) is not None and tok[1] in ("+", "-") and tok[0] == "op":
            self.pos += 1
            node = BinOp(tok[1], node, self._product())
        return node

    def _product(self) -> Node:
        node = self._unary()
        while (tok := self._peek()) is not None and tok[1] in ("*", "/") and tok[0] == "op":
            self.pos += 1
            node = BinOp(tok[1], node, self._unary())
        return node

    def _unary(self) -> Node:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise self._fail(f"it nests signs and parentheses more than {MAX_DEPTH} deep")
        tok = self._peek()
        if tok == ("op", "-"):
            self.pos += 1
            node: Node = Neg(self._unary())
        elif tok == ("op", "+"):
            self.pos += 1
            node = self._unary()
        else:
            node = self._atom()
        self.depth -= 1
        return node

    def _number(self, text: str) -> Fraction:
        mantissa, _, exponent = text.lower().partition("e")
        if len(mantissa) > MAX_DIGITS or (exponent and abs(int(exponent)) > MAX_EXPONENT):
            raise self._fail(
                f"the number {text!r} is out of range: use at most {MAX_DIGITS} digits "
                f"and an exponent from -{MAX_EXPONENT} to {MAX_EXPONENT}"
            )
        return Fraction(text)

    def _atom(self) -> Node:
        tok = self._peek()
        if tok is None:
            raise self._fail("it ends too early")
        self.pos += 1
        kind, text = tok
        if kind == "num":
            return Num(self._number(text))
        if kind == "name":
            return Name(text)
        if text == "(":
            node = self._sum()
            if self._peek() != ("op", ")"):
                raise self._fail("a '(' is not closed")
            self.pos += 1
            return node
        raise self._fail(f"unexpected {text!r}")


def parse(text: str) -> Node:
    """Parse ``text`` into an expression tree, or raise :class:`ExpressionError`."""
    if not isinstance(text, str):
        raise ExpressionError(f"a derived expression must be a string, not {type(text).__name__}")
    if len(text) > MAX_LENGTH:
        raise ExpressionError(f"expression is longer than {MAX_LENGTH} characters")
    return _Parser(text).parse()


def names(node: Node) -> set[str]:
    """Every metric name the expression refers to."""
    if isinstance(node, Name):
        return {node.name}
    if isinstance(node, Neg):
        return names(node.operand)
    if isinstance(node, BinOp):
        return names(node.left) | names(node.right)
    return set()


def canonical(node: Node) -> str:
    """A text that is equal for two expressions exactly when their trees are equal."""
    return str(node)


def _float_op(op: str, a: float, b: float) -> float:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return a / b


def _as_exact(x: float) -> Exact:
    return Fraction(x) if math.isfinite(x) else x


def _beside_non_finite(x: Exact) -> float:
    """An operand of an operation with a NaN or an infinity, as a float: IEEE arithmetic
    reads only its sign and whether it is zero there, so an exact value past the
    float64 range is the largest float of its sign, and one too small for it the
    smallest (not a zero: ``x * inf`` is an infinity for any ``x`` but 0)."""
    if isinstance(x, float):
        return x
    try:
        rounded = x.numerator / x.denominator
    except OverflowError:
        return sys.float_info.max if x > 0 else -sys.float_info.max
    return rounded if rounded or not x else (5e-324 if x > 0 else -5e-324)


def _binop(op: str, a: Exact, b: Exact, right_text: Callable[[], str]) -> Exact:
    if b == 0 and op == "/":
        raise Undefined(f"the denominator {right_text()} is zero")
    if isinstance(a, float) or isinstance(b, float):  # IEEE semantics for NaN and inf
        return _as_exact(_float_op(op, _beside_non_finite(a), _beside_non_finite(b)))
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return a / b


def _bits(x: Exact) -> int:
    if isinstance(x, float):
        return 64
    return x.numerator.bit_length() + x.denominator.bit_length()


class Budget:
    """The work one evaluation may do: an operation on exact values of ``b`` bits costs
    about ``1 + (b / 4096)²`` units (products and gcds are superlinear in ``b``)."""

    __slots__ = ("left", "max_bits")

    def __init__(self, units: int = WORK_BUDGET, max_bits: int = MAX_VALUE_BITS) -> None:
        self.left = units
        self.max_bits = max_bits

    def spend(self, a: Exact, b: Exact) -> None:
        bits = max(_bits(a), _bits(b))
        if bits > self.max_bits:
            raise Undefined(
                f"an exact intermediate value has more than {self.max_bits} bits; "
                "simplify the expression"
            )
        self.left -= 1 + (bits >> 12) ** 2
        if self.left < 0:
            raise Undefined("the step's derived expressions exceed the evaluation budget")


def evaluate(node: Node, lookup: Callable[[str], Exact], budget: Budget | None = None) -> Exact:
    """Evaluate exactly. ``lookup`` returns a metric's exact value or raises :class:`Undefined`;
    past ``budget`` (a fresh one when None) the value is :class:`Undefined`."""
    budget = Budget() if budget is None else budget
    if isinstance(node, Num):
        return node.value
    if isinstance(node, Name):
        return lookup(node.name)
    if isinstance(node, Neg):
        value = evaluate(node.operand, lookup, budget)
        return -value
    left = evaluate(node.left, lookup, budget)
    right = evaluate(node.right, lookup, budget)
    budget.spend(left, right)
    return _binop(node.op, left, right, lambda: f"`{node.right}`")


def to_float(value: Exact) -> float:
    """Round an exact value once to the nearest float64 (ties to even)."""
    if isinstance(value, float):
        return value
    try:
        return value.numerator / value.denominator  # correctly rounded
    except OverflowError:
        return math.inf if value > 0 else -math.inf


class _Evaluation:
    """One evaluation of a spec's derived expressions.

    It leaves no reference cycle behind, so that its values and undefined causes are
    freed as soon as it is dropped, never by the cyclic collector (whose full passes
    over a busy service's heap stop every thread): ``lookup`` is a method, not a closure
    naming itself, and an undefined value is kept without the traceback that holds the
    evaluation's frames.
    """

    __slots__ = ("base", "budget", "done", "exprs")

    def __init__(self, exprs: Mapping[str, Node], base: Callable[[str], Exact]) -> None:
        self.exprs = exprs
        self.base = base
        self.done: dict[str, Exact | Undefined] = {}
        self.budget = Budget()

    def lookup(self, name: str) -> Exact:
        node = self.exprs.get(name)
        if node is None:
            return self.base(name)
        done = self.done
        if name not in done:
            try:
                done[name] = evaluate(node, self.lookup, self.budget)
            except Undefined as exc:
                done[name] = exc.with_traceback(None)
            except RecursionError:
                done[name] = Undefined("the expression nests too deeply to evaluate")
        result = done[name]
        if isinstance(result, Undefined):  # named once, with the first cause
            raise _named(name, result)
        return result


def _named(name: str, result: Undefined) -> Undefined:
    cause = getattr(result, "cause", result.args[0])
    undefined = Undefined(f"`{name}` is undefined: {cause}")
    undefined.cause = cause  # type: ignore[attr-defined]
    return undefined


def evaluate_all(
    exprs: Mapping[str, Node], base: Callable[[str], Exact]
) -> dict[str, Exact | Undefined]:
    """Evaluate every derived expression; derived names may refer to one another.
    All of them share one :class:`Budget`; a spec too deep to evaluate is undefined."""
    evaluation = _Evaluation(exprs, base)
    for name in exprs:
        with contextlib.suppress(Undefined):
            evaluation.lookup(name)
    return evaluation.done


@dataclass(frozen=True, slots=True)
class Cost:
    """What evaluating a spec's derived values costs, with every derived name inlined:
    ``size`` sums the operands (numbers and metric names) over every expression,
    ``depth`` is the deepest tree and ``chain`` the longest chain of derived names
    referring to one another (1: none)."""

    size: int
    depth: int
    chain: int


def cost(exprs: Mapping[str, Node], cap: int = 1 << 62) -> Cost:
    """The :class:`Cost` of an acyclic set of expressions (sizes saturate at ``cap``)."""
    memo: dict[str, tuple[int, int, int]] = {}
    for name in _dependency_order(exprs):
        memo[name] = _measure(exprs[name], memo, cap)
    size = min(cap, sum(m[0] for m in memo.values()))
    return Cost(
        size,
        max((m[1] for m in memo.values()), default=0),
        max((m[2] for m in memo.values()), default=0),
    )


def _measure(
    root: Node, memo: Mapping[str, tuple[int, int, int]], cap: int
) -> tuple[int, int, int]:
    """(size, depth, chain) of one tree, derived names taken from ``memo``; iterative."""
    out: dict[int, tuple[int, int, int]] = {}
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, seen = stack.pop()
        if isinstance(node, Num):
            out[id(node)] = (1, 1, 1)
        elif isinstance(node, Name):
            size, depth, chain = memo.get(node.name, (0, 0, 0))
            out[id(node)] = (max(size, 1), depth + 1, chain + 1) if size else (1, 1, 1)
        elif not seen:
            stack.append((node, True))
            stack.extend((c, False) for c in _children(node))
        else:
            parts = [out[id(c)] for c in _children(node)]
            out[id(node)] = (
                min(cap, sum(p[0] for p in parts)),
                1 + max(p[1] for p in parts),
                max(p[2] for p in parts),
            )
    size, depth, chain = out[id(root)]
    return size, depth, chain


def _children(node: Node) -> tuple[Node, ...]:
    if isinstance(node, Neg):
        return (node.operand,)
    if isinstance(node, BinOp):
        return (node.left, node.right)
    return ()


def _dependency_order(exprs: Mapping[str, Node]) -> list[str]:
    """Names such that each comes after the derived names it refers to (iterative)."""
    order: list[str] = []
    placed: set[str] = set()
    for start in exprs:
        stack = [(start, iter(sorted(names(exprs[start]) & exprs.keys())))]
        while stack:
            name, refs = stack[-1]
            ref = next((r for r in refs if r not in placed), None)
            if ref is None:
                stack.pop()
                if name not in placed:
                    placed.add(name)
                    order.append(name)
            elif all(ref != n for n, _ in stack):
                stack.append((ref, iter(sorted(names(exprs[ref]) & exprs.keys()))))
    return order
