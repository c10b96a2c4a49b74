"""The emulators' modelled fp32 unit: `emu.hardware(fault=..., adversarial_flush=..., seed=...)` in
mlx_open1b.metal.emu and mlx_open1b.cuda.emu (hwmodel.py, hwfloat.h).

One probe kernel per emulator computes, per element, the contract's add, sub, mul, div, exp, log,
sin, cos, rsqrt, sigmoid, silu and an 8-term dot product (the header's helpers), and the bare
hardware add, sub, mul, div (Metal: the header's O1B_HW_* hooks; CUDA: __fadd_rn ...). The inputs
make tiny sums, differences, products and quotients of both signs. Tests:
- each planted fault changes exactly the contract ops listed in VISIBLE (a fault the contract code
  is immune to is asserted immune, on inputs where the bare hardware op does show the fault);
- the bare hardware ops do what the fault says (round toward zero, fused multiply-add, +0);
- adversarial flushing gives every kind of answer for tiny results and no contract op changes;
- no fault or mode outlives its block (libraries are chosen per launch, the cache key holds it).
"""
from __future__ import annotations

import contextlib
from fractions import Fraction

import numpy as np
import pytest

import mlx_open1b.cpu_ref as C
from mlx_open1b.cuda import emu as cemu, runtime as crt
from mlx_open1b.metal import emu as memu, runtime as mrt
from mlx_open1b.metal.emu import hwmodel
from mlx_open1b.spec import arith as A

pytestmark = pytest.mark.skipif(not cemu.compiler_available()[0], reason="the emulators need g++")

CONTRACT = ["add", "sub", "mul", "div", "exp", "log", "sin", "cos", "rsqrt", "sigmoid", "silu", "dot"]
RAW = ["hw_add", "hw_sub", "hw_mul", "hw_div"]
COLS = CONTRACT + RAW
NC = len(COLS)

# Which contract ops each planted fault changes (on the probe inputs), per emulator. Metal's header
# divides in integers (no fp32 division instruction) and re-signs flushed zeros from the operands;
# CUDA's divides with __fdiv_rn and re-signs too. Contraction changes every Horner step and sum.
VISIBLE = {
    ("metal", "div_rz"): set(),
    ("metal", "fma"): {"exp", "log", "sin", "cos", "sigmoid", "silu", "dot"},
    ("metal", "flush_unsigned"): set(),
    ("cuda", "div_rz"): {"div", "log", "rsqrt", "sigmoid", "silu"},
    ("cuda", "fma"): {"exp", "log", "sin", "cos", "sigmoid", "silu", "dot"},
    ("cuda", "flush_unsigned"): set(),
}

_BODY = """
float x = o1b_load(a[i]), y = o1b_load(b[i]);
out[i * 16 + 0] = o1b_store(o1b_add(x, y));
out[i * 16 + 1] = o1b_store(o1b_sub(x, y));
out[i * 16 + 2] = o1b_store(o1b_mul(x, y));
out[i * 16 + 3] = o1b_store(o1b_div(x, y));
out[i * 16 + 4] = o1b_store(o1b_exp(x));
out[i * 16 + 5] = o1b_store(o1b_log(x));
out[i * 16 + 6] = o1b_store(o1b_sin(x));
out[i * 16 + 7] = o1b_store(o1b_cos(x));
out[i * 16 + 8] = o1b_store(o1b_rsqrt(x));
out[i * 16 + 9] = o1b_store(o1b_sigmoid(x));
out[i * 16 + 10] = o1b_store(o1b_silu(x));
float acc = 0.0f;
for (int k = 0; k < 8; k++) acc = o1b_add(acc, o1b_mul(o1b_load(a[(i + k) % N]), o1b_load(b[(i + 3 * k) % N])));
out[i * 16 + 11] = o1b_store(acc);
out[i * 16 + 12] = HW_ADD(x, y);
out[i * 16 + 13] = HW_SUB(x, y);
out[i * 16 + 14] = HW_MUL(x, y);
out[i * 16 + 15] = HW_DIV(x, y);
"""
METAL_SRC = ("uint i = thread_position_in_grid.x;\nuint N = n[0];\n"
             + _BODY.replace("HW_", "O1B_HW_"))
