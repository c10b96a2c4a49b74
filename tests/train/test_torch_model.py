"""The PyTorch implementation of the architecture (mlx_open1b.torch_model): the float64 gradient
reference and the float32 / bf16-autocast baseline. Not reproducible by design; these tests check
that it is the architecture we mean and that its gradient is right."""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mlx_open1b.config import ModelConfig, preset  # noqa: E402
from mlx_open1b.spec.arith import bf16_to_f32, f32_to_bf16  # noqa: E402
from mlx_open1b.torch_model import (TorchModel, TorchTrainer, attention, reference_grad,  # noqa: E402
                                    rmsnorm, rope, rope_tables, swiglu, visibility_mask, xent_zloss)

# small enough for finite differences; 3 layers: 0 local, 1 global (every 2nd), 2 global (last)
SMALL = ModelConfig(vocab_size=48, d_model=16, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8,
                    ffn_hidden=24, seq_len=12, window=4, global_every=2)


@pytest.fixture(autouse=True)
def _threads():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


def init_flat(cfg: ModelConfig, seed: int, sigma: float | None = None) -> np.ndarray:
    """bf16 bits of a truncated-normal init (gains: 1 + small noise when sigma is given)."""
    rng = np.random.default_rng(seed)
    parts = []
    for _, shape, _ in cfg.param_shapes():
        if len(shape) == 1:
            g = np.ones(shape) if sigma is None else 1.0 + 0.2 * rng.standard_normal(shape)
            parts.append(g.astype(np.float32).reshape(-1))
        else:
            s = cfg.init_sigma if sigma is None else sigma
            parts.append(np.clip(rng.standard_normal(int(np.prod(shape))) * s, -2 * s, 2 * s).astype(np.float32))
    return f32_to_bf16(np.concatenate(parts))


def windows(cfg: ModelConfig, B: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, (B, cfg.seq_len + 1), dtype=np.uint32)


def test_parameter_count_names_and_shapes():
    for cfg in (SMALL, preset("tiny").model, preset("small").model):
        m = TorchModel(cfg, torch.float64)
        named = dict(m.named_parameters())
        assert sum(p.numel() for p in m.parameters()) == cfg.n_params() == m.n_params
        assert set(named) == {n for n, _, _ in cfg.param_shapes()}
        for n, s, _ in cfg.param_shapes():
            assert tuple(named[n].shape) == s
    # the paper's preset, without allocating it
    big = TorchModel(preset("open1b").model, torch.float32, device="meta")
    assert sum(p.numel() for p in big.parameters()) == preset("open1b").model.n_params()


def test_init_loss_is_log_vocab():
    cfg = preset("tiny").model
    m = TorchModel(cfg, torch.float64).load_flat(init_flat(cfg, 0))
    with torch.no_grad():
        loss, ce, zl = m(windows(cfg, 2, 1))
    # logits have std ~ sigma * sqrt(d) = 0.23: ce ~ ln V + 0.03; z-loss ~ 1e-4 * (ln V)^2
    assert abs(float(ce) - math.log(cfg.vocab_size)) < 0.1
    assert float(zl) == pytest.approx(1e-4 * math.log(cfg.vocab_size) ** 2, rel=0.05)
    assert float(loss) == pytest.approx(float(ce) + float(zl), rel=1e-15)


def test_flat_round_trip_order():
    cfg = SMALL
    m = TorchModel(cfg, torch.float64)
    slices = m.param_slices()
    flat = init_flat(cfg, 3, sigma=0.1)
    # widening is exact: the loaded values are the bf16 values
    m.load_flat(flat)
    np.testing.assert_array_equal(m.flat_params(), bf16_to_f32(flat).astype(np.float64))
    named = dict(m.named_parameters())
    rng = np.random.default_rng(0)
    for name, shape, _ in cfg.param_shapes():
        sl = slices[name]
        k = int(rng.integers(sl.start, sl.stop))
        f2 = flat.copy()
        f2[k] = 0x4120                                   # bf16 10.0
        before = {n: p.detach().clone() for n, p in named.items()}
        m.load_flat(f2)
        for n, p in named.items():
            changed = torch.nonzero(p.detach() != before[n]).tolist()
            if n == name:
                assert changed == [list(np.unravel_index(k - sl.start, shape))], name
                assert float(p.detach().reshape(-1)[k - sl.start]) == 10.0
            else:
                assert not changed, (name, n)
        m.load_flat(flat)
    # flat_grad is the same canonical order
    for i, (name, shape, _) in enumerate(cfg.param_shapes()):
        named[name].grad = torch.full(shape, float(i + 1), dtype=torch.float64)
    g = m.flat_grad()
    for i, (name, _, _) in enumerate(cfg.param_shapes()):
        assert np.all(g[slices[name]] == i + 1), name


