"""Math text for the embedded default corpus, from our own Philox-seeded generator (DESIGN §6).

Document i is a pure function of (seed, i): every random choice it makes is a 32-bit word of the
Philox4x32-10 blocks at (seed, STREAM_MATH_TEXT, index=i, sub=0, 1, 2, ...), consumed in order
(four words per block; the `sub` counter word numbers the blocks of one document). Bounded
choices are unbiased (rejection sampling). The text is made with Python ints and str formatting
only: no floating point, no true division (`/` appears only inside string literals; exact
quotients are checked and taken with divmod/`//`), no `random` module, no hash() or set order,
so the bytes are identical on every platform and Python version. tests/data/test_mathgen.py checks
this module's syntax tree for float literals, true division and float() calls.

Kinds of documents: long multiplication, long division with remainder, order of operations,
linear equations, simplifying/expanding expressions, systems of two linear equations, exact
fraction arithmetic, and word problems; each with a worked solution ending in an "Answer:" line.
A document holds one to three problems of one kind.
"""
from __future__ import annotations

from math import gcd
from typing import Iterator

from ..contract import STREAM_MATH_TEXT
from ..cpu_ref.random import philox_blocks

DEFAULT_SEED = 0x6D617468   # "math"
_TWO32 = 1 << 32


class Draws:
    """The random choices of one document: 32-bit words from Philox blocks (seed, stream, i, sub)."""

    def __init__(self, seed: int, index: int):
        self.seed, self.index = seed, index
        self.sub = 0            # next block's sub counter
        self._buf: list[int] = []

    def word(self) -> int:
        if not self._buf:
            block = philox_blocks(self.seed, STREAM_MATH_TEXT, self.index, 1, self.sub)[0]
            self.sub += 1
            self._buf = [int(block[3]), int(block[2]), int(block[1]), int(block[0])]   # pop() -> word 0 first
        return self._buf.pop()

    def below(self, n: int) -> int:
        """Uniform integer in [0, n), n <= 2^32, unbiased (words >= the largest multiple of n are redrawn)."""
        if not 0 < n <= _TWO32:
            raise ValueError(f"bound {n} out of range")
        limit = _TWO32 - _TWO32 % n
        while True:
            w = self.word()
            if w < limit:
                return w % n

    def int(self, lo: int, hi: int) -> int:
        """Uniform integer in [lo, hi]."""
        return lo + self.below(hi - lo + 1)

    def nonzero(self, lo: int, hi: int) -> int:
        """Uniform in [-hi, -lo] U [lo, hi] (lo >= 1)."""
        v = self.int(lo, hi)
        return -v if self.below(2) else v

    def pick(self, seq):
        return seq[self.below(len(seq))]

    def chance(self, num: int, den: int) -> bool:
        return self.below(den) < num


# ---------------------------------------------------------------------------------------------
# formatting helpers


def _p(v: int) -> str:
    """An integer as an operand after an operator: negatives in parentheses."""
    return f"({v})" if v < 0 else str(v)


def _times(n: int, word: str = "time") -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _lin(terms) -> str:
    """A sum of terms (coef, name), name "" for the constant: '3x - y + 5'; zero terms dropped."""
    out = ""
    for coef, name in terms:
        if coef == 0:
            continue
        mag = abs(coef)
        body = (name if mag == 1 else f"{mag}{name}") if name else str(mag)
        if not out:
            out = ("-" if coef < 0 else "") + body
        else:
            out += (" - " if coef < 0 else " + ") + body
    return out or "0"


def _signed(v: int) -> str:
    """' + 5' or ' - 5' (to append a constant to an expression)."""
    return f" - {-v}" if v < 0 else f" + {v}"


def _frac(n: int, d: int) -> str:
    """n/d as written (no reduction); d > 0."""
    return str(n) if d == 1 else f"{n}/{d}"


