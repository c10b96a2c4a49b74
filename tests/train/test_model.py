"""The model program (mlx_open1b/model.py): parameter layout and init, determinism, and
correctness against a float64 numpy reimplementation of the same architecture.

The float64 model below (`forward64`) is written from the architecture alone — plain numpy, no
contract ops — and can optionally round to bf16 at exactly the points where the model program
does (`emulate=True`). Tolerances are argued next to each check.
"""
from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest

from helpers import assert_bits_equal
from mlx_open1b import cpu_ref
from mlx_open1b.config import ModelConfig, preset
from mlx_open1b.contract import STREAM_INIT
from mlx_open1b.hostmath import f32
from mlx_open1b.model import BF16_ONE, Model, ParamLayout, init_params, views
from mlx_open1b.spec import arith

# n_layers=2 with global_every=5: layer 0 is local (window 4), layer 1 (the last) is global.
CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                  ffn_hidden=48, seq_len=16, window=4)
U_BF16 = 2.0 ** -9        # unit roundoff of bf16 (8 significant bits, round to nearest)


def windows_for(cfg: ModelConfig, B: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, cfg.vocab_size, (B, cfg.seq_len + 1)).astype(np.uint32)


def spread_params(cfg: ModelConfig, seed: int = 0) -> np.ndarray:
    """Parameters away from init (matrices sigma 0.2, gains 1 +- 0.3) so that attention is far
    from uniform, the SwiGLU is nonlinear and every gain matters."""
    rng = np.random.default_rng(seed)
    layout = ParamLayout(cfg)
    x = np.empty(layout.n_params, np.float32)
    for t in layout:
        scale, mean = (0.3, 1.0) if len(t.shape) == 1 else (0.2, 0.0)
        x[t.offset:t.offset + t.size] = mean + scale * rng.standard_normal(t.size)
    return cpu_ref.f32_to_bf16(x)


def widen64(params: np.ndarray) -> np.ndarray:
    return cpu_ref.bf16_to_f32(params).astype(np.float64)


# ------------------------------------------------------------------------ float64 reference
class Rounding:
    """What forward64 does at the points where the model program rounds to bf16 (GEMM inputs).
    'none': nothing (the exact float64 model). 'round': round to bf16 through fp32, as the
    program does. 'record' rounds and remembers each residual r = bf16(x) - x; 'replay' adds the
    remembered residuals instead of rounding: x + r is a smooth function of the parameters whose
    gradient at the recorded point is the straight-through gradient the program computes."""

    def __init__(self, mode: str = "none"):
        self.mode, self.residuals, self.i = mode, [], 0

    def __call__(self, x):
        if self.mode == "none":
            return x
        if self.mode == "replay":
            self.i += 1
            return x + self.residuals[self.i - 1]
        r = arith.round_bf16(x.astype(np.float32)).astype(np.float64)
        if self.mode == "record":
            self.residuals.append(r - x)
        return r


