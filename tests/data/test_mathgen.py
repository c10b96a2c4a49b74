"""The math text generator: a pure function of (seed, index), integer-only, correct answers."""
import ast
import collections
import inspect
import re
from fractions import Fraction

import pytest

import mlx_open1b.cpu_ref as C
from mlx_open1b.contract import STREAM_MATH_TEXT
from mlx_open1b.data import mathgen

N_CHECK = 1500


@pytest.fixture(scope="module")
def docs():
    return list(mathgen.generate(N_CHECK))


def test_deterministic(docs):
    again = list(mathgen.generate(N_CHECK))
    assert again == docs
    for i in (0, 1, 17, 999, N_CHECK - 1):
        assert mathgen.document(i) == docs[i]            # document i alone equals document i of a run
    assert list(mathgen.generate(5, seed=mathgen.DEFAULT_SEED)) == docs[:5]


def test_seeds_differ(docs):
    other = list(mathgen.generate(200, seed=mathgen.DEFAULT_SEED + 1))
    assert sum(a != b for a, b in zip(docs, other)) >= 195
    assert list(mathgen.generate(3, seed=0)) != list(mathgen.generate(3, seed=2 ** 64 - 1))


def test_draws_are_philox_words():
    r = mathgen.Draws(77, 5)
    words = [r.word() for _ in range(12)]
    want = [int(w) for sub in range(3) for w in C.philox_blocks(77, STREAM_MATH_TEXT, 5, 1, sub)[0]]
    assert words == want


def test_bounded_draws_unbiased_by_rejection():
    class Scripted(mathgen.Draws):
        def __init__(self, words):
            self.words = list(words)

        def word(self):
            return self.words.pop(0)
    # 2^32 mod 3 == 1: the top word 2^32 - 1 is rejected, the next one used
    assert Scripted([2 ** 32 - 1, 5]).below(3) == 2
    assert Scripted([2 ** 32 - 2]).below(3) == (2 ** 32 - 2) % 3
    assert Scripted([2 ** 32 - 1]).below(2 ** 32) == 2 ** 32 - 1
    r = mathgen.Draws(1, 2)
    counts = collections.Counter(r.below(6) for _ in range(6000))
    assert set(counts) == set(range(6)) and all(850 < c < 1150 for c in counts.values())
    with pytest.raises(ValueError):
        r.below(0)


def test_document_sizes(docs):
    lens = [len(d) for d in docs]
    assert min(lens) >= 80 and max(lens) <= 4000
    assert 300 <= sum(lens) // len(lens) <= 1500
    assert set("".join(docs)) <= {chr(c) for c in range(32, 127)} | set("\n×÷·")     # English, integers
    assert all(not d.startswith(("\n", " ")) and not d.endswith(("\n", " ")) for d in docs)


def test_no_floating_point_in_the_generator():
    """The generator's source uses no float literal, no true division, no float(), no random
    module and no hash(): its text cannot depend on the platform's floating point."""
    tree = ast.parse(inspect.getsource(mathgen))
    for node in ast.walk(tree):
        assert not (isinstance(node, ast.Constant) and isinstance(node.value, (float, complex))), ast.dump(node)
        assert not (isinstance(node, (ast.BinOp, ast.AugAssign)) and isinstance(node.op, ast.Div)), \
            f"true division at line {node.lineno}"
        if isinstance(node, ast.Name):
            assert node.id not in ("float", "hash", "round", "set", "frozenset", "random", "time"), node.id
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            assert not any(n.split(".")[0] in ("random", "numpy", "time", "os", "fractions", "decimal")
                           for n in names), names
        if isinstance(node, ast.Attribute):
            assert node.attr not in ("sqrt", "log", "exp", "pow"), node.attr


# --- checking the answers with Python ints and Fractions ------------------------------------------

def ev(expr: str, env: dict) -> Fraction:
    """Value of an expression as the generator writes it (×, ÷, ·, ^, implicit multiplication)."""
    s = expr.replace("×", "*").replace("÷", "/").replace("·", "*").replace("^", "**")
    s = re.sub(r"(?<=[\d)a-z])(?=[a-z(])", "*", s)
    s = re.sub(r"\d+", lambda m: f"F({m.group()})", s)
    return eval(s, {"F": Fraction, "__builtins__": {}}, {k: Fraction(v) for k, v in env.items()})


def problems(doc: str):
    if doc.startswith("Worked examples:"):
        parts = re.split(r"\n\nProblem \d+\. ", doc)
        assert len(parts) >= 3
        return parts[1:]
    return [doc]


def answer(p: str) -> str:
    lines = [ln for ln in p.split("\n") if ln.startswith("Answer: ")]
    assert len(lines) == 1 and p.endswith(lines[0]), p
    return lines[0][len("Answer: "):]