def _exact_div(a: int, b: int) -> int:
    q, r = divmod(a, b)
    if r:
        raise AssertionError(f"{a} is not divisible by {b}")
    return q


# ---------------------------------------------------------------------------------------------
# arithmetic


def long_multiplication(r: Draws) -> str:
    a = r.int(12, 99999) if r.chance(1, 2) else r.int(12, 999)
    b = r.int(12, 999)
    lines = [f"Compute {a} × {b}.", "",
             f"Multiply {a} by each digit of {b}, starting from the ones digit:"]
    partials = []
    place_names = ["ones", "tens", "hundreds"]
    digits = str(b)[::-1]
    for p, ch in enumerate(digits):
        d = int(ch)
        if d == 0:
            lines.append(f"  the {place_names[p]} digit is 0, so it adds nothing")
            continue
        factor = d * 10 ** p
        partials.append(a * factor)
        lines.append(f"  {a} × {factor} = {a * factor}")
    total = sum(partials)
    if len(partials) > 1:
        lines.append("Add the partial products:")
        lines.append("  " + " + ".join(str(x) for x in partials) + f" = {total}")
    assert total == a * b
    lines += ["", f"Answer: {a} × {b} = {total}"]
    return "\n".join(lines)


def long_division(r: Draws) -> str:
    d = r.int(2, 12) if r.chance(1, 2) else r.int(13, 99)
    q = r.int(10, 99999)
    rem = r.int(0, d - 1) if r.chance(3, 4) else 0
    n = d * q + rem
    lines = [f"Divide {n} by {d} using long division.", ""]
    s = str(n)
    k, cur = 0, 0
    while k < len(s) and (cur < d or k == 0):
        cur = cur * 10 + int(s[k])
        k += 1
    qdigits = []
    first = True
    while True:
        qd, left = divmod(cur, d)
        qdigits.append(str(qd))
        head = f"Start with {cur}: " if first else ""
        first = False
        if qd == 0:
            lines.append(f"{head}{d} goes into {cur} 0 times, so write 0 and keep {cur}.")
        else:
            lines.append(f"{head}{d} goes into {cur} {_times(qd)} ({qd} × {d} = {qd * d}); "
                         f"{cur} - {qd * d} = {left}.")
        if k == len(s):
            break
        cur = left * 10 + int(s[k])
        lines.append(f"Bring down the {s[k]}: {cur}.")
        k += 1
    quotient = int("".join(qdigits))
    assert quotient == q and left == rem
    lines.append(f"The quotient is {q} and the remainder is {rem}.")
    lines.append(f"Check: {d} × {q} + {rem} = {d * q} + {rem} = {n}.")
    lines += ["", f"Answer: {n} ÷ {d} = {q} remainder {rem}"]
    return "\n".join(lines)


# An expression for order of operations: a list [operand, op, operand, op, ...], where an operand
# is an int or a group (a flat list of the same shape, shown in parentheses).

def _fmt_expr(seq) -> str:
    parts = []
    for k, item in enumerate(seq):
        if k % 2:
            parts.append(item)
        elif isinstance(item, list):
            parts.append("(" + _fmt_expr(item) + ")")
        else:
            parts.append(str(item) if k == 0 or item >= 0 else f"({item})")
    return " ".join(parts)