CUDA_SRC = ('#include "contract.cuh"\n'
            'extern "C" __global__ void probe(i64 N, const float *a, const float *b, float *out) {\n'
            "i64 i = o1b_gid();\nif (i >= N) return;\n"
            + _BODY.replace("HW_ADD", "__fadd_rn").replace("HW_SUB", "__fsub_rn")
            .replace("HW_MUL", "__fmul_rn").replace("HW_DIV", "__fdiv_rn") + "}\n")


# Inputs whose log a contracted multiply-add changes: contraction rarely survives log's last rounding
# (7 of 40,000 log-uniform values in [e^-12, e^12], found by searching with the fma fault on).
LOG_FMA = np.array([0x3B32CBB8, 0x3D1F78E8, 0x3D2CD1E4, 0x3E5E6CC2, 0x3ED92A62, 0x3F33F584, 0x45984E49],
                   np.uint32).view(np.float32)


def probe_inputs(n: int = 600):
    """Five groups of n pairs: tiny sums, tiny differences, tiny products, tiny quotients (all with
    random signs, some exact results just below 2^-126), ordinary values."""
    rng = np.random.default_rng(20261)
    sign = lambda: rng.choice(np.float32([1, -1]), n)                       # noqa: E731
    t = (rng.uniform(1, 4, n) * 2.0 ** -126).astype(np.float32) * sign()
    mag = (rng.uniform(1, 2, n) * 2.0 ** rng.integers(-30, 30, n)).astype(np.float32)
    below = rng.uniform(0.3, 1.05, n)
    prod_b = (2.0 ** -126 / mag.astype(np.float64) * below).astype(np.float32) * sign()
    quot_a = (2.0 ** -126 * mag.astype(np.float64) * below).astype(np.float32) * sign()
    ordinary = [(rng.standard_normal(n) * 4).astype(np.float32) for _ in range(2)]
    ordinary[0][:LOG_FMA.size] = LOG_FMA
    x = np.concatenate([t, t, mag * sign(), quot_a, ordinary[0]])
    y = np.concatenate([-(t * np.float32(1.5)), t * np.float32(1.25), prod_b, mag, ordinary[1]])
    return np.ascontiguousarray(x, np.float32), np.ascontiguousarray(y, np.float32)


def contract_want(x, y) -> np.ndarray:
    fa, fb = A.flush(x), A.flush(y)
    n = x.size
    cols = [A.add(fa, fb), A.sub(fa, fb), A.mul(fa, fb), A.div(fa, fb), C.exp(x), C.log(x), C.sin(x),
            C.cos(x), C.rsqrt(x), C.sigmoid(x), C.silu(x)]
    acc, idx = np.zeros(n, np.float32), np.arange(n)
    for k in range(8):
        acc = A.add(acc, A.mul(fa[(idx + k) % n], fb[(idx + 3 * k) % n]))
    return np.stack([A.store(c) for c in cols + [acc]], 1)


def run_metal(x, y) -> np.ndarray:
    k = memu.EmuKernel("hw_probe", ["a", "b", "n"], ["out"], METAL_SRC, mrt.header())
    (o,) = k(inputs=[x, y, np.array([x.size], np.uint32)], output_shapes=[(x.size, NC)],
             output_dtypes=[np.float32], grid=(x.size, 1, 1), threadgroup=(64, 1, 1))
    return o


def cuda_module():
    return cemu.EmuModule(crt.read_source_text(CUDA_SRC, "probe.cu"), name="probe.cu")