def test_gradient_matches_finite_differences():
    """Central differences of the float64 loss itself, one or two coordinates of every tensor:
    truncation O(h^2) and rounding O(1e-16 / h) are both far below the tolerance."""
    cfg = SMALL
    flat = init_flat(cfg, 5, sigma=0.3)
    w = windows(cfg, 2, 6)
    m = TorchModel(cfg, torch.float64)
    loss, grad = m.loss_and_grad(flat, w)
    x0 = bf16_to_f32(flat).astype(np.float64)
    rng = np.random.default_rng(7)
    h = 1e-5
    checked = 0
    with torch.no_grad():
        for name, sl in m.param_slices().items():
            g = grad[sl]
            # the largest-magnitude gradient entry and a random one (wte/lm_head: of a used row)
            picks = {sl.start + int(np.argmax(np.abs(g))), sl.start + int(rng.integers(0, g.size))}
            for k in picks:
                xp, xm = x0.copy(), x0.copy()
                xp[k] += h
                xm[k] -= h
                fp = float(m.load_flat(xp)(w)[0])
                fm = float(m.load_flat(xm)(w)[0])
                fd = (fp - fm) / (2 * h)
                assert fd == pytest.approx(grad[k], rel=1e-6, abs=1e-9), (name, k, fd, grad[k])
                checked += 1
    assert checked >= len(cfg.param_shapes())
    assert np.abs(grad).max() > 1e-3                    # not a vacuous check
    # reference_grad is the same computation
    l2, g2 = reference_grad(cfg, flat, w)
    assert l2 == loss and np.array_equal(g2, grad)


def test_ops_agree_with_the_contract_spec():
    """Each op, in float64, against CONTRACT.md §6's executable numpy spec (fp32 contract arithmetic)
    on the same bf16 inputs: the same definitions (pairing, grouping, eps, z-loss), to fp32 accuracy."""
    from mlx_open1b.spec import attention as sa, layers as sl, xent as sx
    rng = np.random.default_rng(4)
    t64 = lambda a: torch.from_numpy(np.asarray(a, np.float64))           # noqa: E731
    close = lambda a, b, tol=2e-6: np.testing.assert_allclose(np.asarray(a, np.float64), b.numpy(),  # noqa: E731
                                                              rtol=tol, atol=tol)
    x = rng.standard_normal((10, 16)).astype(np.float32)
    g = f32_to_bf16(1 + 0.3 * rng.standard_normal(16).astype(np.float32))
    close(sl.rmsnorm_forward(x, g, 1e-6)[0], rmsnorm(t64(x), t64(bf16_to_f32(g)), 1e-6))
    close(sl.rmsnorm_forward(x, None, 1e-6)[0], rmsnorm(t64(x), None, 1e-6))
    B, T, R, D = 2, 40, 3, 8
    xr = rng.standard_normal((B, T, R, D)).astype(np.float32)
    c32, s32 = sl.rope_tables(T, D, 500000.0)
    c64, s64 = rope_tables(T, D, 500000.0, torch.float64)
    close(c32, c64, 1e-5)
    close(s32, s64, 1e-5)
    close(sl.rope(xr, c32, s32), rope(t64(xr), c64, s64), 1e-5)
    h = (2 * rng.standard_normal((6, 10))).astype(np.float32)
    close(sl.swiglu_forward(h), swiglu(t64(h)))
    q, k, v = (f32_to_bf16(rng.standard_normal((1, 70, n, D)).astype(np.float32)) for n in (4, 2, 2))
    for win in (0, 5):
        o, _ = sa.attention_forward(q, k, v, win, np.float32(1 / math.sqrt(D)))
        close(o, attention(t64(bf16_to_f32(q)), t64(bf16_to_f32(k)), t64(bf16_to_f32(v)), win), 1e-5)
    hh, ww = f32_to_bf16(rng.standard_normal((5, 16)).astype(np.float32)), f32_to_bf16(
        rng.standard_normal((50, 16)).astype(np.float32))
    tg = rng.integers(0, 50, 5)
    loss, _, ce = sx.xent_forward(hh, ww, tg.astype(np.int32), np.float32(1e-4))
    z = t64(bf16_to_f32(hh)) @ t64(bf16_to_f32(ww)).T
    ce64, zl64 = xent_zloss(z, torch.from_numpy(tg), 1e-4)
    close(ce, ce64, 1e-5)
    close(loss, ce64 + zl64, 1e-5)


