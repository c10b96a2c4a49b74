"""Long runs stay flat: a tiny model trained for 2,000 steps (checkpoints and held-out evaluation on
their usual schedule, every 100 steps here) while this process's resident memory and open file
descriptors are read every 100 steps. After the first 200 steps (caches, the first checkpoint, the
evaluation probes) neither may grow: resident memory by more than --rss-slack-mb, descriptors not
at all. Prints the table and exits 1 when either grows.

    python benchmarks/long_run.py                 # 2,000 steps (a few minutes on a CPU)
    python benchmarks/long_run.py --steps 400     # a quick look

Resident memory is read from /proc/self/status (Linux) or as the peak (ru_maxrss) elsewhere; figures
on a machine shared with other work are noisy, the descriptor count is exact."""
from __future__ import annotations

import argparse
import os
import pathlib
import random
import resource
import shutil
import sys
import tempfile
import time

VOCAB = 512


def rss_mb() -> float:
    try:
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024


def open_fds() -> int:
    for d in ("/proc/self/fd", "/dev/fd"):
        if os.path.isdir(d):
            return len(os.listdir(d)) - 1        # less the one listdir itself opened
    return -1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--every", type=int, default=100, help="steps between readings (and checkpoints, evals)")
    ap.add_argument("--rss-slack-mb", type=float, default=4.0,
                    help="resident-memory growth allowed after the warm-up (allocator noise)")
    a = ap.parse_args(argv)
    import numpy as np

    from mlx_open1b.config import ModelConfig, RunConfig, TrainConfig
    from mlx_open1b.data.format import Manifest, ShardInfo, SourceInfo, write_shard
    from mlx_open1b.fsutil import sha256_file
    from mlx_open1b.train import Trainer
    work = pathlib.Path(tempfile.mkdtemp(prefix="open1b-long-"))
    try:
        rng = random.Random(0)
        docs = [np.array([rng.randrange(1, VOCAB) for _ in range(rng.randint(4, 60))], np.uint32) for _ in range(400)]
        corpus, shards = work / "corpus", []
        for k in range(0, 400, 100):
            f = f"web/shard-{k // 100:05d}.arrow"
            write_shard(corpus / f, docs[k:k + 100])
            shards.append(ShardInfo(f, 100, int(sum(map(len, docs[k:k + 100]))), sha256_file(corpus / f)))
        held = "web/heldout.arrow"
        write_shard(corpus / held, docs[:4])
        tokens = sum(s.tokens for s in shards)
        Manifest("0" * 64, VOCAB, 0, [SourceInfo("web", 1.0, 400, tokens, tokens / 400, shards,
                                                 ShardInfo(held, 4, int(sum(map(len, docs[:4]))),
                                                           sha256_file(corpus / held)))],
                 created_by="long_run").save(corpus)
        model = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                            ffn_hidden=48, seq_len=16, window=8, global_every=2)
        cfg = RunConfig(model, TrainConfig(seed=7, microbatch_seqs=2, phases=((0, 2),), total_tokens=10 ** 9,
                                           peak_lr=1e-3, warmup_tokens=64, checkpoint_every=a.every,
                                           eval_every=a.every, eval_windows=2), "micro")
        tr = Trainer.new(work / "run", cfg, corpus, log=lambda m: None)
        rows, t0 = [], time.perf_counter()
        print(f"{'step':>6s} {'rss MiB':>8s} {'fds':>4s} {'s/step':>7s}")
        for target in range(a.every, a.steps + 1, a.every):
            t1 = time.perf_counter()
            tr.train(target)
            rows.append((target, rss_mb(), open_fds()))
            print(f"{target:6d} {rows[-1][1]:8.1f} {rows[-1][2]:4d} {(time.perf_counter() - t1) / a.every:7.4f}",
                  flush=True)
        base = [r for r in rows if r[0] >= min(200, a.steps)][0]
        grew_mb = max(r[1] for r in rows if r[0] >= base[0]) - base[1]
        fd_grew = max(r[2] for r in rows if r[0] >= base[0]) - base[2]
        print(f"{a.steps} steps in {time.perf_counter() - t0:.0f} s; after step {base[0]}: resident memory "
              f"{'+' if grew_mb >= 0 else ''}{grew_mb:.1f} MiB, open descriptors {fd_grew:+d}")
        bad = grew_mb > a.rss_slack_mb or fd_grew > 0
        if bad:
            print("GROWS: " + ", ".join(w for w, b in (("resident memory", grew_mb > a.rss_slack_mb),
                                                       ("open descriptors", fd_grew > 0)) if b))
        return 1 if bad else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