def forward64(cfg: ModelConfig, theta: np.ndarray, windows: np.ndarray, emulate: bool = False,
              rb: Rounding | None = None):
    """The architecture in float64 numpy. theta: flat float64 parameters. emulate: round to bf16
    where the model program does (rb = Rounding('round')); rb: see Rounding.
    -> (mean loss, mean ce, per-window mean ce (B,), max_v sum_c |hn_c w_vc| per row (B, T))."""
    rb = rb or Rounding("round" if emulate else "none")
    rb.i = 0
    P = views(theta, ParamLayout(cfg))
    B, T = windows.shape[0], cfg.seq_len
    H, G, D, eps = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, f32(cfg.norm_eps)
    inp, tgt = windows[:, :-1].astype(np.int64), windows[:, 1:].astype(np.int64)

    def rms(x, g=None):
        y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
        return y if g is None else y * g

    inv = cfg.rope_theta ** (-np.arange(0, D, 2) / D)           # (D/2,)
    ang = np.arange(T)[:, None] * inv[None, :]                   # (T, D/2)
    cos, sin = np.cos(ang)[None, :, None, :], np.sin(ang)[None, :, None, :]

    def rope(x):                                                 # (B, T, R, D), rotate-half pairs
        x1, x2 = x[..., :D // 2], x[..., D // 2:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    scale = f32(1.0 / math.sqrt(D))
    t_idx = np.arange(T)
    h = rms(P["wte"][inp], P["emb_norm"])                        # (B, T, d)
    for l in range(cfg.n_layers):
        p = f"layers.{l}."
        W = cfg.layer_window(l)
        a = rb(rms(h, P[p + "attn_norm"]))
        q = rb(rope(rms((a @ P[p + "wq"].T).reshape(B, T, H, D))))
        k = rb(rope(rms((a @ P[p + "wk"].T).reshape(B, T, G, D))))
        v = rb((a @ P[p + "wv"].T).reshape(B, T, G, D))
        k, v = np.repeat(k, H // G, axis=2), np.repeat(v, H // G, axis=2)   # head h reads group h // (H/G)
        s = np.einsum("bihd,bjhd->bhij", q, k) * scale
        vis = (t_idx[None, :] <= t_idx[:, None]) & ((W == 0) | (t_idx[:, None] - t_idx[None, :] < W))
        s = np.where(vis, s, -np.inf)
        pr = np.exp(s - s.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        o = np.einsum("bhij,bjhd->bihd", pr, v).reshape(B, T, H * D)
        h = h + rb(o) @ P[p + "wo"].T
        f = rb(rms(h, P[p + "ffn_norm"]))
        gate, up = np.split(f @ P[p + "w_gate_up"].T, 2, axis=-1)
        h = h + rb(gate / (1 + np.exp(-gate)) * up) @ P[p + "w_down"].T
    hn = rb(rms(h, P["final_norm"]))                                  # (B, T, d)
    z = hn @ P["lm_head"].T                                           # (B, T, V)
    zmax = z.max(-1, keepdims=True)
    lse = (zmax + np.log(np.exp(z - zmax).sum(-1, keepdims=True)))[..., 0]
    ce = lse - np.take_along_axis(z, tgt[..., None], -1)[..., 0]
    loss = ce + f32(cfg.z_loss) * lse * lse
    zabs = (np.abs(hn) @ np.abs(P["lm_head"]).T).max(-1)             # (B, T) max_v sum_c |hn_c w_vc|
    return loss.mean(), ce.mean(), ce.mean(axis=1), zabs


def directional_fd(cfg, theta, windows, u, eps=1e-4, rb=None):
    """Central difference of the float64 loss along u: error O(eps^2 L''') + O(1e-16 / eps)."""
    return (forward64(cfg, theta + eps * u, windows, rb=rb)[0]
            - forward64(cfg, theta - eps * u, windows, rb=rb)[0]) / (2 * eps)


# ------------------------------------------------------------------------------- parameters
def test_layout_is_the_canonical_order_without_gaps():
    layout = ParamLayout(CFG)
    assert [(t.name, t.shape, t.decayed) for t in layout] == [tuple(x) for x in CFG.param_shapes()]
    off = 0
    for t in layout:
        assert t.offset == off
        off += t.size
    assert off == layout.n_params == CFG.n_params()
    buf = np.arange(layout.n_params, dtype=np.float32)
    v = views(buf, layout)
    assert v["layers.1.wq"].shape == (CFG.n_heads * CFG.head_dim, CFG.d_model)
    assert v["layers.1.wq"][0, 0] == layout["layers.1.wq"].offset
    v["final_norm"][3] = -1                                     # views, not copies
    assert buf[layout["final_norm"].offset + 3] == -1
    lo, hi = layout.qkv_range(0)
    assert (lo, hi) == (layout["layers.0.wq"].offset, layout["layers.0.wo"].offset)


def test_init_element_is_a_function_of_seed_and_offset_only():
    a = init_params(CFG, 7)
    assert_bits_equal(a, init_params(CFG, 7), "init twice")
    assert (a != init_params(CFG, 8)).mean() > 0.9
    # one more layer: the same tensors up to the end of layer 1 sit at the same offsets
    deeper = ModelConfig(**{**CFG.__dict__, "n_layers": 3})
    prefix = ParamLayout(CFG)["final_norm"].offset
    assert ParamLayout(deeper)["layers.2.attn_norm"].offset == prefix
    assert_bits_equal(init_params(deeper, 7)[:prefix], a[:prefix], "shared prefix")
    # any single element alone
    lay = ParamLayout(CFG)
    for name, j in (("wte", 5), ("layers.1.w_down", 100), ("lm_head", 2047)):
        i = lay[name].offset + j
        one = cpu_ref.f32_to_bf16(cpu_ref.trunc_normal(7, STREAM_INIT, i, 1, CFG.init_sigma))
        assert a[i] == one[0], name


def test_init_gains_are_one_and_matrices_truncated_normal():
    layout = ParamLayout(CFG)
    v = views(init_params(CFG, 3), layout)
    mats = []
    for t in layout:
        if len(t.shape) == 1:
            assert (v[t.name] == BF16_ONE).all(), t.name
        else:
            mats.append(cpu_ref.bf16_to_f32(v[t.name]).ravel())
    x = np.concatenate(mats).astype(np.float64)
    # N(0, s^2) cut at +-2s has std s * sqrt(1 - 4 phi(2) / (2 Phi(2) - 1)) = 0.8796 s; with
    # ~25k samples the sample std is within 1% (4 standard errors), the mean within 4 s/sqrt(n)
    want = 0.02 * 0.87962566
    assert abs(x.std() / want - 1) < 0.01, x.std()
    assert abs(x.mean()) < 4 * 0.02 / math.sqrt(x.size)
    assert np.abs(x).max() <= 0.04 * (1 + 2 ** -8)              # the cut, after bf16 rounding


# ------------------------------------------------------------------------------ determinism
def _grads_bits(model, params, windows, threads):
    with cpu_ref.settings(threads=threads):
        loss, ce, zl, g = model.loss_and_grad(params, windows)
    return np.float32([loss, ce, zl]), g


@pytest.mark.parametrize("cfg", [CFG, preset("tiny").model], ids=["test-cfg", "tiny-preset"])
def test_loss_and_grads_identical_across_calls_and_threads(cfg):
    model = Model(cfg)
    params = spread_params(cfg, 1) if cfg is CFG else init_params(cfg, 42)
    w = windows_for(cfg, 2, seed=5)
    s1, g1 = _grads_bits(model, params, w, 1)
    s2, g2 = _grads_bits(model, params, w, 2)
    s3, g3 = _grads_bits(model, params, w, 2)
    assert_bits_equal(s1, s2, "loss/ce/zl, 1 vs 2 threads")
    assert_bits_equal(g1, g2, "grads, 1 vs 2 threads")
    assert_bits_equal(s2, s3, "loss/ce/zl, repeated")
    assert_bits_equal(g2, g3, "grads, repeated")
    assert np.isfinite(g1).all()
    gv = views(g1, model.layout)
    for t in model.layout:                                      # every tensor receives a gradient
        assert np.abs(gv[t.name]).max() > 0, t.name


def test_pinned_bits():
    """The init, loss and gradient bits of one fixed case, also with the portable SIMD level and
    the straightforward GEMM. A change here is a change of the model program's or the contract's
    arithmetic (the ledgers of earlier runs stop replaying): CONTRACT_VERSION goes up with it."""
    model, params = Model(CFG), init_params(CFG, 123)
    w = windows_for(CFG, 2, seed=9)
    assert hashlib.sha256(params.tobytes()).hexdigest().startswith("b48ec2126cddbc83f7d0a2a24b126f97")
    for kw in ({}, {"simd": 0, "gemm_fast": False, "threads": 2}):
        with cpu_ref.settings(**kw):
            loss, ce, zl, g = model.loss_and_grad(params, w)
        assert np.float32([loss, ce, zl]).view(np.uint32).tolist() == [1082482761, 1082479118, 988000534], kw
        assert hashlib.sha256(g.tobytes()).hexdigest().startswith("9bd7f2fdc03b5d4bf866e16ba94efdde"), kw


# ------------------------------------------------------------------------ vs float64 model
def test_loss_at_init_is_log_vocab():
    model = Model(CFG)
    loss, ce, zl, _ = model.forward(init_params(CFG, 0), windows_for(CFG, 4))
    # logits at init have std ~ sigma_head * sqrt(d) * 0.88 ~ 0.1: ce = ln V + O(0.01)
    assert abs(ce - math.log(CFG.vocab_size)) < 0.05
    assert abs(zl - f32(CFG.z_loss) * math.log(CFG.vocab_size) ** 2) < 1e-4
    assert abs(loss - (ce + zl)) < 1e-6


@pytest.mark.parametrize("params_kind", ["init", "spread"])
def test_loss_matches_float64(params_kind):
    params = init_params(CFG, 0) if params_kind == "init" else spread_params(CFG, 2)
    w = windows_for(CFG, 3, seed=1)
    loss, ce, _, _ = Model(CFG).forward(params, w)
    theta = widen64(params)
    # (1) float64 with bf16 rounding at the same points: what remains is fp32 arithmetic
    # (dot products of <= 64 terms: <= 64 u = 4e-6 relative each, in practice ~sqrt(64) u),
    # the contract's exp/log/rsqrt/sigmoid (<= 2.7 ulp), RoPE tables (<= 9e-8 absolute), and
    # the rare element whose fp32 and float64 values round to different bf16 neighbours. 1e-5
    # relative on the loss covers all of them with a wide margin.
    e_loss, e_ce, _, _ = forward64(CFG, theta, w, emulate=True)
    assert abs(loss - e_loss) <= 1e-5 * e_loss, (loss, e_loss)
    assert abs(ce - e_ce) <= 1e-5 * e_ce
    # (2) exact float64 (no bf16 rounding): each GEMM input rounding moves a value by <= 2^-9
    # relative. Along a path embedding -> logits there are 2 roundings per block's branch input
    # (a or o, f or s) plus q, k, v and the final hn: about 5 per block + 1 = 11 here. To first
    # order each logit z_v = hn . w_v moves by <= 11 * 2^-9 * sum_c |hn_c w_vc| (assuming the
    # blocks do not amplify relative errors, which the RMSNorms keep in check), and
    # |d loss_row / d z| has l1 norm <= 2 (softmax - onehot), so
    # |d loss| <= 2 * 11 * 2^-9 * (the mean over rows of max_v sum_c |hn_c w_vc|).
    x_loss, _, _, zabs = forward64(CFG, theta, w)
    bound = 2 * (5 * CFG.n_layers + 1) * U_BF16 * zabs.mean()
    assert abs(loss - x_loss) <= bound, (loss, x_loss, bound)
    _record("loss", params_kind, emulated=abs(loss - e_loss) / e_loss, exact=abs(loss - x_loss),
            exact_bound=bound)


@pytest.mark.parametrize("params_kind", ["init", "spread"])
def test_gradient_matches_float64_directional_derivatives(params_kind):
    """For every tensor, one random direction u supported on it (and one over all parameters):
    our g.u against central differences of two float64 losses.

    (1) The exact float64 model. Our gradient is that of the bf16-rounded program with
    straight-through roundings. Each gradient element picks up, along its longest path, ~11
    forward roundings (see the loss test) and one rounding of each gradient entering a GEMM (the
    xent dz, then per block dh twice, dgu, dqkv: 4 per block): with 2 blocks about 20 relative
    perturbations of <= 2^-9, so each element's relative error is <= 20 * 2^-9 ~ 4% to first
    order, hence |g.u - fd| <= 20 * 2^-9 * sum_i |g_i u_i|.
    (2) The straight-through float64 model (Rounding 'replay': the forward's bf16 residuals
    frozen at this point), whose gradient is what the program computes except for the backward's
    own roundings: 4 per block + the dz, 9 * 2^-9 ~ 1.8%.
    The float64 central difference's own error is ~1e-9 (test_float64_finite_differences_are_converged)."""
    cfg = ModelConfig(**{**CFG.__dict__, "z_loss": 0.01})      # a z-term large enough to test
    params = init_params(cfg, 0) if params_kind == "init" else spread_params(cfg, 3)
    w = windows_for(cfg, 2, seed=4)
    model = Model(cfg)
    _, _, _, g = model.loss_and_grad(params, w)
    g = g.astype(np.float64)
    theta = widen64(params)
    ste = Rounding("record")
    forward64(cfg, theta, w, rb=ste)
    ste.mode = "replay"
    rng = np.random.default_rng(6)
    tol_exact = (4 * cfg.n_layers + 1 + 5 * cfg.n_layers + 1) * U_BF16
    tol_ste = (4 * cfg.n_layers + 1) * U_BF16
    worst_exact = worst_ste = 0.0
    directions = [(t.name, t.offset, t.size) for t in model.layout] + [("all", 0, model.n_params)]
    for name, off, n in directions:
        u = np.zeros(model.n_params)
        u[off:off + n] = rng.standard_normal(n)
        u /= np.linalg.norm(u)
        ours, scale = g @ u, np.abs(g * u).sum()
        fd_exact, fd_ste = directional_fd(cfg, theta, w, u), directional_fd(cfg, theta, w, u, rb=ste)
        assert abs(ours - fd_exact) <= tol_exact * scale + 1e-9, (name, ours, fd_exact, scale)
        assert abs(ours - fd_ste) <= tol_ste * scale + 1e-9, (name, ours, fd_ste, scale)
        worst_exact = max(worst_exact, abs(ours - fd_exact) / scale)
        worst_ste = max(worst_ste, abs(ours - fd_ste) / scale)
    _record("grad", params_kind, worst_exact=worst_exact, tol_exact=tol_exact, worst_ste=worst_ste,
            tol_ste=tol_ste)


def test_float64_finite_differences_are_converged():
    """The reference's own consistency: the central difference at eps and eps/2 agree (the
    float64 forward is smooth and the step is resolved), and it is linear in the direction."""
    params, w = spread_params(CFG, 5), windows_for(CFG, 2, seed=7)
    theta = widen64(params)
    rng = np.random.default_rng(8)
    u1, u2 = (rng.standard_normal(theta.size) for _ in range(2))
    u1, u2 = u1 / np.linalg.norm(u1), u2 / np.linalg.norm(u2)
    d1, d1h = directional_fd(CFG, theta, w, u1), directional_fd(CFG, theta, w, u1, eps=5e-5)
    d2 = directional_fd(CFG, theta, w, u2)
    d12 = directional_fd(CFG, theta, w, (u1 + u2))
    assert abs(d1 - d1h) <= 1e-8 * max(1.0, abs(d1)), (d1, d1h)
    assert abs(d12 - (d1 + d2)) <= 1e-7 * max(1.0, abs(d12)), (d12, d1 + d2)


def test_eval_loss_per_window_and_independent_of_batching():
    model, params = Model(CFG), spread_params(CFG, 9)
    w = windows_for(CFG, 5, seed=10)
    ce_all = model.eval_loss(params, w)
    assert ce_all.shape == (5,) and ce_all.dtype == np.float32
    assert_bits_equal(ce_all, model.eval_loss(params, w, batch=2), "batch=2 vs all")
    assert_bits_equal(ce_all[3:4], model.eval_loss(params, w[3:4]), "one window alone")
    _, _, ce64, _ = forward64(CFG, widen64(params), w, emulate=True)
    assert np.allclose(ce_all, ce64, rtol=1e-5, atol=0)          # as in test_loss_matches_float64
    _, ce, _, _ = model.forward(params, w)                       # the same rows, another fold order
    assert abs(ce - float(np.mean(ce_all.astype(np.float64)))) < 1e-5 * ce


def test_a_few_sgd_steps_reduce_the_loss():
    model, params = Model(CFG), init_params(CFG, 11)
    w = windows_for(CFG, 4, seed=12)
    losses = []
    for _ in range(6):
        loss, _, _, g = model.loss_and_grad(params, w)
        losses.append(loss)
        params = cpu_ref.f32_to_bf16(cpu_ref.bf16_to_f32(params) - np.float32(0.5) * g)
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < losses[0] - 0.1, losses


# -------------------------------------------------------------------------------- bad input
def test_bad_inputs_are_named():
    model, params = Model(CFG), init_params(CFG, 0)
    w = windows_for(CFG, 2)
    with pytest.raises(ValueError, match="windows: expected dtype uint32"):
        model.forward(params, w.astype(np.int64))
    with pytest.raises(ValueError, match=r"windows: expected shape \(B, 17\)"):
        model.forward(params, w[:, :-1].copy())
    with pytest.raises(ValueError, match=r"windows: expected shape"):
        model.forward(params, w[0])
    with pytest.raises(ValueError, match=r"windows: expected shape"):
        model.forward(params, w[:0])
    bad = w.copy()
    bad[1, 3] = CFG.vocab_size
    with pytest.raises(ValueError, match=r"windows: token id 64 at \[1, 3\] is outside the vocabulary"):
        model.loss_and_grad(params, bad)
    with pytest.raises(ValueError, match="windows: expected a numpy array"):
        model.eval_loss(params, w.tolist())
    with pytest.raises(ValueError, match="params: expected dtype uint16"):
        model.forward(params.astype(np.float32), w)
    with pytest.raises(ValueError, match=r"params: expected shape \(\d+,\)"):
        model.forward(params[:-1], w)
    with pytest.raises(ValueError, match="cache: expected the Cache"):
        model.backward(params, None)
    with pytest.raises(ValueError, match="batch: expected a positive"):
        model.eval_loss(params, w, batch=0)
    with pytest.raises(KeyError, match="no parameter tensor named 'wqkv'"):
        model.layout["wqkv"]
    with pytest.raises(ValueError, match="model.window"):
        Model(ModelConfig(**{**CFG.__dict__, "window": 99}))


# Numbers for the report: `pytest -s tests/train/test_model.py` prints them.
def _record(kind, params_kind, **numbers):
    print(f"\n[{kind}/{params_kind}] " + ", ".join(f"{k}={v:.3g}" for k, v in numbers.items()))
