"""The GNMR experiment command: four arms on the same tokens (low-cost path int4 or int6),
the summary's numbers are the ledgers', the plot is valid SVG."""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET

from click.testing import CliRunner

from mlx_open1b.cli.main import cli
from mlx_open1b.config import ModelConfig, RunConfig, TrainConfig
from mlx_open1b.gnmr import GNMRConfig
import pytest

from mlx_open1b.gnmr_experiment import ARMS, arms_for, run_experiment, table

from data_helpers import MICRO_MIX, make_corpus

MICRO = ModelConfig(vocab_size=4000, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                    ffn_hidden=48, seq_len=16, window=8, global_every=2)


@pytest.mark.parametrize("low", ["int4", "int6"])
def test_experiment_arms_summary_and_plot(tmp_path, low):
    corpus = tmp_path / "corpus"
    make_corpus(corpus, MICRO_MIX)
    base = RunConfig(MICRO, TrainConfig(seed=3, microbatch_seqs=2, phases=((0, 1),), total_tokens=4000,
                                        peak_lr=1e-2, warmup_tokens=64, checkpoint_every=3, eval_every=3,
                                        eval_windows=2), "micro")
    g = GNMRConfig(alpha=1.02, alpha_init=1.02, warm=0.0, beta=1.02, max_o=2, lock=2, window=2)
    kw = {} if low == "int4" else {"low": low}          # int4: the default
    arms = arms_for(low)
    assert arms == (low, f"gnmr-{low}-int8", "int8", "bf16") and (low != "int4" or arms == ARMS)
    s = run_experiment(tmp_path / "exp", base, corpus, 6, g, log=lambda m: None, **kw)
    assert list(s["arms"]) == list(arms) and s["low"] == low
    for arm in arms:
        recs = [json.loads(l) for l in (tmp_path / "exp" / arm / "ledger.jsonl").read_text().splitlines()]
        assert len(recs) == 6 and s["arms"][arm]["run_hash"] == recs[-1]["hash"]
        assert s["arms"][arm]["heldout_ce"] == [r for r in recs if "eval" in r][-1]["eval"]["mixture"]
        cfg = json.loads((tmp_path / "exp" / arm / "run.json").read_text())["config"]
        assert cfg["precision"] == {low: low, f"gnmr-{low}-int8": low, "int8": "int8", "bf16": "bf16"}[arm]
    # every arm saw the same tokens
    batches = {arm: [json.loads(l)["hashes"]["batch"] for l in (tmp_path / "exp" / arm / "ledger.jsonl").open()]
               for arm in arms}
    assert len({tuple(b) for b in batches.values()}) == 1
    gs = s["arms"][f"gnmr-{low}-int8"]
    recs = [json.loads(l) for l in (tmp_path / "exp" / f"gnmr-{low}-int8" / "ledger.jsonl").open()]
    active = [len(r["gnmr"]["active"]) for r in recs]
    assert gs["promotion_ratio"] == sum(active) / (6 * 8) and gs["hit_maxo_rate"] == sum(a == 2 for a in active) / 6
    assert sum(active) > 0
    ET.fromstring((tmp_path / "exp" / "curves.svg").read_text())          # well-formed SVG
    assert f"gnmr-{low}-int8" in table(s)
    # a second call resumes every arm (nothing to do) and gives the same summary
    s2 = run_experiment(tmp_path / "exp", base, corpus, 6, g, log=lambda m: None, **kw)
    assert {a: v["run_hash"] for a, v in s2["arms"].items()} == {a: v["run_hash"] for a, v in s["arms"].items()}


def test_cli_rejects_unknown_arms(tmp_path):
    r = CliRunner().invoke(cli, ["gnmr", "experiment", "--arms", "int4,fp8", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "fp8" in r.output
    r = CliRunner().invoke(cli, ["gnmr", "experiment", "--low", "int6", "--arms", "int6,gnmr-int4-int8",
                                 "--out", str(tmp_path)])
    assert r.exit_code == 2 and "gnmr-int4-int8" in r.output and "gnmr-int6-int8" in r.output, r.output
    r = CliRunner().invoke(cli, ["gnmr", "experiment", "--low", "int8", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "--low" in r.output
    r = CliRunner().invoke(cli, ["gnmr", "experiment", "--gnmr", "maxO=x", "--out", str(tmp_path)])
    assert r.exit_code == 2 and ("maxO" in r.output or "max_o" in r.output), r.output
