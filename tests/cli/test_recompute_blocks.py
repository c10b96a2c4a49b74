"""`open1b train --recompute-blocks`: how the process computes, never part of the run — the same
run.json, ledger and checkpoints as without it, and resumable either way."""
from __future__ import annotations

from click.testing import CliRunner

from data_helpers import make_corpus
from mlx_open1b.cli.main import cli
from mlx_open1b.train import Trainer

MICRO = ('preset = "tiny"\n[model]\nvocab_size = 4000\nd_model = 32\nn_layers = 2\nn_heads = 4\n'
         'n_kv_heads = 2\nhead_dim = 8\nffn_hidden = 48\nseq_len = 16\nwindow = 8\nglobal_every = 2\n'
         '[train]\nseed = 7\nmicrobatch_seqs = 2\nphases = [[0, 2]]\ntotal_tokens = 4000\n'
         'warmup_tokens = 64\ncheckpoint_every = 2\neval_every = 0\n')


def test_recompute_blocks_writes_the_same_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "data"
    make_corpus(data, {"a": (1.0, 20, 40)})
    f = tmp_path / "micro.toml"
    f.write_text(MICRO)
    r = CliRunner()
    seen = []
    build = Trainer._build_model

    def spy(self):
        build(self)
        seen.append(self.model.recompute_blocks)

    monkeypatch.setattr(Trainer, "_build_model", spy)
    common = ["--config", str(f), "--data", str(data), "--backend", "cpu_ref", "--skip-selftest", "--threads", "1"]
    a = r.invoke(cli, ["train", "--out", "a", "--steps", "3", *common])
    b = r.invoke(cli, ["train", "--out", "b", "--steps", "2", "--recompute-blocks", *common])
    assert a.exit_code == 0 and b.exit_code == 0, a.output + b.output
    b = r.invoke(cli, ["train", "--out", "b", "--resume", "--steps", "3", "--threads", "1", "--skip-selftest"])
    assert b.exit_code == 0, b.output
    assert seen == [False, True, False]         # the flag reaches the model, and only where it is given
    for name in ("run.json", "ledger.jsonl", "ckpt-00000002/state.safetensors", "ckpt-00000002/meta.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
