"""Crashes at random moments: a micro run is trained by a child process that is killed with SIGKILL,
again and again, and resumed each time; the run hash it ends with must equal an uninterrupted run's.

Half the kills land at a random moment; the other half inside a write: the child writes a random
prefix of its k-th write (fsutil.write_all: a ledger line, a checkpoint's tensors or meta.json,
run.json) or reaches its k-th fsync, then kills itself, so torn lines, half-written temporary
checkpoints and unsynced files are all left behind for the resume to meet. After every kill the run
directory is checked: no ckpt-* that does not load, a ledger whose complete lines verify.

    scripts/soak.sh --trials 60            # the soak (>= 50 kills): trials, where they landed, the hashes
    scripts/soak.sh --trials 6 --steps 6   # the short version CI runs (tests/train/test_soak.py)

Exit status 0 when every run reached the uninterrupted run hash and every check held; 1 otherwise."""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

VOCAB = 512

CHILD = r"""
import json, os, signal, sys
a = json.loads(sys.argv[1])
from mlx_open1b import fsutil
counts = {"write": 0, "fsync": 0}

def kill(where):
    os.write(2, f"KILLED in {where}\n".encode())
    os.kill(os.getpid(), signal.SIGKILL)

real_write, real_fsync = fsutil.write_all, fsutil.fsync_file

def write_all(f, data):
    counts["write"] += 1
    if a.get("write") == counts["write"]:
        view = memoryview(data).cast("B") if memoryview(data).ndim != 1 or memoryview(data).itemsize != 1 else memoryview(data)
        real_write(f, view[:int(len(view) * a["cut"])])
        f.flush()
        kill(f"write {counts['write']} of {getattr(f, 'name', '?')} after {int(len(view) * a['cut'])} of {len(view)} bytes")
    real_write(f, data)

def fsync_file(f):
    counts["fsync"] += 1
    if a.get("fsync") == counts["fsync"]:
        kill(f"fsync {counts['fsync']} of {getattr(f, 'name', '?')}")
    real_fsync(f)

fsutil.write_all, fsutil.fsync_file = write_all, fsync_file
from mlx_open1b.config import RunConfig
from mlx_open1b.rundir import RunDir
from mlx_open1b.train import Trainer
import warnings
warnings.simplefilter("ignore")       # the torn ledger line a resume removes
quiet = lambda m: None
if RunDir(a["run"]).exists():
    tr = Trainer.resume(a["run"], log=quiet)
else:
    tr = Trainer.new(a["run"], RunConfig.from_json(a["cfg"]), a["corpus"], log=quiet)
h = tr.train(a["steps"])
print(json.dumps({"hash": h, "writes": counts["write"], "fsyncs": counts["fsync"]}))
"""


def make_corpus(root: pathlib.Path) -> None:
    """A tiny corpus written straight in the shard format (no tokenizer)."""
    import numpy as np

    from mlx_open1b.data.format import Manifest, ShardInfo, SourceInfo, write_shard
    from mlx_open1b.fsutil import sha256_file
    rng = random.Random(0)
    docs = [np.array([rng.randrange(1, VOCAB) for _ in range(rng.randint(4, 40))], np.uint32) for _ in range(60)]
    shards = []
    for k in range(0, 60, 20):
        f = f"web/shard-{k // 20:05d}.arrow"
        write_shard(root / f, docs[k:k + 20])
        shards.append(ShardInfo(f, 20, int(sum(map(len, docs[k:k + 20]))), sha256_file(root / f)))
    tokens = sum(s.tokens for s in shards)
    Manifest("0" * 64, VOCAB, 0, [SourceInfo("web", 1.0, 60, tokens, tokens / 60, shards, None)],
             created_by="soak").save(root)


def config():
    from mlx_open1b.config import ModelConfig, RunConfig, TrainConfig
    model = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                        ffn_hidden=48, seq_len=16, window=8, global_every=2)
    return RunConfig(model, TrainConfig(seed=7, microbatch_seqs=2, phases=((0, 2),), total_tokens=40_000,
                                        peak_lr=1e-2, warmup_tokens=64, checkpoint_every=2, eval_every=3,
                                        eval_windows=2, spike_threshold=2.0, spike_skip=1), "micro")


def child(args: dict, kill_after: float | None = None) -> tuple[int, str, str]:
    p = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(args)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if kill_after is not None:
        try:
            p.wait(kill_after)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGKILL)
    out, err = p.communicate()
    return p.returncode, out, err


