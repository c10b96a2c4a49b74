"""The int8 P·V attention forward (CONTRACT.md §6.10): the C reference against the numpy spec bit
for bit (special values included), causality of the quantization scales, an error bound against
float64 derived from the quantization grid, and the ∇Q small-gradient property the contract
claims instead of the paper's fixed-point accumulation."""
from __future__ import annotations

import numpy as np
import pytest

from mlx_open1b import cpu_ref
from mlx_open1b.spec import attention as spec
from mlx_open1b.spec.arith import bf16_to_f32, f32_to_bf16

from helpers import SPECIAL_BF16, assert_bits_equal
from test_attention import SHAPES, make_inputs, ref64

NAN = 0x7FC00000


def outlier_values(seed, B, T, G, D):
    """Value rows of very different magnitudes (per-row scales matter) with a few outlier entries."""
    rng = np.random.default_rng(seed)
    v = rng.standard_normal((B, T, G, D)) * np.exp(1.5 * rng.standard_normal((B, T, G, 1)))
    v.reshape(-1)[rng.choice(v.size, max(1, v.size // 100), replace=False)] *= 30
    return f32_to_bf16(v.astype(np.float32))


@pytest.mark.parametrize("B,T,H,G,D,W", SHAPES)
def test_c_matches_spec(B, T, H, G, D, W):
    q, k, _, _ = make_inputs(B * 100 + T + W, B, T, H, G, D, sigma=2.0)
    v = outlier_values(T + D, B, T, G, D)
    scale = 1.1 / np.sqrt(D)
    o_c, lse_c = cpu_ref.attention_forward_i8(q, k, v, W, scale)
    o_s, lse_s = spec.attention_forward_i8(q, k, v, W, scale)
    assert_bits_equal(o_c, o_s, "o")
    assert_bits_equal(lse_c, lse_s, "lse")


def test_special_values_match_spec():
    """Subnormals, ±0, ±inf, NaN and extreme normals sprinkled into q, k and v."""
    rng = np.random.default_rng(3)
    for trial in range(4):
        B, T, H, G, D, W = 1, 70, 4, 2, 8, (0, 5, 64, 0)[trial]
        q, k, v, _ = make_inputs(40 + trial, B, T, H, G, D)
        for a in (q, k, v):
            idx = rng.choice(a.size, 6, replace=False)
            a.reshape(-1)[idx] = rng.choice(SPECIAL_BF16, 6)
        o_c, lse_c = cpu_ref.attention_forward_i8(q, k, v, W, 0.3)
        o_s, lse_s = spec.attention_forward_i8(q, k, v, W, 0.3)
        assert_bits_equal(o_c, o_s, f"o trial {trial}")
        assert_bits_equal(lse_c, lse_s, f"lse trial {trial}")


def test_lse_is_the_bf16_paths():
    """Only the weighted sum of values is quantized: l, m and lse are §6.6's, bit for bit."""
    q, k, v, _ = make_inputs(9, 2, 130, 4, 2, 16, sigma=2.0)
    _, lse = cpu_ref.attention_forward(q, k, v, 40, 0.3)
    o8, lse8 = cpu_ref.attention_forward_i8(q, k, v, 40, 0.3)
    assert_bits_equal(lse8, lse, "lse")
    o, _ = cpu_ref.attention_forward(q, k, v, 40, 0.3)
    assert (o8.view(np.uint32) != o.view(np.uint32)).any()        # the product really is quantized


def test_threads_do_not_change_bits():
    q, k, _, _ = make_inputs(8, 2, 130, 4, 2, 16, sigma=2.0)
    v = outlier_values(8, 2, 130, 2, 16)
    with cpu_ref.settings(threads=1):
        ref = cpu_ref.attention_forward_i8(q, k, v, 100, 0.3)
    for threads in (2, 3, 7):
        with cpu_ref.settings(threads=threads):
            for a, b in zip(ref, cpu_ref.attention_forward_i8(q, k, v, 100, 0.3)):
                assert_bits_equal(a, b, f"threads={threads}")


@pytest.mark.parametrize("j", [5, 63, 64, 100])
def test_scales_are_causal(j):
    """Changing (even poisoning) the values of key j and later keys — including keys in the same
    64-key block — changes no bit of the outputs of queries before j. A scale shared by all keys
    of a block would fail this (the contract's reason for per-row value scales)."""
    B, T, H, G, D = 1, 130, 4, 2, 8
    q, k, v, _ = make_inputs(j, B, T, H, G, D)
    o, lse = cpu_ref.attention_forward_i8(q, k, v, 0, 0.3)
    v2 = v.copy()
    v2[:, j + 1:] = f32_to_bf16((bf16_to_f32(v2[:, j + 1:]) * 50).astype(np.float32))
    v2[:, j] = 0x7FC0                                                   # NaN value row
    o2, lse2 = cpu_ref.attention_forward_i8(q, k, v2, 0, 0.3)
    assert_bits_equal(o2[:, :j], o[:, :j], "earlier queries")
    assert_bits_equal(lse2, lse, "lse")
    assert (o2[:, j:].view(np.uint32) == NAN).all()                    # every later query sees j


def test_nonfinite_and_zero_value_rows():
    B, T, H, G, D = 1, 70, 2, 1, 8
    q, k, v, _ = make_inputs(1, B, T, H, G, D)
    v[:, :] = 0
    o, _ = cpu_ref.attention_forward_i8(q, k, v, 0, 0.3)
    assert (o.view(np.uint32) == 0).all()                              # zero rows give +0
    v[0, 10, 0, 3] = 0x7F80                                            # +inf in one value row
    o, _ = cpu_ref.attention_forward_i8(q, k, v, 4, 0.3)
    nan_rows = (o.view(np.uint32) == NAN).all(axis=(2, 3))[0]
    assert list(np.flatnonzero(nan_rows)) == [10, 11, 12, 13]          # the queries that see key 10


def int8_error_bound(P, vis, vh, T):
    """Bound on |o_int8 - o_exact| per element from the quantization grid (§6.10).

    Per key block b and query i, with w_j = P_ij (normalized weights) and a_j = max_d |v_jd|:
    the value step is s_v = a_j/127, so |v_jd - q_v s_v| <= a_j/254; the weight step of the block
    is s_p = max_j(w_j a_j)/127 (in normalized units), so |q_p s_p - w_j s_v| <= s_p/2 and,
    with |q_v| <= 127, each term's error is at most 127 s_p/2 + w_j a_j/254. Summed:
        |err_d| <= (sum_b n_b m_b + sum_j w_j a_j) / 254,  m_b = max_{j in b} w_j a_j,
    n_b the block's participating keys.
    fp32 rounding of the rest (the bf16 path's error, below 1e-5 relative to sum_j w_j |v_jd| at
    these shapes: test_attention's bounds) is added as that slack."""
    amax = np.abs(vh).max(-1)                                         # (B, H, T_j)
    wa = P * amax[:, :, None, :]                                      # (B, H, T_i, T_j)
    bound = wa.sum(-1)
    for kb in range((T + 63) // 64):
        blk = slice(kb * 64, min(T, kb * 64 + 64))
        n = vis[:, blk].sum(-1)                                       # (T_i,)
        bound = bound + n * wa[..., blk].max(-1, initial=0.0)
    bound = bound / 254.0
    slack = 1e-5 * np.einsum("bhij,bjhd->bhid", P, np.abs(vh.transpose(0, 2, 1, 3)))
    return bound[..., None] + slack                                    # (B, H, T, D)


@pytest.mark.parametrize("B,T,H,G,D,W", [(1, 130, 4, 2, 16, 0), (2, 70, 4, 1, 8, 5), (1, 200, 2, 2, 32, 64)])
def test_accuracy_against_float64(B, T, H, G, D, W):
    q, k, _, dout = make_inputs(T + W, B, T, H, G, D, sigma=2.0)
    v = outlier_values(T, B, T, G, D)
    qf, kf, vf = (bf16_to_f32(x).astype(np.float64) for x in (q, k, v))
    r = ref64(qf, kf, vf, dout.astype(np.float64), W, np.float64(np.float32(0.3)))
    o8, _ = cpu_ref.attention_forward_i8(q, k, v, W, 0.3)
    err = np.abs(o8.astype(np.float64) - r["o"]).transpose(0, 2, 1, 3)  # (B, H, T, D)
    bound = int8_error_bound(r["P"], r["vis"], r["vh"].transpose(0, 2, 1, 3), T)
    worst = (err / bound).max()
    assert worst <= 1.0, f"error exceeds the quantization bound by {worst:.3f}x"
    rel = np.linalg.norm(err) / np.linalg.norm(r["o"])
    assert 1e-4 < rel < 0.03, rel           # quantized (not exact), and about 1% like the paper's int8


def test_dq_survives_tiny_gradients():
    """§6.10's claim: the backward's ordered fp32 sums keep ∇Q at any gradient scale. With dout
    scaled by 2^-60 every dq is exactly 2^-60 times the unscaled one (powers of two scale fp32
    exactly while nothing underflows), and far below 2^-32, the quantum at which a 64-bit
    fixed-point accumulator without the paper's gradient scaling would return zero."""
    q, k, v, dout = make_inputs(12, 1, 70, 4, 2, 16)
    o, lse = cpu_ref.attention_forward_i8(q, k, v, 0, 0.3)
    dq, dk, dv = cpu_ref.attention_backward(dout, q, k, v, o, lse, 0, 0.3)
    tiny = (dout * np.float32(2.0 ** -60)).astype(np.float32)
    dq_t, dk_t, dv_t = cpu_ref.attention_backward(tiny, q, k, v, o, lse, 0, 0.3)
    for name, a, b in (("dq", dq, dq_t), ("dk", dk, dk_t), ("dv", dv, dv_t)):
        assert_bits_equal((a * np.float32(2.0 ** -60)).astype(np.float32), b, name)
    assert np.count_nonzero(dq_t) == dq_t.size and np.abs(dq_t).max() < 2.0 ** -32
    assert not np.round(dq_t.astype(np.float64) / 2.0 ** -32).any()   # what that quantum would keep


def test_bad_arguments_are_rejected_before_any_kernel():
    q, k, v, _ = make_inputs(0, 1, 7, 4, 2, 8)
    with pytest.raises((TypeError, ValueError), match="v"):
        cpu_ref.attention_forward_i8(q, k, v[:, :, :1], 0, 0.3)
    with pytest.raises((TypeError, ValueError)):
        cpu_ref.attention_forward_i8(q.astype(np.float32), k, v, 0, 0.3)
