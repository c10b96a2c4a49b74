"""Run configurations and ledger forgeries shared by the training, audit and report tests.

micro_cfg: a two-layer micro model with two batch phases, spikes and evaluation (trains in about a
second per step on cpu_ref); gnmr_cfg: the same size in int8 with a GNMR controller sensitive enough
to act within a few steps; forge_records: a consistent forgery of ledger fields (re-chained)."""
from __future__ import annotations

from mlx_open1b.config import ModelConfig, RunConfig, TrainConfig
from mlx_open1b.gnmr import GNMRConfig
from mlx_open1b.ledger import canonical, canonical_dumps, read_records, record_hash
import json


def micro_cfg(**train):
    model = ModelConfig(vocab_size=4000, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                        ffn_hidden=48, seq_len=16, window=8, global_every=2)
    t = dict(seed=7, microbatch_seqs=2, phases=((0, 2), (200, 3)), total_tokens=4000, peak_lr=1e-2,
             warmup_tokens=64, checkpoint_every=2, eval_every=4, eval_windows=2,
             spike_threshold=2.0, spike_skip=2)
    t.update(train)
    return RunConfig(model, TrainConfig(**t), "micro")


MICRO = ModelConfig(vocab_size=4000, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                    ffn_hidden=48, seq_len=16, window=8, global_every=2)
# sensitive thresholds so that the controller acts within a few steps of a tiny run
SENSITIVE = GNMRConfig(alpha=1.02, alpha_init=1.02, warm=0.0, beta=1.02, max_o=2, lock=3, window=2)


def count_clip_copies(monkeypatch) -> list:
    """The ids of the clip's copies of a gradient still being hashed (HashStage.writable returning
    another array than it was given), appended as they are made."""
    from mlx_open1b.state_hashes import HashStage
    copies, real = [], HashStage.writable

    def writable(self, role, a, hashing, take=None):
        out = real(self, role, a, hashing, take)
        if out is not a:
            copies.append(id(out))
        return out
    monkeypatch.setattr(HashStage, "writable", writable)
    return copies


def gnmr_cfg(gnmr=SENSITIVE, **train):
    t = dict(seed=7, microbatch_seqs=2, phases=((0, 2),), total_tokens=4000, peak_lr=1e-2, warmup_tokens=64,
             checkpoint_every=2, eval_every=0, eval_windows=2)
    t.update(train)
    return RunConfig(MICRO, TrainConfig(**t), "micro", precision="int8", gnmr=gnmr)


def forge_records(run, edits: dict) -> str:
    """Apply edits {step: fn(record)} to the ledger and re-chain every record from the genesis;
    returns the new run hash."""
    prev = json.loads((run / "run.json").read_text())["genesis"]
    lines = []
    for rec in read_records(run / "ledger.jsonl"):
        rec = {k: v for k, v in rec.items() if k not in ("prev", "hash")}
        if rec["step"] in edits:
            edits[rec["step"]](rec)
        rec = canonical(rec)
        rec["prev"] = prev
        rec["hash"] = prev = record_hash(rec)
        lines.append(canonical_dumps(rec) + "\n")
    (run / "ledger.jsonl").write_text("".join(lines))
    return prev