def check(run: pathlib.Path, genesis: str | None) -> list[str]:
    """What a killed run directory must still satisfy."""
    from mlx_open1b.checkpoint import CheckpointError, list_checkpoints, load_checkpoint
    from mlx_open1b.ledger import LedgerError, verify_chain
    from mlx_open1b.rundir import RunDir
    bad = []
    for step, p in list_checkpoints(run):
        try:
            load_checkpoint(p)
        except CheckpointError as e:
            bad.append(f"checkpoint {p.name} does not load: {e}")
    rd = RunDir(run)
    if rd.exists() and rd.ledger_file.exists():
        try:
            verify_chain(rd.ledger_file, genesis)
        except LedgerError as e:
            if "incomplete last line" not in str(e):        # a torn last line is what a kill leaves
                bad.append(f"ledger: {e}")
    return bad


def finished_problems(run: pathlib.Path, got: str, want: str, ref_ledger: bytes) -> list[str]:
    """A run that reached its last step after kills: the hash it printed and its files, byte for byte
    the ledger of the uninterrupted run."""
    out = [] if got == want else [f"a run resumed after kills printed run hash {got}, not {want}"]
    if (run / "ledger.jsonl").read_bytes() != ref_ledger:
        out.append("a run resumed after kills left a ledger that differs from the uninterrupted run's")
    return out + check(run, json.loads((run / "run.json").read_text())["genesis"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=60, help="kills in all")
    ap.add_argument("--steps", type=int, default=10, help="steps of each run")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    rng = random.Random(a.seed)
    work = pathlib.Path(tempfile.mkdtemp(prefix="open1b-soak-"))
    try:
        corpus = work / "corpus"
        make_corpus(corpus)
        cfg = config()
        base = {"cfg": cfg.to_json(), "corpus": str(corpus), "steps": a.steps}
        t0 = time.perf_counter()
        rc, out, err = child({**base, "run": str(work / "reference")})
        took = time.perf_counter() - t0
        if rc:
            print(f"the uninterrupted run failed:\n{err}", file=sys.stderr)
            return 1
        ref = json.loads(out)
        want, writes, fsyncs = ref["hash"], ref["writes"], ref["fsyncs"]
        ref_ledger = (work / "reference" / "ledger.jsonl").read_bytes()
        print(f"uninterrupted: {a.steps} steps in {took:.1f} s, {writes} writes, {fsyncs} fsyncs, run hash {want}")
        run, kills, landed, finished, problems = work / "run", 0, {}, [], []
        while kills < a.trials:
            mode = rng.choice(["time", "write", "fsync"])
            args = {**base, "run": str(run)}
            if mode == "write":
                args.update(write=rng.randint(1, writes), cut=rng.random())
            elif mode == "fsync":
                args["fsync"] = rng.randint(1, fsyncs)
            rc, out, err = child(args, kill_after=rng.uniform(0.2, took) if mode == "time" else None)
            if rc == 0:
                h = json.loads(out)["hash"]
                finished.append(h)
                problems += finished_problems(run, h, want, ref_ledger)
                shutil.rmtree(run)            # start another run
                continue
            if rc != -signal.SIGKILL:
                problems.append(f"trial {kills}: the child failed (exit {rc}):\n{err[-2000:]}")
                break
            kills += 1
            where = next((line[len("KILLED in "):] for line in err.splitlines() if line.startswith("KILLED in ")), "")
            kind = ("ledger append" if "ledger.jsonl" in where else "checkpoint write" if ".ckpt-" in where
                    else "run.json write" if "run.json" in where else "at a random moment" if not where else
                    "other write")
            landed[kind] = landed.get(kind, 0) + 1
            genesis = None
            if (run / "run.json").exists():
                genesis = json.loads((run / "run.json").read_text())["genesis"]
            problems += [f"after kill {kills} ({kind}: {where or 'time'}): {p}" for p in check(run, genesis)]
        rc, out, err = child({**base, "run": str(run)})             # the last run, to its end
        if rc:
            problems.append(f"the final resume failed (exit {rc}):\n{err[-2000:]}")
        else:
            finished.append(json.loads(out)["hash"])
            problems += finished_problems(run, finished[-1], want, ref_ledger)
        print(f"{kills} kills ({', '.join(f'{n} {k}' for k, n in sorted(landed.items()))}); {len(finished)} runs "
              f"finished after them, {sum(h == want for h in finished)} with the uninterrupted run hash; "
              f"{time.perf_counter() - t0:.0f} s")
        for p in problems:
            print("PROBLEM: " + p)
        return 1 if problems else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