def _apply(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "×":
        return a * b
    return _exact_div(a, b)


def _reduce_flat(seq) -> tuple[str, str]:
    """Apply the next operation of a flat sequence in place; returns (phase, 'a op b = c')."""
    j = next((j for j in range(1, len(seq), 2) if seq[j] in "×÷"), None)
    phase = "muldiv"
    if j is None:
        j, phase = 1, "addsub"
    a, op, b = seq[j - 1], seq[j], seq[j + 1]
    c = _apply(a, op, b)
    seq[j - 1:j + 2] = [c]
    return phase, f"{a} {op} {_p(b)} = {c}"


def _expr_group(r: Draws) -> list:
    g = [r.int(1, 30)]
    for _ in range(r.int(1, 2)):
        g += [r.pick("+-"), r.int(1, 30)]
    return g


def _expr_term(r: Draws) -> list:
    kind = r.below(5)
    if kind == 0:
        return [r.int(1, 99)]
    if kind == 1:
        t = [r.int(2, 20), "×", r.int(2, 20)]
        if r.chance(1, 4):
            t += ["×", r.int(2, 9)]
        return t
    if kind == 2:
        b = r.int(2, 12)
        return [b * r.int(2, 15), "÷", b]
    if kind == 3:
        return [r.int(2, 12), "×", _expr_group(r)]
    return [_expr_group(r), "×", r.int(2, 9)]


def order_of_operations(r: Draws) -> str:
    seq = _expr_term(r)
    for _ in range(r.int(1, 3)):
        seq += [r.pick("+-")] + _expr_term(r)
    if len(seq) == 1:
        seq += ["+", r.int(1, 99)]
    lines = [f"Evaluate {_fmt_expr(seq)}.", ""]
    headers = {"paren": "parentheses first:",
               "muldiv": "multiplication and division, from left to right:",
               "addsub": "addition and subtraction, from left to right:"}
    seen: list = []
    while len(seq) > 1:
        g = next((k for k in range(0, len(seq), 2) if isinstance(seq[k], list)), None)
        if g is not None:
            phase_name, step = _reduce_flat(seq[g])
            phase = "paren"
            if len(seq[g]) == 1:
                seq[g] = seq[g][0]
        else:
            phase, step = _reduce_flat(seq)
        if phase not in seen:
            text = headers[phase]
            lines.append(("Then " if seen else "First, ") + text if phase != "paren" else "Parentheses first:")
            seen.append(phase)
        lines.append(f"  {step}, giving {_fmt_expr(seq)}" if len(seq) > 1 else f"  {step}")
    lines += ["", f"Answer: {seq[0]}"]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# algebra

_VARS = ["x", "x", "x", "y", "n", "t", "k", "m", "z"]


def _solve_coef(lines: list, coef: int, rhs: int, v: str) -> int:
    """From `coef*v = rhs` to v; appends the step; returns v."""
    if coef == 1:
        return rhs
    if coef == -1:
        lines.append(f"Multiply both sides by -1: {v} = {-rhs}.")
        return -rhs
    val = _exact_div(rhs, coef)
    lines.append(f"Divide both sides by {coef}: {v} = {rhs} ÷ {_p(coef)} = {val}.")
    return val


def _move_const(lines: list, lhs: str, b: int, c: int) -> int:
    """From `lhs + b = c` to `lhs = c - b`; appends the step; returns c - b."""
    if b > 0:
        lines.append(f"Subtract {b} from both sides: {lhs} = {c} - {b} = {c - b}.")
    elif b < 0:
        lines.append(f"Add {-b} to both sides: {lhs} = {c} + {-b} = {c - b}.")
    return c - b


def linear_equation(r: Draws) -> str:
    v = r.pick(_VARS)
    x = r.int(-20, 20)
    form = r.below(3)
    lines = []
    if form == 0:                       # a v + b = c
        a, b = r.nonzero(2, 15), r.nonzero(1, 60)
        c = a * x + b
        lines += [f"Solve for {v}: {_lin([(a, v), (b, '')])} = {c}.", ""]
        rhs = _move_const(lines, _lin([(a, v)]), b, c)
        got = _solve_coef(lines, a, rhs, v)
        check = f"Check: {a} × {_p(x)}{_signed(b)} = {a * x}{_signed(b)} = {c}."
    elif form == 1:                     # a v + b = d v + e
        a, d = r.nonzero(1, 12), r.nonzero(1, 12)
        while d == a:
            d = r.nonzero(1, 12)
        b = r.nonzero(1, 40)
        e = a * x + b - d * x
        lines += [f"Solve for {v}: {_lin([(a, v), (b, '')])} = {_lin([(d, v), (e, '')])}.", ""]
        left = _lin([(a - d, v), (b, '')])
        if d > 0:
            lines.append(f"Subtract {_lin([(d, v)])} from both sides: {left} = {e}.")
        else:
            lines.append(f"Add {_lin([(-d, v)])} to both sides: {left} = {e}.")
        rhs = _move_const(lines, _lin([(a - d, v)]), b, e)
        got = _solve_coef(lines, a - d, rhs, v)
        check = (f"Check: the left side is {a} × {_p(x)}{_signed(b)} = {a * x + b} and the right side "
                 f"is {d} × {_p(x)}{_signed(e)} = {d * x + e}.")
    else:                               # a (v + b) = c
        a, b = r.nonzero(2, 12), r.nonzero(1, 20)
        c = a * (x + b)
        lines += [f"Solve for {v}: {a}({_lin([(1, v), (b, '')])}) = {c}.", ""]
        inner = _exact_div(c, a)
        lines.append(f"Divide both sides by {a}: {_lin([(1, v), (b, '')])} = {c} ÷ {_p(a)} = {inner}.")
        got = _move_const(lines, v, b, inner)
        check = f"Check: {a} × ({x}{_signed(b)}) = {a} × {_p(x + b)} = {c}."
    assert got == x
    lines += [check, "", f"Answer: {v} = {x}"]
    return "\n".join(lines)


def _poly(coefs: list[int], v: str) -> str:
    """coefs[k] is the coefficient of v^k, highest power first in the text."""
    terms = []
    for k in range(len(coefs) - 1, -1, -1):
        name = "" if k == 0 else (v if k == 1 else f"{v}^{k}")
        terms.append((coefs[k], name))
    return _lin(terms)


def simplify(r: Draws) -> str:
    v = r.pick(_VARS)
    form = r.below(3)
    lines = []
    if form == 0:                       # k1(p1 v + q1) +- k2(p2 v + q2)
        k1, k2 = r.int(2, 9), r.nonzero(2, 9)
        p1, q1, p2, q2 = r.int(1, 9), r.nonzero(1, 12), r.int(1, 9), r.nonzero(1, 12)
        sign = "-" if k2 < 0 else "+"
        expr = f"{k1}({_lin([(p1, v), (q1, '')])}) {sign} {abs(k2)}({_lin([(p2, v), (q2, '')])})"
        lines += [f"Simplify {expr}.", ""]
        lines.append(f"Distribute: {k1}({_lin([(p1, v), (q1, '')])}) = {_lin([(k1 * p1, v), (k1 * q1, '')])} "
                     f"and {k2}({_lin([(p2, v), (q2, '')])}) = {_lin([(k2 * p2, v), (k2 * q2, '')])}.")
        lines.append(f"So the expression is {_lin([(k1 * p1, v), (k1 * q1, ''), (k2 * p2, v), (k2 * q2, '')])}.")
        cv, cc = k1 * p1 + k2 * p2, k1 * q1 + k2 * q2
        lines.append(f"Collect like terms: the {v} terms give {k1 * p1}{_signed(k2 * p2)} = {cv}, "
                     f"the constants give {k1 * q1}{_signed(k2 * q2)} = {cc}.")
        answer = _lin([(cv, v), (cc, '')])
    elif form == 1:                     # (a v + b)(c v + d)
        a, b, c, d = r.int(1, 5), r.nonzero(1, 9), r.int(1, 5), r.nonzero(1, 9)
        f1, f2 = _lin([(a, v), (b, '')]), _lin([(c, v), (d, '')])
        lines += [f"Expand ({f1})({f2}).", ""]
        av, cv_ = _lin([(a, v)]), _lin([(c, v)])
        lines.append("Multiply each term of the first factor by each term of the second:")
        lines.append(f"  {av} · {cv_} = {_poly([0, 0, a * c], v)}")
        lines.append(f"  {av} · {_p(d)} = {_poly([0, a * d], v)}")
        lines.append(f"  {b} · {cv_} = {_poly([0, b * c], v)}")
        lines.append(f"  {b} · {_p(d)} = {b * d}")
        lines.append(f"Combine the middle terms: {a * d}{_signed(b * c)} = {a * d + b * c}.")
        answer = _poly([b * d, a * d + b * c, a * c], v)
    else:                               # collect like terms of a jumbled sum
        n = r.int(4, 6)
        terms = [(r.nonzero(1, 12), v if r.chance(1, 2) else "") for _ in range(n)]
        if all(t[1] for t in terms) or not any(t[1] for t in terms):
            terms[0] = (terms[0][0], "" if terms[0][1] else v)
        lines += [f"Simplify {_lin(terms)}.", ""]
        xs = [c for c, nm in terms if nm]
        cs = [c for c, nm in terms if not nm]
        if len(xs) == 1:
            lines.append(f"The only {v} term is {_lin([(xs[0], v)])}.")
        else:
            lines.append(f"The {v} terms: {_lin([(c, v) for c in xs])} = {_lin([(sum(xs), v)])}.")
        if len(cs) == 1:
            lines.append(f"The only constant is {cs[0]}.")
        else:
            lines.append(f"The constants: {_lin([(c, '') for c in cs])} = {sum(cs)}.")
        answer = _lin([(sum(xs), v), (sum(cs), '')])
    lines += ["", f"Answer: {answer}"]
    return "\n".join(lines)


_PAIRS = [("x", "y"), ("x", "y"), ("x", "y"), ("a", "b"), ("m", "n"), ("p", "q"), ("u", "v")]
_ORD = {1: "first", 2: "second"}


def linear_system(r: Draws) -> str:
    u, w = r.pick(_PAIRS)
    x, y = r.int(-12, 12), r.int(-12, 12)
    while True:
        a1, b1, a2, b2 = r.nonzero(1, 9), r.nonzero(1, 9), r.nonzero(1, 9), r.nonzero(1, 9)
        if a1 * b2 - a2 * b1 != 0:
            break
    c1, c2 = a1 * x + b1 * y, a2 * x + b2 * y
    e1, e2 = _lin([(a1, u), (b1, w)]), _lin([(a2, u), (b2, w)])
    lines = ["Solve the system of equations:", f"  {e1} = {c1}", f"  {e2} = {c2}", ""]
    L = abs(a1 * a2) // gcd(a1, a2)
    k1, k2 = _exact_div(L, a1), _exact_div(L, a2)
    if k1 == 1 and k2 == 1:
        lines.append(f"Both equations already have {_lin([(L, u)])}.")
    else:
        which = []
        if k1 != 1:
            which.append(f"the first equation by {k1}")
        if k2 != 1:
            which.append(f"the second by {k2}" if which else f"the second equation by {k2}")
        lines.append(f"Multiply {' and '.join(which)} so that both have {_lin([(L, u)])}:")
        lines.append(f"  {_lin([(L, u), (k1 * b1, w)])} = {k1 * c1}")
        lines.append(f"  {_lin([(L, u), (k2 * b2, w)])} = {k2 * c2}")
    cy, ry = k1 * b1 - k2 * b2, k1 * c1 - k2 * c2
    lines.append(f"Subtract the second from the first: {_lin([(cy, w)])} = {ry}.")
    gy = _solve_coef(lines, cy, ry, w)
    rest = c1 - b1 * gy
    lines.append(f"Substitute {w} = {gy} into the first equation: {_lin([(a1, u)])}{_signed(b1)} × {_p(gy)} = {c1}, "
                 f"so {_lin([(a1, u)])} = {c1} - {_p(b1 * gy)} = {rest}.")
    gx = _solve_coef(lines, a1, rest, u)
    assert (gx, gy) == (x, y)
    lines.append(f"Check with the second equation: {a2} × {_p(x)}{_signed(b2)} × {_p(y)} = "
                 f"{a2 * x}{_signed(b2 * y)} = {c2}.")
    lines += ["", f"Answer: {u} = {x}, {w} = {y}"]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# fractions


def _reduce(lines: list, n: int, d: int) -> tuple[int, int]:
    g = gcd(n, d)
    if g == 1:
        lines.append(f"{_frac(n, d)} is already in lowest terms (gcd({abs(n)}, {d}) = 1).")
        return n, d
    rn, rd = _exact_div(n, g), _exact_div(d, g)
    lines.append(f"Reduce: gcd({abs(n)}, {d}) = {g}, so {n}/{d} = {_frac(rn, rd)}.")
    return rn, rd


def fractions(r: Draws) -> str:
    def operand():
        d = r.int(2, 12)
        return r.int(1, 2 * d), d
    (n1, d1), (n2, d2) = operand(), operand()
    op = r.pick("+-×÷")
    lines = [f"Compute {n1}/{d1} {op} {n2}/{d2}.", ""]
    if op in "+-":
        L = d1 * d2 // gcd(d1, d2)
        m1, m2 = _exact_div(L, d1), _exact_div(L, d2)
        if d1 == d2:
            lines.append(f"The denominators are both {d1}.")
        else:
            lines.append(f"The denominators are {d1} and {d2}; their least common denominator is {L}.")
            conv = [f"{a}/{b} = {a * m}/{L}" for a, b, m in ((n1, d1, m1), (n2, d2, m2)) if m != 1]
            lines.append(" and ".join(conv) + ".")
        n = n1 * m1 + n2 * m2 if op == "+" else n1 * m1 - n2 * m2
        lines.append(f"{n1 * m1}/{L} {op} {n2 * m2}/{L} = {n}/{L}.")
        d = L
    else:
        if op == "÷":
            lines.append(f"Dividing by {n2}/{d2} is multiplying by its reciprocal {d2}/{n2}.")
            n2, d2 = d2, n2
            lines.append(f"{n1}/{d1} × {n2}/{d2}:")
        n, d = n1 * n2, d1 * d2
        lines.append(f"Multiply the numerators and the denominators: ({n1} × {n2})/({d1} × {d2}) = {n}/{d}.")
    if n == 0:
        lines.append("The result is 0.")
        rn, rd = 0, 1
    else:
        rn, rd = _reduce(lines, n, d)
    if rd > 1 and abs(rn) > rd:
        whole, part = divmod(abs(rn), rd)
        lines.append(f"As a mixed number: {'-' if rn < 0 else ''}{whole} {part}/{rd}.")
    lines += ["", f"Answer: {_frac(rn, rd)}"]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# word problems

_NAMES = ["Amara", "Ben", "Chen", "Dalia", "Emil", "Fatima", "Gustavo", "Hana", "Ivan", "Jun",
          "Keisha", "Lars", "Mei", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tomas",
          "Uma", "Viktor", "Wen", "Ximena", "Yusuf", "Zoe"]
_ITEMS = [("notebook", "notebooks"), ("pen", "pens"), ("apple", "apples"), ("ticket", "tickets"),
          ("book", "books"), ("sandwich", "sandwiches"), ("plant", "plants"), ("mug", "mugs"),
          ("battery", "batteries"), ("ball", "balls")]
_THINGS = ["marbles", "stickers", "cookies", "stamps", "pencils", "cards", "beads", "shells"]
_VEHICLES = ["train", "bus", "cyclist", "truck", "boat"]


def _word_shopping(r: Draws) -> tuple[str, list, str]:
    name = r.pick(_NAMES)
    i1 = r.below(len(_ITEMS))
    i2 = (i1 + 1 + r.below(len(_ITEMS) - 1)) % len(_ITEMS)
    (s1, pl1), (s2, pl2) = _ITEMS[i1], _ITEMS[i2]
    n1, p1, n2, p2 = r.int(2, 12), r.int(1, 25), r.int(2, 12), r.int(1, 25)
    t1, t2 = n1 * p1, n2 * p2
    total = t1 + t2
    bill = next((b for b in (20, 50, 100, 200, 500) if b >= total), None)
    if bill is None:
        bill = (total // 100 + 1) * 100
    q = (f"{name} buys {n1} {pl1} at {p1} dollars each and {n2} {pl2} at {p2} dollars each, "
         f"and pays with a {bill}-dollar bill. How much change does {name} get?")
    steps = [f"The {pl1} cost {n1} × {p1} = {t1} dollars.",
             f"The {pl2} cost {n2} × {p2} = {t2} dollars.",
             f"Together: {t1} + {t2} = {total} dollars.",
             f"Change: {bill} - {total} = {bill - total} dollars."]
    return q, steps, f"{bill - total} dollars"


def _word_sharing(r: Draws) -> tuple[str, list, str]:
    name, things = r.pick(_NAMES), r.pick(_THINGS)
    k = r.int(3, 12)
    each, left = r.int(2, 40), r.int(0, k - 1)
    total = k * each + left
    q = (f"{name} has {total} {things} and shares them equally among {k} friends, giving each "
         f"friend as many as possible. How many does each friend get, and how many are left over?")
    steps = [f"Divide {total} by {k}: {k} × {each} = {k * each}, and {total} - {k * each} = {left}.",
             f"Since {left} is less than {k}, no friend can get another one."]
    return q, steps, f"each friend gets {each}, and {left} {'is' if left == 1 else 'are'} left over"


def _word_distance(r: Draws) -> tuple[str, list, str]:
    veh = r.pick(_VEHICLES)
    v1, t1, v2, t2 = r.int(10, 120), r.int(1, 6), r.int(10, 120), r.int(1, 6)
    d1, d2 = v1 * t1, v2 * t2
    q = (f"A {veh} travels at {v1} kilometres per hour for {_times(t1, 'hour')}, then at {v2} "
         f"kilometres per hour for {_times(t2, 'hour')}. How far does it travel in total?")
    steps = [f"Distance is speed times time.",
             f"First part: {v1} × {t1} = {d1} kilometres.",
             f"Second part: {v2} × {t2} = {d2} kilometres.",
             f"Total: {d1} + {d2} = {d1 + d2} kilometres."]
    return q, steps, f"{d1 + d2} kilometres"


def _word_rectangle(r: Draws) -> tuple[str, list, str]:
    what = r.pick(["garden", "room", "field", "playground", "table top"])
    length, width = r.int(3, 60), r.int(2, 40)
    if width > length:
        length, width = width, length
    q = (f"A rectangular {what} is {length} metres long and {width} metres wide. "
         f"What are its area and its perimeter?")
    steps = [f"Area = length × width = {length} × {width} = {length * width} square metres.",
             f"Perimeter = 2 × (length + width) = 2 × ({length} + {width}) = 2 × {length + width} "
             f"= {2 * (length + width)} metres."]
    return q, steps, f"area {length * width} square metres, perimeter {2 * (length + width)} metres"


def _word_savings(r: Draws) -> tuple[str, list, str]:
    name = r.pick(_NAMES)
    have, weekly = r.int(0, 80), r.int(3, 30)
    goal = have + r.int(20, 400)
    need = goal - have
    weeks = (need + weekly - 1) // weekly
    q = (f"{name} has saved {have} dollars and saves {weekly} dollars every week. After how many "
         f"weeks will {name} have at least {goal} dollars?")
    steps = [f"{name} still needs {goal} - {have} = {need} dollars."]
    qq, rr = divmod(need, weekly)
    if rr == 0:
        steps.append(f"{need} ÷ {weekly} = {qq}, exactly.")
    else:
        steps.append(f"{need} ÷ {weekly} = {qq} remainder {rr}, so {qq} weeks are not quite enough "
                     f"({qq} × {weekly} = {qq * weekly}) and one more week is needed.")
    steps.append(f"After {weeks} weeks {name} has {have} + {weeks} × {weekly} = {have + weeks * weekly} dollars.")
    return q, steps, _times(weeks, "week")


def _word_ages(r: Draws) -> tuple[str, list, str]:
    i = r.below(len(_NAMES))
    j = (i + 1 + r.below(len(_NAMES) - 1)) % len(_NAMES)
    a, b = _NAMES[i], _NAMES[j]
    k, young, n = r.int(2, 5), r.int(2, 15), r.int(1, 10)
    old = k * young
    s = old + young + 2 * n
    q = (f"{a} is {k} times as old as {b}. In {_times(n, 'year')}, the sum of their ages will be {s}. "
         f"How old are they now?")
    steps = [f"Let {b}'s age be b; then {a}'s age is {k}b.",
             f"In {_times(n, 'year')} the ages are b + {n} and {k}b + {n}, so {k + 1}b + {2 * n} = {s}.",
             f"{k + 1}b = {s} - {2 * n} = {s - 2 * n}, so b = {s - 2 * n} ÷ {k + 1} = {young}.",
             f"{a} is {k} × {young} = {old}."]
    return q, steps, f"{a} is {old} years old and {b} is {young}"


def _word_discount(r: Draws) -> tuple[str, list, str]:
    item = r.pick(["jacket", "bicycle", "lamp", "chair", "pair of shoes", "backpack", "guitar"])
    price, pct = 20 * r.int(1, 25), 5 * r.int(1, 15)
    off = _exact_div(price * pct, 100)
    q = f"A {item} costs {price} dollars and is on sale for {pct}% off. What is the sale price?"
    steps = [f"{pct}% of {price} is {price} × {pct} ÷ 100 = {price * pct} ÷ 100 = {off} dollars.",
             f"Sale price: {price} - {off} = {price - off} dollars."]
    return q, steps, f"{price - off} dollars"


_WORD = [_word_shopping, _word_sharing, _word_distance, _word_rectangle, _word_savings,
         _word_ages, _word_discount]


def word_problem(r: Draws) -> str:
    q, steps, answer = r.pick(_WORD)(r)
    return "\n".join([q, ""] + steps + ["", f"Answer: {answer}"])


# ---------------------------------------------------------------------------------------------
# documents

KINDS = [  # (generator, title of a worksheet, weight)
    (long_multiplication, "long multiplication", 2),
    (long_division, "long division with remainder", 2),
    (order_of_operations, "order of operations", 2),
    (linear_equation, "linear equations", 3),
    (simplify, "simplifying expressions", 2),
    (linear_system, "systems of two linear equations", 2),
    (fractions, "fractions", 3),
    (word_problem, "word problems", 4),
]
_WEIGHTS = sum(k[2] for k in KINDS)


def document(i: int, seed: int = DEFAULT_SEED) -> str:
    """Document i: a pure function of (seed, i)."""
    r = Draws(seed, i)
    pick = r.below(_WEIGHTS)
    for gen, title, weight in KINDS:
        if pick < weight:
            break
        pick -= weight
    n = r.int(1, 3)
    if n == 1:
        return gen(r)
    parts = [f"Worked examples: {title}."]
    for k in range(n):
        parts.append(f"Problem {k + 1}. {gen(r)}")
    return "\n\n".join(parts)


def generate(n_docs: int, seed: int = DEFAULT_SEED) -> Iterator[str]:
    """Documents 0 .. n_docs-1 of the math source for `seed`."""
    for i in range(n_docs):
        yield document(i, seed)
