"""Presets and schedules: the open1b preset is exactly the paper's Tables 3 and 4."""
import json
import math

import pytest

from mlx_open1b.config import ConfigError, ModelConfig, RunConfig, TrainConfig, preset, steps_for_tokens
from mlx_open1b.hostmath import cos_pi_f64


def test_open1b_matches_the_paper():
    p = preset("open1b").check()
    m, t = p.model, p.train
    assert (m.n_layers, m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.ffn_hidden, m.vocab_size,
            m.seq_len, m.window) == (24, 2048, 16, 4, 128, 5632, 128_256, 4096, 512)
    assert round(m.n_params() / 1e9, 2) == 1.61 and round(m.n_nonembedding() / 1e9, 2) == 1.08
    # Table 4: 3,145,728 / 4,718,592 / 9,437,184 tokens per step by consumed tokens
    assert t.tokens_per_step(m, 0)[1] == 3_145_728
    assert t.tokens_per_step(m, 4_000_000_000)[1] == 4_718_592
    assert t.tokens_per_step(m, 360_000_000_000)[1] == 9_437_184
    assert steps_for_tokens(t, m, 400_000_000_000) == 80_957          # §3.4: 80,957 steps
    assert t.lr_at(667 * 3_145_728) == 4.5e-4
    assert t.lr_at(400_000_000_000) == pytest.approx(4.5e-5, rel=1e-12)
    assert t.lr_at(3_145_728) == pytest.approx(4.5e-4 / 667, rel=1e-12)
    # every 5th layer and the last are global
    assert [l for l in range(24) if m.is_global(l)] == [4, 9, 14, 19, 23]


def test_cosine_is_host_arithmetic():
    for i in range(101):
        assert abs(cos_pi_f64(i / 100) - math.cos(math.pi * i / 100)) < 1e-15
    with pytest.raises(ValueError):
        cos_pi_f64(1.5)


def test_config_round_trips_and_rejects_bad_values():
    p = preset("tiny")
    assert RunConfig.from_json(json.loads(p.dumps())) == p
    with pytest.raises(ConfigError, match="window"):
        RunConfig(ModelConfig(seq_len=16, window=32), TrainConfig()).check()
    with pytest.raises(ConfigError, match="n_kv_heads"):
        RunConfig(ModelConfig(n_heads=4, n_kv_heads=3), TrainConfig()).check()
    with pytest.raises(ConfigError, match="phases"):
        RunConfig(ModelConfig(), TrainConfig(phases=((5, 2),))).check()
    with pytest.raises(ConfigError, match="unknown preset"):
        preset("huge")


def test_config_is_written_in_the_oldest_json_version_that_expresses_it():
    """The config JSON is hashed into the genesis: a config expressible before a key was added is
    written without it (its run hash never changes), and each version reads back to the config."""
    import dataclasses

    from mlx_open1b.config import config_version
    from mlx_open1b.gnmr import GNMRConfig
    base = preset("tiny")
    old_int8 = dataclasses.replace(base, precision="int8", attention_pv="fp32")
    by_version = {1: [base, old_int8], 2: [dataclasses.replace(old_int8, gnmr=GNMRConfig())],
                  3: [dataclasses.replace(base, precision="int8"),
                      dataclasses.replace(base, precision="int4", gnmr=GNMRConfig())]}
    assert set(base.to_json()) == {"model", "train", "preset", "precision"}
    for version, cfgs in by_version.items():
        for cfg in cfgs:
            j = json.loads(json.dumps(cfg.check().to_json()))
            assert config_version(j) == version, cfg
            assert RunConfig.from_json(j) == cfg
