"""Initialization by element range: any range [lo, hi) of init_params is the same bits as that
slice of the whole buffer (element i is a pure function of (seed, i)), so each worker can
initialize only what it owns. Compared as uint16 bits."""
import numpy as np
import pytest

from mlx_open1b.config import ModelConfig
from mlx_open1b.model import ParamLayout, init_params

CFG = ModelConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_hidden=48,
                  seq_len=16, window=8, global_every=2)


@pytest.fixture(scope="module")
def full():
    return init_params(CFG, 11)


def _cuts(P):
    lay = ParamLayout(CFG)
    rng = np.random.default_rng(5)
    norms = [t for t in lay if len(t.shape) == 1]
    return [
        [0, P],                                                     # one range
        [0, 1, 2, 3, P - 1, P],                                     # single elements at both ends
        sorted({0, P, *rng.integers(0, P, 9).tolist()}),            # random cuts, mid-tensor
        [0, norms[0].offset + 1, norms[0].offset + norms[0].size - 1, P],   # inside a norm gain
        [0, 0, P // 3, P // 3, P],                                   # empty ranges
    ]


def test_ranges_are_slices_of_the_whole(full):
    P = ParamLayout(CFG).n_params
    assert full.shape == (P,)
    for cuts in _cuts(P):
        pieces = [init_params(CFG, 11, lo=a, hi=b) for a, b in zip(cuts, cuts[1:])]
        assert all(p.dtype == np.uint16 for p in pieces)
        assert np.array_equal(np.concatenate(pieces), full), cuts


def test_every_worker_count_shares_the_same_bits(full):
    """Near-equal element ranges for 1-5 workers, as a run's owners hold them."""
    P = full.size
    for W in range(1, 6):
        got = np.concatenate([init_params(CFG, 11, lo=r * P // W, hi=(r + 1) * P // W) for r in range(W)])
        assert got.tobytes() == full.tobytes(), W


def test_seed_and_bad_ranges(full):
    assert not np.array_equal(init_params(CFG, 12, lo=0, hi=1000), full[:1000])
    P = full.size
    for lo, hi in ((-1, 5), (5, 4), (0, P + 1)):
        with pytest.raises(ValueError, match=rf"range \[{lo}, {hi}\) is not inside the {P} parameters"):
            init_params(CFG, 11, lo=lo, hi=hi)
