"""The whole model's gradient (C reference, bf16 path) against a float64 PyTorch computation of
the same architecture (a reference outside the project's own code)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mlx_open1b.config import ModelConfig
from mlx_open1b.model import Model, ParamLayout, init_params
from mlx_open1b.torch_model import reference_grad

# Our program rounds every GEMM input to bf16 (relative error <= 2^-9 each): ~11 roundings on
# the forward path of a parameter's gradient and ~9 on the backward path. To first order the
# relative error of a gradient is bounded by the sum, 20 * 2^-9 ~= 0.039; as an l2 norm over a
# whole tensor the independent rounding errors partly cancel (measured 3e-4..5e-3 per tensor),
# so the bound below has a wide margin and still catches any wrong formula (a 10% error in one
# op's gradient shows up as >= 3% here, wrong pairings or masks as > 10%).
BOUND = 20 * 2.0 ** -9


@pytest.mark.parametrize("seed", [1, 2])
def test_gradient_matches_float64_torch(seed):
    cfg = ModelConfig(vocab_size=256, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8,
                      ffn_hidden=48, seq_len=32, window=8, global_every=2)
    params = init_params(cfg, seed)
    rng = np.random.default_rng(seed)
    windows = rng.integers(0, cfg.vocab_size, (2, cfg.seq_len + 1)).astype(np.uint32)
    loss, _, _, grads = Model(cfg).loss_and_grad(params, windows)
    ref_loss, ref = reference_grad(cfg, params, windows)
    assert abs(loss - ref_loss) <= 11 * 2.0 ** -9 * abs(ref_loss)
    g = grads.astype(np.float64)
    cos = g @ ref / (np.linalg.norm(g) * np.linalg.norm(ref))
    assert cos > 1 - BOUND ** 2
    for spec in ParamLayout(cfg):
        a, b = g[spec.offset:spec.offset + spec.size], ref[spec.offset:spec.offset + spec.size]
        rel = np.linalg.norm(a - b) / np.linalg.norm(b)
        assert rel <= BOUND, (spec.name, rel)
