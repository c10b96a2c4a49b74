"""What only a Mac could break, checked on the source text (as the CUDA tests scan nvcc's PTX).

fp32 operators: every fp32 `+ - * /` of the Metal backend is one operator in one statement of the
header's primitives o1b_add and o1b_mul (or in the hardware-operator hook #defines they use), so
no result depends on `#pragma METAL fp contract(off)`, which Metal 3.1 (macOS 14) lacks, and MSL's
safe math still contracts `a*b + c` inside one expression (CONTRACT.md §3, "No contraction").
tests/msl_scan.py parses the sources with operand types; each rule is also checked to fail on a
planted violation.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

import msl_scan

METAL = pathlib.Path(__file__).resolve().parents[2] / "metal"
HEADER = "contract.metal"
PRIMITIVES = {"o1b_add", "o1b_mul"}      # the only functions that apply an fp32 operator


def sources() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(METAL.glob("*.metal"))}


def signatures() -> dict:
    """{kernel: (buffer names, template names)} as metal/ops.py launches each kernel."""
    return msl_scan.signatures((METAL / "ops.py").read_text())


def operator_violations(texts: dict[str, str], sigs: dict | None = None) -> list[str]:
    """Each statement that breaks the rules, as 'file:line: why: statement'. Each kernel is scanned
    with its signature (sigs, default: metal/ops.py's); a kernel file without one is a violation."""
    sigs = signatures() if sigs is None else sigs
    header = msl_scan.scan_header(texts[HEADER])
    out = []
    for st in header.statements:
        ops = [op for op, _ in st.float_ops]
        where = f"{HEADER}:{st.line}"
        if len(ops) > 1:
            out.append(f"{where}: {len(ops)} fp32 operators {ops} in one statement: {st.text}")
        if ops and not st.is_define and st.function not in PRIMITIVES:
            out.append(f"{where}: fp32 operator {ops} outside {sorted(PRIMITIVES)} (in {st.function}): {st.text}")
        if "/" in ops and not st.is_define:
            out.append(f"{where}: fp32 division (div is the integer definition): {st.text}")
    for name, text in texts.items():
        if name == HEADER:
            continue
        if name[:-len(".metal")] not in sigs:
            out.append(f"{name}: no kernel of metal/ops.py's KERNELS (its buffers and template names unknown)")
            continue
        buffers, templates = sigs[name[:-len(".metal")]]
        try:
            statements = msl_scan.scan_kernel(text, header, templates, buffers).statements
        except msl_scan.ParseError as e:
            out.append(f"{name}: {e}")
            continue
        for st in statements:
            if st.float_ops:
                out.append(f"{name}:{st.line}: fp32 operator(s) {[op for op, _ in st.float_ops]} in a kernel "
                           f"(use the header's helpers): {st.text}")
    return out


def test_fp32_operators_only_in_the_primitives():
    texts = sources()
    assert len(texts) > 30 and HEADER in texts
    assert operator_violations(texts) == []
    # the scan sees the primitives' own operators (so it is not blind)
    header = msl_scan.scan_header(texts[HEADER])
    seen = {st.function for st in header.statements if st.float_ops and not st.is_define}
    assert seen == PRIMITIVES


# (file, text found exactly once, its replacement, a phrase of the expected violation)
PLANTS = [
    ("gemm.metal", "acc[r][c] = o1b_add(acc[r][c], o1b_mul(a[r], b[c]));", "acc[r][c] = a[r] * b[c] + acc[r][c];",
     "in a kernel"),
    ("gemm.metal", "acc[r][c] = o1b_add(acc[r][c], o1b_mul(a[r], b[c]));", "acc[r][c] += o1b_mul(a[r], b[c]);",
     "in a kernel"),
    ("add.metal", "out[i] = o1b_store(o1b_add(o1b_load(a[i]), o1b_load(b[i])));",
     "out[i] = a[i] * b[i] + a[i];", "in a kernel"),                     # buffer elements, types unknown
    ("swiglu_forward.metal", "out[n * F + f] = o1b_store(o1b_mul(o1b_silu(gate), up));",
     "out[n * F + f] = o1b_store(gate * up);", "in a kernel"),
    ("swiglu_forward.metal", "long F = prm[0];", "long F = prm[0];\n#define SQ(x) ((x) * (x))", "in a kernel"),
    ("gemm.metal", "C[(i0 + ii) * J + j0 + jj] = o1b_store(acc[r][c]);", "C[(i0 + ii) * J + j0 + jj] = C0[0] * C0[0];",
     "in a kernel"),                                                     # ALL-CAPS buffers
    ("gemm.metal", "long ob = prm[6], sbp = prm[7], sbj = prm[8];", "long ob = prm[6] + OFFSET, sbp = prm[7], sbj = prm[8];",
     "is not declared"),                                                 # no such name
    (HEADER, "    p = o1b_add(o1b_mul(p, r), O1B_F(0x3AB60B61u));",
     "    p = p * r + O1B_F(0x3AB60B61u);", "outside"),                  # a * b + c in a helper
    (HEADER, "inline float o1b_sub(float a, float b) { return o1b_add(a, o1b_neg(b)); }",
     "inline float o1b_sub(float a, float b) { return a - b; }", "outside"),
    (HEADER, "inline float o1b_mul(float a, float b) {",
     "inline float o1b_mul(float a, float b) {\n    float t = a * b + a;", "2 fp32 operators"),
    (HEADER, "    float s = o1b_div(f, o1b_add(2.0f, f));",
     "    float s = f / o1b_add(2.0f, f);", "fp32 division"),
    (HEADER, "    if (x > O1B_F(0x42B17217u)) return o1b_inf();",
     "    if (x > O1B_F(0x42B17217u)) return o1b_inf() * 2.0f;", "outside"),
]


@pytest.mark.parametrize("file,find,replace,why", PLANTS)
def test_planted_fp32_operator_is_caught(file, find, replace, why):
    texts = sources()
    assert texts[file].count(find) == 1, f"{file}: the plant's anchor is gone: {find!r}"
    texts[file] = texts[file].replace(find, replace)
    v = operator_violations(texts)
    assert v and any(why in x and x.startswith(file) for x in v), v


def test_integer_arithmetic_is_not_flagged():
    header = msl_scan.scan_header(sources()[HEADER])
    kernel = """
    long j = (long)thread_position_in_grid.x, i = (long)thread_position_in_grid.y;
    long J = prm[0], P = prm[1], P2 = P / 2;
    int acc = 0;
    for (long p = 0; p < P2; p++) acc += (int)A[i * J + p] * (int)B[j * J + p];
    long t = (long)targets[i] - J;
    uint u = o1b_bits(o1b_load(x[pos[t] * J + j])) >> 1;
    C[i * J + j] = acc + (int)(u & 3u) - D * 2;
    y[(i * J + j) % 7] = o1b_store(o1b_i2f(acc));
    """
    sig = dict(templates={"D"}, buffers=["A", "B", "C", "prm", "targets", "x", "pos", "y"])
    assert [st for st in msl_scan.scan_kernel(kernel, header, **sig).statements if st.float_ops] == []
    # while float and unknown operands are
    for bad in ("float x = o1b_load(a[i]); y[i] = o1b_store(x * x);",
                "y[i] = o1b_store(o1b_load(a[i]) - 1.0f);",
                "float v[4]; v[0] = 0.0f; v[1] = v[0] + v[0];",
                "o1b_reduced q = o1b_sincos_reduce(1.0f); float r = q.r * 2;",
                "y[i] = x[i] / 3;", "long P = prm[1] / 2;"):   # unknown element: fp32 assumed
        assert [st for st in msl_scan.scan_kernel(bad, header).statements if st.float_ops], bad


def test_buffers_are_typed_by_the_kernel_table_not_by_case():
    """gemm's buffers A, B, C0, C are ALL-CAPS: their elements are still fp32 operands (unknown),
    with gemm's signature from metal/ops.py and without any; its template name ACC is an integer."""
    header = msl_scan.scan_header(sources()[HEADER])
    buffers, templates = signatures()["gemm"]
    assert {"A", "B", "C0", "C"} <= set(buffers) and templates == {"ACC"}
    bad = "long ci = 0;\nC[ci] = C0[ci] * C0[ci];"
    for sig in (dict(templates=templates, buffers=buffers), {}):
        ops = [op for st in msl_scan.scan_kernel(bad, header, **sig).statements for op, _ in st.float_ops]
        assert ops == ["*"], sig
    ok = "long ci = 0;\nC[ci] = o1b_store(ACC ? o1b_load(C0[ci + ACC * 2]) : 0.0f);"
    assert not [st for st in msl_scan.scan_kernel(ok, header, templates, buffers).statements if st.float_ops]


def test_signatures_cover_every_template_list():
    """Each kernel's template names are those of its template= lists in metal/ops.py; a list the
    scan cannot tie to a kernel is an error rather than a name typed by guess."""
    ops_text = (METAL / "ops.py").read_text()
    sigs = msl_scan.signatures(ops_text)
    assert sigs["quant_absmax"][1] == {"SCALE", "QMAX"} and sigs["attention_forward_i8"][1] == {"D"}
    assert sigs["gemm_i8"] == (["A", "B", "prm", "C"], set())
    untied = ops_text + '\n\ndef _odd(k):\n    return _run(k.name, [], [], (1, 1, 1), template=[("X", 1)])\n'
    with pytest.raises(ValueError, match="template list whose kernel"):
        msl_scan.signatures(untied)


# ---------------------------------------------------------------------------------------------
# the contract pragma, under the language-version guard
# ---------------------------------------------------------------------------------------------
PRAGMA = "#pragma METAL fp contract(off)"
GUARD = "defined(__METAL_VERSION__) && __METAL_VERSION__ >= 320"


def pragma_problems(header_text: str) -> list[str]:
    """Why the header's contract pragma is not as required (empty: it is): exactly once, directly
    inside `#if GUARD` (the pragma is Metal 3.2; older compilers never see it), before any code."""
    directives, code = msl_scan.split_preprocessor(msl_scan.strip_comments(header_text))
    norm = lambda s: "".join(s.split())
    first_code = next((i + 1 for i, line in enumerate(code.split("\n")) if line.strip()), 10 ** 9)
    stack, found = [], []
    for line, d in directives:
        word = d[1:].strip().split(None, 1)[0] if len(d) > 1 else ""
        rest = d[1:].strip()[len(word):].strip()
        if word in ("if", "ifdef", "ifndef"):
            stack.append((word, rest))
        elif word in ("else", "elif"):
            stack[-1] = (word, rest)
        elif word == "endif":
            stack.pop()
        elif norm(d) == norm(PRAGMA):
            found.append((line, list(stack)))
    if len(found) != 1:
        return [f"{PRAGMA!r} appears {len(found)} times (expected once)"]
    line, stack = found[0]
    out = []
    if not stack or stack[-1][0] != "if" or norm(stack[-1][1]) != norm(GUARD):
        out.append(f"line {line}: {PRAGMA!r} is not directly inside '#if {GUARD}' (inside {stack})")
    if line > first_code:
        out.append(f"line {line}: {PRAGMA!r} comes after code (line {first_code}); it must precede every helper")
    return out


def test_contract_pragma_under_the_version_guard():
    assert pragma_problems(sources()[HEADER]) == []


@pytest.mark.parametrize("find,replace", [
    (PRAGMA + "\n", ""),                                                    # deleted
    ("#if " + GUARD + "\n" + PRAGMA + "\n#endif\n", PRAGMA + "\n"),        # unguarded
    ("__METAL_VERSION__ >= 320", "__METAL_VERSION__ >= 310"),              # a version without it
    ("contract(off)", "contract(fast)"),
    ("#if " + GUARD + "\n" + PRAGMA + "\n#endif\n", ""),                   # moved below the helpers
])
def test_pragma_check_fails_when_the_pragma_is_not_as_required(find, replace):
    text = sources()[HEADER]
    assert text.count(find) == 1, find
    planted = text.replace(find, replace)
    if replace == "" and find.startswith("#if"):
        planted += "\n#if " + GUARD + "\n" + PRAGMA + "\n#endif\n"
    assert pragma_problems(planted)


# ---------------------------------------------------------------------------------------------
# the kernel construction: math_mode "safe" and row-contiguous inputs, in the one place kernels
# are built
# ---------------------------------------------------------------------------------------------
REPO = METAL.parent
RUNTIME = METAL / "runtime.py"


def _is_metal_kernel(call: ast.Call) -> bool:
    f = call.func
    return (isinstance(f, ast.Attribute) and f.attr == "metal_kernel") or (isinstance(f, ast.Name) and f.id == "metal_kernel")


def construction_problems(py_text: str, where: str = "metal/runtime.py") -> list[str]:
    """Each mx.fast.metal_kernel(...) call must pass ensure_row_contiguous=True (kernels index their
    inputs as dense row-major arrays) and compile_options={"math_mode": "safe", ...} (no fast math:
    CONTRACT.md §3) as literals; the problems found, or that there is no such call."""
    calls = [n for n in ast.walk(ast.parse(py_text)) if isinstance(n, ast.Call) and _is_metal_kernel(n)]
    if not calls:
        return [f"{where}: no mx.fast.metal_kernel construction"]
    out = []
    for c in calls:
        kw = {k.arg: k.value for k in c.keywords}
        if None in kw:
            out.append(f"{where}:{c.lineno}: **kwargs in metal_kernel(...) cannot be checked")
        erc = kw.get("ensure_row_contiguous")
        if not (isinstance(erc, ast.Constant) and erc.value is True):
            out.append(f"{where}:{c.lineno}: metal_kernel(...) without ensure_row_contiguous=True")
        opts = kw.get("compile_options")
        mode = None
        if isinstance(opts, ast.Dict):
            for k, v in zip(opts.keys, opts.values):
                if isinstance(k, ast.Constant) and k.value == "math_mode" and isinstance(v, ast.Constant):
                    mode = v.value
        if mode != "safe":
            out.append(f"{where}:{c.lineno}: metal_kernel(...) without compile_options={{'math_mode': 'safe'}}")
    return out


def test_kernels_are_built_safe_and_row_contiguous():
    assert construction_problems(RUNTIME.read_text()) == []


def test_no_other_module_builds_metal_kernels():
    """Every construction goes through metal/runtime.py, so the check above covers all of them."""
    others = []
    for p in sorted(REPO.rglob("*.py")):
        rel = p.relative_to(REPO).as_posix()
        if rel.startswith(("tests/", "build/", ".")) or p == RUNTIME or "egg-info" in rel:
            continue
        try:
            tree = ast.parse(p.read_text())
        except (SyntaxError, UnicodeDecodeError):
            continue
        if any(isinstance(n, ast.Call) and _is_metal_kernel(n) for n in ast.walk(tree)):
            others.append(rel)
    assert others == []


@pytest.mark.parametrize("find,replace", [
    ("header=header, ensure_row_contiguous=True,", "header=header,"),
    ("header=header, ensure_row_contiguous=True,", "header=header, ensure_row_contiguous=False,"),
    ('compile_options={"math_mode": "safe"})', 'compile_options={"math_mode": "fast"})'),
    ('compile_options={"math_mode": "safe"})', 'compile_options={})'),
    (', ensure_row_contiguous=True,\n                    compile_options={"math_mode": "safe"})', ")"),
])
def test_construction_check_fails_when_an_option_is_dropped(find, replace):
    text = RUNTIME.read_text()
    assert text.count(find) == 1, find
    assert construction_problems(text.replace(find, replace))
    # a second construction elsewhere in the file, without the options, is caught too
    assert construction_problems(text + "\n\ndef _k(mx):\n    return mx.fast.metal_kernel(name='x')\n")
