"""Shared test helpers: bit comparison with a useful message, seeded inputs, special values."""
from __future__ import annotations

import numpy as np

from mlx_open1b.spec.arith import f32_to_bf16

SPECIAL_F32 = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-40, 1e-45, 2.0 ** -126,
                        -(2.0 ** -126), 3.4028235e38, -3.4028235e38, 1.0, -1.0, 2.0 ** -70, 2.0 ** 70],
                       np.float32)
SPECIAL_BF16 = np.array([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0xFFC0, 0x0001, 0x8001, 0x007F,
                         0x0080, 0x7F7F, 0xFF7F, 0x3F80, 0xBF80, 0x1D80, 0x6280], np.uint16)


_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def assert_bits_equal(a, b, what: str = "") -> None:
    """Bit equality of two arrays (or scalars) of 2-, 4- or 8-byte elements (float32, bf16 as
    uint16, ...), reporting the first mismatch by its index in the arrays' shape (() for 0-d)."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, f"{what}: shapes differ {a.shape} vs {b.shape}"
    assert a.dtype.itemsize == b.dtype.itemsize and a.dtype.itemsize in _UINT, \
        f"{what}: element types {a.dtype} and {b.dtype} cannot be compared bit for bit"
    view, width = _UINT[a.dtype.itemsize], 2 * a.dtype.itemsize
    ua = np.ascontiguousarray(a).reshape(-1).view(view)          # 1-d, also for 0-d arrays
    ub = np.ascontiguousarray(b).reshape(-1).view(view)
    bad = np.flatnonzero(ua != ub)
    if bad.size:
        k = int(bad[0])
        i = tuple(int(x) for x in np.unravel_index(k, a.shape))
        raise AssertionError(f"{what}: {bad.size} of {a.size} elements differ; first at {i}: "
                             f"{a[i]!s} (0x{int(ua[k]):0{width}x}) vs {b[i]!s} (0x{int(ub[k]):0{width}x})")


def rand_f32(rng: np.random.Generator, shape, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def rand_bf16(rng: np.random.Generator, shape, scale: float = 1.0) -> np.ndarray:
    return f32_to_bf16(rand_f32(rng, shape, scale))


def sprinkle(rng: np.random.Generator, a: np.ndarray, specials: np.ndarray, frac: float = 0.05) -> np.ndarray:
    """A copy of a with a fraction of its entries replaced by special values."""
    a = a.copy()
    flat = a.reshape(-1)
    k = max(1, int(frac * flat.size))
    flat[rng.choice(flat.size, k, replace=False)] = rng.choice(specials, k)
    return a


def attention_i8_inputs(rng: np.random.Generator, B: int, T: int, H: int, G: int, D: int,
                        specials: bool = False):
    """q, k, v bf16 for the int8 attention forward (CONTRACT.md §6.10). Value rows (the D values of
    one key and kv head, each quantized alone) of very different magnitudes; with specials also a
    ±0 row (s_v = +0), a subnormal row (flushed: a zero row), a tiny row (s_v flushes), a row of
    largest normals, tie rows (s_v = 1: half-integer levels), a row holding +inf and one holding a
    NaN (s_v NaN: every query that sees it is NaN), and finite specials (±0, subnormals, ±1, tiny
    and large powers of two) sprinkled into q and k."""
    q = rand_bf16(rng, (B, T, H, D))
    k = rand_bf16(rng, (B, T, G, D))
    mag = np.exp(2.0 * rng.standard_normal((B, T, G, 1)))
    v = f32_to_bf16((rng.standard_normal((B, T, G, D)) * mag).astype(np.float32))
    if specials:
        rows = v.reshape(-1, D)
        pick = iter(rng.permutation(rows.shape[0]))
        kinds = {
            "zero": lambda: np.where(rng.integers(0, 2, D) == 1, 0x8000, 0).astype(np.uint16),
            "subnormal": lambda: (rng.integers(0, 0x10000, D) & 0x807F).astype(np.uint16),
            "tiny": lambda: f32_to_bf16((rng.uniform(-1, 1, D) * 2.0 ** -120).astype(np.float32)),
            "huge": lambda: np.where(rng.integers(0, 2, D) == 1, 0x7F7F, 0xFF7F).astype(np.uint16),
            "tie": lambda: f32_to_bf16(np.concatenate([[127.0], rng.integers(-253, 254, D - 1) / 2.0])
                                       .astype(np.float32)),
            "tie2": lambda: f32_to_bf16(np.concatenate([[-127.0], rng.integers(-253, 254, D - 1) / 2.0])
                                        .astype(np.float32)),
        }
        for name, make in kinds.items():
            r = next(pick, None)
            if r is not None:
                rows[r] = make()
        for bad in (0x7F80, 0x7FC1):
            r = next(pick, None)
            if r is not None:
                rows[r, rng.integers(D)] = bad
        fin = SPECIAL_BF16[[0, 1, 6, 7, 8, 9, 12, 13, 14]]
        q, k = sprinkle(rng, q, fin, 0.01), sprinkle(rng, k, fin, 0.01)
    return q, k, v


def attention_i8_special_rows(check, fp32_forward, rng):
    """A +inf value row makes every query that sees it NaN (and only those); lse is §6.6's; all-zero
    and all-tiny values (s_v = +0, or the block scale s_p flushes) give +0 outputs. `check(q, k, v,
    W, scale, what)` runs a backend against the spec and returns (o, lse)."""
    B, T, H, G, D, W = 1, 70, 2, 1, 4, 0
    q, k, v = attention_i8_inputs(rng, B, T, H, G, D)
    v[0, 40, 0, 2] = 0x7F80
    o, lse = check(q, k, v, W, 0.5, "inf row")
    assert np.isnan(o[0, 40:]).all() and not np.isnan(o[0, :40]).any()
    assert_bits_equal(lse, fp32_forward(q, k, v, W, 0.5)[1], "lse is the fp32 path's")
    v[0, 40, 0, 2] = 0
    v[0, 5] = 0x7FC1                                          # a NaN row inside a window of 3
    o, _ = check(q, k, v, 3, 0.5, "nan row, window 3")
    assert np.isnan(o[0, 5:8]).all() and not np.isnan(o[0, :5]).any() and not np.isnan(o[0, 8:]).any()
    for what, vv in (("zero", np.where(rng.integers(0, 2, v.shape) == 1, 0x8000, 0).astype(np.uint16)),
                     ("subnormal", (rng.integers(0, 0x10000, v.shape) & 0x807F).astype(np.uint16)),
                     ("tiny", f32_to_bf16((rng.uniform(-1, 1, v.shape) * 2.0 ** -118).astype(np.float32)))):
        o, _ = check(q, k, vv, W, 0.5, what)
        if what != "tiny":
            assert not o.view(np.uint32).any(), what


def attention_i8_ties_to_even(check):
    """q = 0: every score is 0 and every p_j = 1, so t_j = s_v[j]. Key 0's values [127, 0] give
    s_v = 1, key 1's [62.5, 0] s_v = div(62.5, 127); query 1's block scale is s_p = div(1, 127) and
    its weights level(127) = 127, level(62.5) = 62 (a tie, to even): o = mul(i2f(127 * 189), s_p) / 2."""
    q = np.zeros((1, 2, 1, 2), np.uint16)
    k = f32_to_bf16(np.ones((1, 2, 1, 2), np.float32))
    v = f32_to_bf16(np.array([[127.0, 0.0], [62.5, 0.0]], np.float32)).reshape(1, 2, 1, 2)
    o, lse = check(q, k, v, 0, 1.0, "ties")
    f = np.float32
    sp = f(1) / f(127)
    assert o[0, 0, 0, 0] == f(f(127 * 127) * sp) * (f(1) / f(1))
    assert o[0, 1, 0, 0] == f(f(127 * 189) * sp) * (f(1) / f(2))       # 62.5 -> 62, not 63
    assert o[0, 1, 0, 1] == 0 and o.view(np.uint32)[0, 1, 0, 1] == 0


def attention_vquant_is_the_per_tensor_rule(run_vquant, rng):
    """The value-row kernel alone: each row's (q_v, s_v) is §6.9's per-tensor quantization of it."""
    from mlx_open1b.spec import quant as spec_quant
    B, T, G, D = 2, 9, 2, 6
    _, _, v = attention_i8_inputs(rng, B, T, G, G, D, specials=True)
    v[0, 0, 0] = f32_to_bf16(np.array([127.0, 0.5, -0.5, 1.5, 2.5, -126.5], np.float32))   # ties, s = 1
    qv, sv = run_vquant(v)
    assert qv.shape == (B, T, G, D) and qv.dtype == np.int8 and sv.shape == (B, T, G)
    assert qv[0, 0, 0].tolist() == [127, 0, 0, 2, 2, -126]
    for idx in np.ndindex(B, T, G):
        want_q, want_s = spec_quant.quant_tensor(v[idx])
        assert np.array_equal(qv[idx], want_q.reshape(D)), idx
        assert_bits_equal(np.float32(sv[idx]), np.float32(want_s), f"s_v {idx}")


def attention_i8_empty_and_bad_arguments(backend_fn, ref_fn):
    """Empty batches give empty outputs like the reference's; bad arguments give its error text."""
    import pytest
    for shape in ((0, 5, 2, 4), (1, 0, 2, 4)):
        q = np.zeros(shape, np.uint16)
        kv = np.zeros(shape[:2] + (1, 4), np.uint16)
        o, lse = backend_fn(q, kv, kv, 0, 0.5)
        ro, rl = ref_fn(q, kv, kv, 0, 0.5)
        assert o.shape == ro.shape and lse.shape == rl.shape and o.dtype == lse.dtype == np.float32
    q, kv = np.zeros((1, 3, 3, 4), np.uint16), np.zeros((1, 3, 2, 4), np.uint16)
    for args in ((q, kv, kv, 0, 0.5), (q.astype(np.float32), kv[:, :, :1], kv[:, :, :1], 0, 0.5),
                 (q, kv[:, :, :1], kv[:, :, :1], -1, 0.5)):
        with pytest.raises(ValueError) as e_ref:
            ref_fn(*args)
        with pytest.raises(ValueError) as e_be:
            backend_fn(*args)
        assert str(e_be.value) == str(e_ref.value)


