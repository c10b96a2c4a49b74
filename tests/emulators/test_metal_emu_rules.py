"""The Metal emulator rejects what Metal rejects: a small bad kernel per construct gets a clear
EmuCompileError naming the kernel and the line (metal/emu/msl_check.py before g++; C++14 with
-pedantic-errors and `double` poisoned in g++), and every shipped kernel passes."""
from __future__ import annotations

import pathlib
import shutil

import numpy as np
import pytest

from mlx_open1b.metal import emu, runtime
from mlx_open1b.metal.emu import msl_check

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the Metal emulator needs g++")
OK_BODY = "uint i = thread_position_in_grid.x;\ny[i] = x[i];\n"


def launch(source: str, header: str = "", name: str = "bad"):
    x = np.arange(4, dtype=np.float32)
    return emu.EmuKernel(name, ["x"], ["y"], source, header)(
        inputs=[x], output_shapes=[x.shape], output_dtypes=[np.float32], grid=(4, 1, 1), threadgroup=(4, 1, 1))


# (construct, header, source, the words the message must hold): each is rejected by the source check
BAD = [
    ("double", "", "uint i = thread_position_in_grid.x;\ndouble d = x[i];\ny[i] = d;", ["source line 2", "double"]),
    ("double in a header macro", "#define WIDE double\n", OK_BODY, ["header line 1", "double"]),
    ("pointer", "", "uint i = thread_position_in_grid.x;\nconst float *p = x;\ny[i] = p[i];",
     ["source line 2", "`const float * p`", "address space"]),
    ("reference", "inline float get(const float& v) { return v; }\n", OK_BODY,
     ["header line 1", "`const float & v`", "address space"]),
    ("pointer cast", "", "uint i = thread_position_in_grid.x;\ny[i] = ((float *)x)[i];",
     ["source line 2", "address space"]),
    ("struct pointer", "struct pair { float a, b; };\ninline float first(pair *p) { return p->a; }\n", OK_BODY,
     ["header line 2", "`pair * p`"]),
    ("recursion", "inline uint f(uint n) { return n == 0u ? 0u : f(n - 1u); }\n",
     "uint i = thread_position_in_grid.x;\ny[i] = x[f(i)];", ["header line 1", "recursion (f -> f)"]),
    ("mutual recursion", "inline uint g(uint n);\ninline uint f(uint n) { return n == 0u ? 0u : g(n - 1u); }\n"
     "inline uint g(uint n) { return f(n); }\n", OK_BODY, ["recursion (f -> g -> f)"]),
    ("recursion through a macro", "#define AGAIN(n) f(n)\ninline uint f(uint n) { return n ? AGAIN(n - 1u) : 0u; }\n",
     OK_BODY, ["recursion (AGAIN -> f -> AGAIN)"]),
    ("lambda", "", "uint i = thread_position_in_grid.x;\nauto sq = [](float v) { return v; };\ny[i] = sq(x[i]);",
     ["source line 2", "lambda"]),
    ("goto", "", "uint i = thread_position_in_grid.x;\ngoto end;\nend: y[i] = x[i];", ["source line 2", "goto"]),
    ("new", "", "uint i = thread_position_in_grid.x;\nfloat *p = new float[4];\ny[i] = x[i];", ["the new operator"]),
    ("virtual", "struct S { virtual float v() { return 1.0f; } };\n", OK_BODY, ["header line 1", "virtual"]),
    ("derived class", "struct A { float a; };\nstruct B : A { float b; };\n", OK_BODY, ["header line 2", "derived"]),
    ("exceptions", "", "uint i = thread_position_in_grid.x;\ntry { y[i] = x[i]; } catch (...) { }", ["exceptions"]),
    ("standard library", "", "uint i = thread_position_in_grid.x;\ny[i] = std::max(x[i], 0.0f);", ["std::"]),
    ("include", "#include <cmath>\n", OK_BODY, ["header line 1", "#include <cmath>"]),
]


@pytest.mark.parametrize("what, header, source, words", BAD, ids=[b[0] for b in BAD])
def test_each_construct_metal_rejects_is_rejected_with_its_line(what, header, source, words):
    with pytest.raises(emu.EmuCompileError) as e:
        launch(source, header, name="bad_kernel")
    msg = str(e.value)
    assert "Metal kernel 'bad_kernel'" in msg and "not valid Metal" in msg, msg
    for w in words:
        assert w in msg, (w, msg)


GOOD = [
    ("address spaces", "inline float get(const device float* p, thread float& out) { out = p[0]; return out; }\n",
     "uint i = thread_position_in_grid.x;\nconst device float *p = x + i;\nthreadgroup float t[4];\nt[i] = p[0];\n"
     "thread float v = 0.0f;\ny[i] = get(p, v);"),
    ("multiplications and masks", "", "uint i = thread_position_in_grid.x;\nuint k = i * 2u & 3u;\n"
     "y[i] = o1b_store(o1b_mul(x[k % 4u], x[i]));"),
    ("calls of one helper from another", "", "uint i = thread_position_in_grid.x;\ny[i] = o1b_store(o1b_silu(x[i]));"),
]


@pytest.mark.parametrize("what, header, source", GOOD, ids=[g[0] for g in GOOD])
def test_valid_metal_passes_the_check(what, header, source):
    assert msl_check.check(runtime.header() + header, source) == ()


def test_every_shipped_kernel_passes_the_check():
    sources = sorted(p for p in runtime.SOURCE_DIR.glob("*.metal") if p.stem != runtime.HEADER_NAME)
    assert len(sources) > 30
    header = runtime.header()
    assert msl_check.check(header, "") == ()
    bad = {p.name: [str(v) for v in msl_check.check(header, p.read_text())] for p in sources}
    assert {k: v for k, v in bad.items() if v} == {}


# what g++ rejects once it compiles as MSL's C++14: C++17 features, VLAs, GNU extensions, and a `double`
# the source check cannot see (built by token pasting)
GXX_BAD = [
    ("if constexpr", "uint i = thread_position_in_grid.x;\nif constexpr (true) { y[i] = x[i]; }", "constexpr"),
    ("hex float literal", "uint i = thread_position_in_grid.x;\ny[i] = x[i] * 0x1p-3f;", "hexadecimal floating"),
    ("variable-length array", "uint i = thread_position_in_grid.x;\nfloat t[i + 1u];\nt[0] = x[i];\ny[i] = t[0];",
     "variable length array"),
    ("pasted double", "#define GLUE(a, b) a##b\nuint i = thread_position_in_grid.x;\nGLUE(dou, ble) d = x[i];\ny[i] = d;",
     "poisoned"),
]


@needs_gxx
@pytest.mark.parametrize("what, source, word", GXX_BAD, ids=[g[0] for g in GXX_BAD])
def test_gxx_rejects_what_cxx14_metal_rejects(what, source, word):
    with pytest.raises(emu.EmuCompileError, match="does not compile") as e:
        launch(source, name="cxx_bad")
    msg = str(e.value)
    assert word in msg, msg
    assert "cxx_bad:" in msg, msg          # g++ names the kernel's own file and line (#line markers)


def test_the_emulator_compiles_cxx14():
    assert "-std=c++14" in emu.CXX_FLAGS and "-pedantic-errors" in emu.CXX_FLAGS
    assert not any(f.startswith("-std=") and f != "-std=c++14" for f in emu.CXX_FLAGS)