def check(p: str) -> str:
    """Check one problem's answer; returns its kind."""
    a = answer(p)
    first = p.split("\n", 1)[0]
    if m := re.fullmatch(r"Compute (\d+) × (\d+)\.", first):
        x, y = int(m[1]), int(m[2])
        assert a == f"{x} × {y} = {x * y}"
        return "multiplication"
    if m := re.fullmatch(r"Divide (\d+) by (\d+) using long division\.", first):
        n, d = int(m[1]), int(m[2])
        assert a == f"{n} ÷ {d} = {n // d} remainder {n % d}"
        return "division"
    if m := re.fullmatch(r"Evaluate (.+)\.", first):
        v = ev(m[1], {})
        assert v.denominator == 1 and a == str(v.numerator), (p, v)
        return "order of operations"
    if m := re.fullmatch(r"Solve for ([a-z]): (.+) = (.+)\.", first):
        am = re.fullmatch(rf"{m[1]} = (-?\d+)", a)
        assert am, a
        env = {m[1]: int(am[1])}
        assert ev(m[2], env) == ev(m[3], env), p
        return "linear equation"
    if m := re.fullmatch(r"(?:Simplify|Expand) (.+)\.", first):
        names = set(re.findall(r"[a-z]", m[1]))
        assert len(names) == 1, names
        (v,) = names
        for val in (-3, 0, 1, 2, 7):
            assert ev(m[1], {v: val}) == ev(a, {v: val}), p
        return "simplify"
    if first == "Solve the system of equations:":
        e1, e2 = p.split("\n")[1:3]
        am = re.fullmatch(r"([a-z]) = (-?\d+), ([a-z]) = (-?\d+)", a)
        env = {am[1]: int(am[2]), am[3]: int(am[4])}
        for e in (e1, e2):
            lhs, rhs = e.strip().split(" = ")
            assert ev(lhs, env) == int(rhs), p
        return "system"
    if m := re.fullmatch(r"Compute (\d+)/(\d+) ([-+×÷]) (\d+)/(\d+)\.", first):
        x, y = Fraction(int(m[1]), int(m[2])), Fraction(int(m[4]), int(m[5]))
        want = {"+": x + y, "-": x - y, "×": x * y, "÷": x / y}[m[3]]
        assert a == str(want), p                       # in lowest terms
        return "fractions"
    # word problems
    if m := re.search(r"buys (\d+) \w+ at (\d+) dollars each and (\d+) \w+ at (\d+) dollars each, "
                      r"and pays with a (\d+)-dollar bill", p):
        n1, p1, n2, p2, bill = map(int, m.groups())
        assert bill >= n1 * p1 + n2 * p2 and a == f"{bill - n1 * p1 - n2 * p2} dollars"
        return "word: shopping"
    if m := re.search(r"has (\d+) \w+ and shares them equally among (\d+) friends", p):
        q, r = divmod(int(m[1]), int(m[2]))
        assert a == f"each friend gets {q}, and {r} {'is' if r == 1 else 'are'} left over"
        return "word: sharing"
    if m := re.search(r"travels at (\d+) kilometres per hour for (\d+) hours?, then at (\d+) "
                      r"kilometres per hour for (\d+) hours?\.", p):
        v1, t1, v2, t2 = map(int, m.groups())
        assert a == f"{v1 * t1 + v2 * t2} kilometres"
        return "word: distance"
    if m := re.search(r"is (\d+) metres long and (\d+) metres wide", p):
        ln, w = int(m[1]), int(m[2])
        assert a == f"area {ln * w} square metres, perimeter {2 * ln + 2 * w} metres"
        return "word: rectangle"
    if m := re.search(r"has saved (\d+) dollars and saves (\d+) dollars every week\. After how many weeks "
                      r"will \w+ have at least (\d+) dollars\?", p):
        have, weekly, goal = map(int, m.groups())
        weeks = int(re.fullmatch(r"(\d+) weeks?", a)[1])
        assert have + weeks * weekly >= goal > have + (weeks - 1) * weekly
        return "word: savings"
    if m := re.search(r"(\w+) is (\d+) times as old as (\w+)\. In (\d+) years?, the sum of their ages "
                      r"will be (\d+)\.", p):
        k, n, s = int(m[2]), int(m[4]), int(m[5])
        am = re.fullmatch(rf"{m[1]} is (\d+) years old and {m[3]} is (\d+)", a)
        old, young = int(am[1]), int(am[2])
        assert old == k * young and old + young + 2 * n == s
        return "word: ages"
    if m := re.search(r"costs (\d+) dollars and is on sale for (\d+)% off", p):
        price, pct = Fraction(int(m[1])), Fraction(int(m[2]))
        assert Fraction(int(re.fullmatch(r"(\d+) dollars", a)[1])) == price * (1 - pct / 100)
        return "word: discount"
    raise AssertionError(f"unrecognized problem:\n{p}")


def test_answers_are_correct(docs):
    kinds = collections.Counter(check(p) for d in docs for p in problems(d))
    assert len(kinds) == 14, kinds   # 7 computation kinds and 7 word-problem templates
    assert min(kinds.values()) >= 20, kinds


def test_checker_catches_a_wrong_answer(docs):
    p = next(p for d in docs for p in problems(d) if p.startswith("Evaluate"))
    bad = re.sub(r"Answer: (-?\d+)$", lambda m: f"Answer: {int(m[1]) + 1}", p)
    with pytest.raises(AssertionError):
        check(bad)
    p = next(p for d in docs for p in problems(d) if p.startswith("Compute") and "/" in p.split("\n")[0])
    with pytest.raises(AssertionError):
        check(p.replace("Answer: ", "Answer: 1"))