# ------------------------------------------------------------------ §6.10 attention: shared checks
I8_SHAPES = [(1, 7, 2, 1, 4, 0), (1, 70, 2, 2, 3, 0), (2, 67, 3, 1, 5, 65), (1, 9, 2, 2, 2, 1), (1, 130, 2, 1, 8, 100)]



def attention_i8_matches_spec(check, rng, B, T, H, G, D, W):
    """Plain inputs, then zero / subnormal / tiny / huge / tie / +inf / NaN value rows and finite
    specials in q and k, at three scales."""
    for specials, scale in ((False, float(np.float32(1 / np.sqrt(D)))), (True, 1.0), (True, 8.0)):
        q, k, v = attention_i8_inputs(rng, B, T, H, G, D, specials)
        check(q, k, v, W, scale, f"{B, T, H, G, D, W} specials={specials} scale={scale}")


# ------------------------------------------------------------------ §6.9 the simulated int4 / int6 layer
QMAX4, QMAX6 = 7, 31
#: per level bound: an activation magnitude whose div(a, qmax) is a normal while div(a, 127) flushes
#: (the next lower power of two flushes at qmax as well)
TINY_E = {QMAX4: -123, QMAX6: -121}


def near_min_normal_pairs(rng, n):
    """Operand pairs whose exact product (or quotient) lies within a few ulp of 2^-126."""
    a = rng.uniform(1.0, 2.0, n).astype(np.float32) * np.float32(2.0) ** rng.integers(-60, 60, n).astype(np.float32)
    b_mul = (np.float64(2.0 ** -126) / a.astype(np.float64)).astype(np.float32)
    with np.errstate(over="ignore"):
        b_div = (a.astype(np.float64) / np.float64(2.0 ** -126)).astype(np.float32)
    steps = rng.integers(-3, 4, n).astype(np.int32)
    b_mul = (b_mul.view(np.int32) + steps).view(np.float32)
    b_div = (b_div.view(np.int32) + steps).view(np.float32)
    sign = rng.choice(np.array([1, -1], np.float32), n)
    return a * sign, b_mul, b_div


def assert_attention_is_spec(q, k, v, dout, o, lse, grads, W, scale, prefix: str = "") -> None:
    """An attention forward (o, lse) and backward (dq, dk, dv) on these inputs equal the numpy
    spec's, bit for bit (messages name each output, after `prefix`)."""
    from mlx_open1b.spec import attention as SA
    so, slse = SA.attention_forward(q, k, v, W, scale)
    assert_bits_equal(o, so, f"{prefix}o: scalar C vs spec")
    assert_bits_equal(lse, slse, f"{prefix}lse: scalar C vs spec")
    for a, b, what in zip(grads, SA.attention_backward(dout, q, k, v, o, lse, W, scale), "qkv"):
        assert_bits_equal(a, b, f"{prefix}d{what}: scalar C vs spec")


def loadable_backends() -> list:
    """(name, module) of every backend that loads here (cpu_ref always; metal and cuda on a device or
    their emulators), and the parity harness's spec, which claims the interface too."""
    from mlx_open1b import backend
    from mlx_open1b.parity import spec_backend
    out = []
    for name in backend.BACKENDS:
        try:
            out.append((name, backend.load(name)))
        except backend.BackendUnavailable:
            pass
    return out + [("spec", spec_backend)]