def run_cuda(x, y, module=None) -> np.ndarray:
    o = np.empty((x.size, NC), np.float32)
    (module or cuda_module()).get_function("probe")(((x.size + 127) // 128,), (128,), (np.int64(x.size), x, y, o))
    return o


EMULATORS = {"metal": (memu, run_metal), "cuda": (cemu, run_cuda)}


@pytest.fixture(scope="module")
def probe():
    """Inputs, the contract's answers, and each emulator's outputs on the plain hardware."""
    x, y = probe_inputs()
    plain = {name: run(x, y) for name, (_, run) in EMULATORS.items()}
    return x, y, contract_want(x, y), plain


def changed(got, want, cols=CONTRACT) -> set:
    diff = got.view(np.uint32) != want.view(np.uint32)
    return {c for c in cols if diff[:, COLS.index(c)].any()}


def test_plain_hardware_is_the_contract(probe):
    x, y, want, plain = probe
    for name, out in plain.items():
        assert changed(out[:, :12], want) == set(), name


# --------------------------------------------------------------------------------- faults
@pytest.mark.parametrize("name", sorted(EMULATORS))
@pytest.mark.parametrize("fault", hwmodel.FAULTS)
def test_fault_changes_exactly_the_listed_contract_ops(probe, name, fault):
    x, y, want, plain = probe
    emu, run = EMULATORS[name]
    with emu.hardware(fault=fault):
        got = run(x, y)
    assert changed(got[:, :12], want) == VISIBLE[(name, fault)]
    if not VISIBLE[(name, fault)]:      # immune, yet the bare hardware ops of the same launch show it
        assert changed(got, plain[name], RAW), f"{name}: {fault} does not reach the hardware ops"


def rz_quotient(a, b) -> np.ndarray:
    """fp32 a/b rounded toward zero (the float64 quotient is on the same side of every float)."""
    with np.errstate(all="ignore"):
        d = a.astype(np.float64) / b.astype(np.float64)
        q = d.astype(np.float32)
        away = np.abs(q.astype(np.float64)) > np.abs(d)
        q[away] = np.nextafter(q[away], np.float32(0))
    return q


def f32_round(v: Fraction) -> np.float32:
    """The fp32 value nearest to v, ties to even (normal range)."""
    d = np.float32(float(v))
    cands = [np.nextafter(d, np.float32(-np.inf)), d, np.nextafter(d, np.float32(np.inf))]
    return min(cands, key=lambda c: (abs(Fraction(float(c)) - v), int(c.view(np.uint32)) & 1))


@pytest.mark.parametrize("name", sorted(EMULATORS))
def test_div_rz_rounds_the_hardware_quotient_toward_zero(probe, name):
    x, y, want, plain = probe
    emu, run = EMULATORS[name]
    with emu.hardware(fault="div_rz"):
        got = run(x, y)[:, COLS.index("hw_div")]
    fx, fy = A.flush(x), A.flush(y)
    normal = np.abs(plain[name][:, COLS.index("hw_div")]) >= np.float32(2.0 ** -126)
    assert np.array_equal(got[normal].view(np.uint32), rz_quotient(fx, fy)[normal].view(np.uint32))
    assert (got[normal] != plain[name][normal, COLS.index("hw_div")]).sum() > 100


def test_fma_fuses_a_product_into_the_add_that_takes_it():
    """add(acc, mul(a, b)) on the fma hardware is one correctly rounded a*b + acc, for every order of
    operands; an add of two values that are not fresh products is left alone."""
    rng = np.random.default_rng(7)
    n = 300
    a, b, c = (rng.standard_normal((3, n)) * np.float32(3)).astype(np.float32)
    src_m = """uint i = thread_position_in_grid.x;
float p = O1B_HW_MUL(a[i], b[i]);
out[3 * i] = O1B_HW_ADD(c[i], p);
float q = O1B_HW_MUL(a[i], b[i]);
out[3 * i + 1] = O1B_HW_SUB(q, c[i]);
out[3 * i + 2] = O1B_HW_ADD(c[i], a[i]);
"""
    src_c = ('extern "C" __global__ void f(const float *a, const float *b, const float *c, float *out) {\n'
             "int i = threadIdx.x;\n" + src_m.split("\n", 1)[1].replace("O1B_HW_MUL", "__fmul_rn")
             .replace("O1B_HW_ADD", "__fadd_rn").replace("O1B_HW_SUB", "__fsub_rn") + "}\n")
    want = np.stack([[f32_round(Fraction(float(u)) * Fraction(float(v)) + Fraction(float(w))) for u, v, w in zip(a, b, c)],
                     [f32_round(Fraction(float(u)) * Fraction(float(v)) - Fraction(float(w))) for u, v, w in zip(a, b, c)],
                     c + a], 1).astype(np.float32)
    for name in ("metal", "cuda"):
        with EMULATORS[name][0].hardware(fault="fma"):
            if name == "metal":
                (got,) = memu.EmuKernel("fma_probe", ["a", "b", "c"], ["out"], src_m, mrt.header())(
                    inputs=[a, b, c], output_shapes=[(n, 3)], output_dtypes=[np.float32], grid=(n, 1, 1),
                    threadgroup=(n, 1, 1))
            else:
                got = np.empty((n, 3), np.float32)
                cemu.EmuModule(src_c, name="fma_probe.cu").get_function("f")((1,), (n,), (a, b, c, got))
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), name
        unfused = (a * b + c).astype(np.float32)
        assert (got[:, 0] != unfused).sum() > 20, name       # the fusion is visible


@pytest.mark.parametrize("name", sorted(EMULATORS))
def test_flush_unsigned_returns_plus_zero_for_every_tiny_result(probe, name):
    x, y, want, plain = probe
    emu, run = EMULATORS[name]
    with emu.hardware(fault="flush_unsigned"):
        got = run(x, y)
    fx, fy = A.flush(x).astype(np.float64), A.flush(y).astype(np.float64)
    exact = {"hw_add": fx + fy, "hw_sub": fx - fy, "hw_mul": fx * fy}
    negative_tiny = 0
    for col, e in exact.items():
        tiny = (e != 0) & (np.abs(e) < 2.0 ** -126)
        g = got[:, COLS.index(col)].view(np.uint32)
        assert (g[tiny] == 0).all(), col
        assert np.array_equal(g[~tiny], plain[name][~tiny, COLS.index(col)].view(np.uint32)), col
        negative_tiny += int((tiny & (e < 0)).sum())
    assert negative_tiny > 300          # many results whose sign the fault loses


# --------------------------------------------------------------------------------- adversarial flushing
@pytest.mark.parametrize("name", sorted(EMULATORS))
def test_adversarial_flushing_answers_every_way_and_the_contract_holds(probe, name):
    x, y, want, plain = probe
    emu, run = EMULATORS[name]
    outs = []
    for seed in (0, 1):
        with emu.hardware(adversarial_flush=True, seed=seed):
            got = run(x, y)
        assert changed(got[:, :12], want) == set(), seed
        outs.append(got)
    fx, fy = A.flush(x), A.flush(y)
    e = fx.astype(np.float64) * fy.astype(np.float64)
    tiny = (e != 0) & (np.abs(e) < 2.0 ** -126)
    col = COLS.index("hw_mul")
    with np.errstate(all="ignore"):
        ieee_value = (fx * fy)[tiny].view(np.uint32)         # numpy: IEEE gradual underflow
    for got in outs:
        g = got[tiny, col].view(np.uint32)
        pz, nz = g == 0, g == 0x80000000
        ieee = (g == ieee_value) & ~pz & ~nz
        assert (ieee | pz | nz).all() and ieee.sum() > 50 and pz.sum() > 50 and nz.sum() > 50
        assert np.array_equal(got[~tiny, col].view(np.uint32), plain[name][~tiny, col].view(np.uint32))
    assert not np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))   # the seed matters