def test_attention_window_mask():
    rng = np.random.default_rng(0)
    B, T, H, G, D, W = 1, 16, 4, 2, 8, 4
    q, k, v = (torch.from_numpy(rng.standard_normal((B, T, n, D))) for n in (H, G, G))
    j = 3
    k2, v2 = k.clone(), v.clone()
    k2[:, j] += 5.0
    v2[:, j] -= 3.0
    for impl in ("sdpa", "explicit"):
        o, o2 = attention(q, k, v, W, impl), attention(q, k2, v2, W, impl)
        diff = (o - o2).abs().amax(dim=(0, 2, 3))        # (T,)
        for i in range(T):
            if j <= i and i - j < W:
                assert diff[i] > 1e-3, (impl, i)
            else:                                           # causal or outside the window: no effect
                assert diff[i] == 0, (impl, i)
        g, g2 = attention(q, k, v, 0, impl), attention(q, k2, v2, 0, impl)
        gdiff = (g - g2).abs().amax(dim=(0, 2, 3))
        assert all(gdiff[i] > 1e-3 for i in range(j, T)) and all(gdiff[i] == 0 for i in range(j))
    # fused and explicit agree; grouped heads read group h // (H/G)
    for win in (0, 1, W):
        a, b = attention(q, k, v, win, "sdpa"), attention(q, k, v, win, "explicit")
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    one = attention(q[:, :, 1:2], k[:, :, 0:1], v[:, :, 0:1], W, "explicit")   # head 1 → group 0
    assert torch.allclose(attention(q, k, v, W, "explicit")[:, :, 1:2], one, rtol=1e-12, atol=1e-12)
    m = visibility_mask(6, 2)
    assert m.tolist()[4] == [False, False, False, True, True, False]


def test_model_layer_windows():
    """Through the model: changing the token at position j changes layer 0's key/value at j only;
    a local layer 0's output for query i ignores it when i - j >= window, a global one does not."""
    w = windows(SMALL, 1, 2)
    w2 = w.copy()
    j = 2
    w2[0, j] = (w[0, j] + 1) % SMALL.vocab_size
    for global_every, expect_local in ((2, True), (1, False)):
        cfg = ModelConfig(**{**SMALL.__dict__, "global_every": global_every})
        assert (cfg.layer_window(0) == cfg.window) == expect_local
        m = TorchModel(cfg, torch.float64).load_flat(init_flat(cfg, 1, sigma=0.3))
        outs = []
        for ww in (w, w2):
            m.attn_trace = []
            m(ww)
            outs.append(m.attn_trace[0][0])                # layer 0, (T, H, D)
        m.attn_trace = None
        diff = (outs[0] - outs[1]).abs().amax(dim=(1, 2))
        for i in range(cfg.seq_len):
            if i < j:
                assert diff[i] == 0
            elif expect_local and i - j >= cfg.window:
                assert diff[i] == 0, i
            else:
                assert diff[i] > 0, i


def test_float32_and_bf16_autocast():
    cfg = preset("tiny").model
    flat = init_flat(cfg, 11)
    w = windows(cfg, 2, 12)
    l64, g64 = TorchModel(cfg, torch.float64).loss_and_grad(flat, w)
    l32, g32 = TorchModel(cfg, torch.float32).loss_and_grad(flat, w)
    assert l32 == pytest.approx(l64, rel=1e-6)
    assert np.linalg.norm(g32 - g64) <= 1e-4 * np.linalg.norm(g64)
    lbf, gbf = TorchModel(cfg, torch.float32, autocast_bf16=True).loss_and_grad(flat, w)
    assert np.isfinite(lbf) and np.all(np.isfinite(gbf))
    assert lbf == pytest.approx(l64, rel=1e-2)
    cos = gbf @ g64 / (np.linalg.norm(gbf) * np.linalg.norm(g64))
    assert cos > 0.95
    with pytest.raises(ValueError):
        TorchModel(cfg, torch.float64, autocast_bf16=True)


@pytest.mark.parametrize("autocast", [False, True])
def test_trainer_learns_and_decays_only_linear_layers(autocast):
    cfg = SMALL
    tr = TorchTrainer(cfg, init_flat(cfg, 0), autocast_bf16=autocast)
    decayed = {id(p) for p in tr.opt.param_groups[0]["params"]}
    named = dict(tr.model.named_parameters())
    assert tr.opt.param_groups[0]["weight_decay"] == 0.1 and tr.opt.param_groups[1]["weight_decay"] == 0.0
    assert tr.opt.defaults["betas"] == (0.9, 0.95) and tr.opt.defaults["eps"] == 1e-8
    for n, _, dec in cfg.param_shapes():
        assert (id(named[n]) in decayed) == dec, n
    batch = windows(cfg, 4, 3)
    res = tr.train_steps(iter([batch] * 40), 20, lr=lambda s: 3e-3 * min(1.0, (s + 1) / 5), microbatches=2)
    assert len(res.losses) == 20 and res.tokens == 20 * 2 * 4 * cfg.seq_len and res.tokens_per_s > 0
    assert res.losses[-1] < res.losses[0] - 0.5          # memorizes the repeated batch
    assert all(np.isfinite(res.grad_norms))
    # the recorded norm is pre-clip; the gradients the optimizer used were clipped to 1.0
    big = TorchTrainer(cfg, init_flat(cfg, 0, sigma=1.0), autocast_bf16=autocast)
    _, norm = big.step([batch], lr=0.0)
    used = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in big.model.parameters()]))
    assert norm > 1.0 and float(used) == pytest.approx(1.0, rel=1e-5)