def test_adversarial_choices_do_not_depend_on_thread_order():
    """The choice is a function of (seed, thread, the thread's count): the race check (threads in
    forward and reverse order) passes on both emulators."""
    x, y = probe_inputs(100)
    with cemu.hardware(adversarial_flush=True):
        with cemu.options(race_check=True):
            checked = run_cuda(x, y)
        assert np.array_equal(checked.view(np.uint32), run_cuda(x, y).view(np.uint32))
    k = memu.EmuKernel("hw_probe", ["a", "b", "n"], ["out"], METAL_SRC, mrt.header(), race_check=True)
    with memu.hardware(adversarial_flush=True):
        assert np.array_equal(k(inputs=[x, y, np.array([x.size], np.uint32)], output_shapes=[(x.size, NC)],
                                output_dtypes=[np.float32], grid=(x.size, 1, 1), threadgroup=(64, 1, 1))[0]
                              .view(np.uint32), run_metal(x, y).view(np.uint32))


# --------------------------------------------------------------------------------- no leaks
def test_metal_fault_lives_only_inside_its_block(probe, tmp_path, monkeypatch):
    x, y, want, plain = probe
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))       # a cold disk cache
    memu.clear_memory_cache()
    k = memu.EmuKernel("hw_probe", ["a", "b", "n"], ["out"], METAL_SRC, mrt.header())
    call = lambda: k(inputs=[x, y, np.array([x.size], np.uint32)], output_shapes=[(x.size, NC)],   # noqa: E731
                     output_dtypes=[np.float32], grid=(x.size, 1, 1), threadgroup=(64, 1, 1))[0]
    before = call()
    compiles = memu.stats["compiles"]
    with memu.hardware(fault="fma"):
        inside = call()
    assert memu.stats["compiles"] == compiles + 1              # its own library, not the plain one
    after = call()
    assert np.array_equal(before.view(np.uint32), plain["metal"].view(np.uint32))
    assert np.array_equal(after.view(np.uint32), before.view(np.uint32))
    assert changed(inside[:, :12], want) == VISIBLE[("metal", "fma")]
    memu.clear_memory_cache()                                 # a new process: from the disk cache
    with memu.hardware(fault="fma"):
        assert np.array_equal(call().view(np.uint32), inside.view(np.uint32))
    assert np.array_equal(call().view(np.uint32), before.view(np.uint32))


def test_cuda_fault_lives_only_inside_its_block(probe):
    x, y, want, plain = probe
    outside = cuda_module()                    # built outside, launched inside: the fault applies
    with cemu.hardware(fault="div_rz"):
        inside_mod = cuda_module()
        got = run_cuda(x, y, outside)
    assert changed(got[:, :12], want) == VISIBLE[("cuda", "div_rz")]
    # built inside, launched outside: plain; and the module cache of the runtime cannot leak it
    assert np.array_equal(run_cuda(x, y, inside_mod).view(np.uint32), plain["cuda"].view(np.uint32))
    v = np.linspace(0.1, 10, 50, dtype=np.float32)
    with crt.emulate():
        from mlx_open1b.cuda import ops as cu
        base = cu.rsqrt(v)
        with cemu.hardware(fault="div_rz"):
            faulty = cu.rsqrt(v)
        again = cu.rsqrt(v)
    assert np.array_equal(base.view(np.uint32), C.rsqrt(v).view(np.uint32))
    assert not np.array_equal(faulty.view(np.uint32), base.view(np.uint32))
    assert np.array_equal(again.view(np.uint32), base.view(np.uint32))


def test_blocks_nest_and_the_environment_sets_the_default(monkeypatch):
    monkeypatch.delenv("O1B_EMU_ADVERSARIAL", raising=False)
    for emu in (memu, cemu):
        s = emu._hardware
        assert s.current() == hwmodel.Hardware()
        with emu.hardware(fault="fma") as outer:
            with emu.hardware(adversarial_flush=True, seed=5) as inner:
                assert s.current() is inner and inner.defines() != outer.defines()
            assert s.current() is outer
        assert s.current() == hwmodel.Hardware()
        monkeypatch.setenv("O1B_EMU_ADVERSARIAL", "1")
        monkeypatch.setenv("O1B_EMU_ADVERSARIAL_SEED", "9")
        assert s.current() == hwmodel.Hardware(adversarial_flush=True, seed=9)
        with emu.hardware():                              # a block names the whole hardware
            assert not s.current().active
        monkeypatch.setenv("O1B_EMU_ADVERSARIAL_SEED", "x")
        with pytest.raises(ValueError, match="O1B_EMU_ADVERSARIAL_SEED"):
            s.current()
        monkeypatch.delenv("O1B_EMU_ADVERSARIAL")
        monkeypatch.delenv("O1B_EMU_ADVERSARIAL_SEED")


def test_bad_arguments_are_refused(monkeypatch):
    monkeypatch.delenv("O1B_EMU_ADVERSARIAL", raising=False)
    for emu in (memu, cemu):
        with pytest.raises(ValueError, match="div_rz, fma, flush_unsigned"):
            with emu.hardware(fault="fdiv"):
                pass
        for seed in (-1, 2 ** 64, 1.5):
            with pytest.raises(ValueError, match="seed"):
                with emu.hardware(seed=seed):
                    pass
        assert not emu._hardware.current().active
