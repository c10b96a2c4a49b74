"""Hostile files: every reader of the package's own files fed mutated and truncated copies of a good
one (a checkpoint's meta.json and state.safetensors, run.json, the ledger, a corpus manifest and
shard, an audit plan, an attestation, a parity bundle, a tokenizer, an export). Only the reader's
own error types may come out: any other exception is a crash, and so is a case that kills the
process (each reader runs in a forked process; the next case starts a new one), a case over
--case-seconds a hang, a MemoryError an allocation sized by an untrusted header (the address space
is capped). Each failure is printed with the seed that reproduces it (--only READER --seed S --cases 1).

    python scripts/fuzz_readers.py --cases 100000          # the benchmark: cases/s and outcomes per reader
    python scripts/fuzz_readers.py --cases 2000 --seed 7   # what CI runs (tests/cli/test_scripts.py)

Exit status 0 when nothing crashed, hung or ran out of memory; 1 otherwise. Figures taken on a
busy machine understate the rate."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import pathlib
import random
import resource
import shutil
import signal
import struct
import sys
import tempfile
import time
import traceback

import numpy as np

VOCAB = 512                   # the micro run's: small files, fast cases
MUTATIONS = ("truncate", "bitflip", "overwrite", "insert", "delete", "json_value", "json_drop", "header")
ODD_VALUES = (None, True, False, -1, 0, 1, 2 ** 31, 2 ** 64, -(2 ** 63) - 1, 10 ** 400, 1e308, -0.0, "", "x" * 5000,
              "ckpt-00000000", [], [0] * 3, {}, {"a": {}}, [[[[[]]]]], "0" * 64, "../../etc/passwd")


class Hang(BaseException):
    pass


# ------------------------------------------------------------------------------- mutations
def _json_paths(v, path=()):
    yield path
    if isinstance(v, dict):
        for k, x in v.items():
            yield from _json_paths(x, path + (k,))
    elif isinstance(v, list):
        for i, x in enumerate(v[:64]):
            yield from _json_paths(x, path + (i,))


def _set(doc, path, value, drop=False):
    if not path:
        return value
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    if drop and isinstance(parent, dict):
        del parent[path[-1]]
    elif drop:
        parent.pop(path[-1])
    else:
        parent[path[-1]] = value
    return doc


def mutate(data: bytes, rng: random.Random, kind: str) -> bytes:
    n = len(data)
    if kind == "truncate":
        return data[:rng.randrange(n)] if n else data
    if kind == "bitflip":
        b = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            if b:
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        return bytes(b)
    if kind == "overwrite":
        at = rng.randrange(max(n, 1))
        return data[:at] + rng.randbytes(rng.randint(1, 64)) + data[at + rng.randint(1, 64):]
    if kind == "insert":
        at = rng.randrange(n + 1)
        return data[:at] + rng.choice([rng.randbytes(rng.randint(1, 64)), b"\n", b"{", b'"', b"\x00" * 16]) + data[at:]
    if kind == "delete":
        at = rng.randrange(max(n, 1))
        return data[:at] + data[at + rng.randint(1, 256):]
    if kind in ("json_value", "json_drop"):
        lines = data.split(b"\n")
        jsonl = len(lines) > 2 and all(x.startswith(b"{") for x in lines if x)
        if jsonl:                             # one line of a JSON-lines file
            i = rng.randrange(len([x for x in lines if x]))
            return b"\n".join(mutate(x, rng, kind) if j == i else x for j, x in enumerate(lines))
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            return mutate(data, rng, "bitflip")
        paths = list(_json_paths(doc))
        path = rng.choice(paths)
        deep = rng.random() < 0.1             # nesting deeper than a recursive parser goes
        value = "\x00deep" if deep else rng.choice(ODD_VALUES)
        doc = _set(doc, path, value, drop=(kind == "json_drop" and bool(path)))
        text = json.dumps(doc, allow_nan=True)
        return (text.replace('"\\u0000deep"', "[" * 100_000 + "]" * 100_000) if deep else text).encode()
    if kind == "header":                      # safetensors: the length prefix and the header's numbers
        if n < 8:
            return mutate(data, rng, "bitflip")
        (hl,) = struct.unpack_from("<Q", data)
        if rng.random() < 0.3 or hl > n - 8:
            return struct.pack("<Q", rng.choice([0, 1, hl + 1, hl - 1, 2 ** 63, 2 ** 64 - 1, n, n - 8])) + data[8:]
        try:
            header = json.loads(data[8:8 + hl])
        except (ValueError, UnicodeDecodeError):
            return mutate(data, rng, "bitflip")
        names = [k for k in header if k != "__metadata__"] or ["x"]
        e = header.setdefault(rng.choice(names), {})
        field = rng.choice(["shape", "data_offsets", "dtype"])
        e[field] = rng.choice([[2 ** 62, 2 ** 62], [-1], [0, 2 ** 64], [1, 0], [], "F32", "BF16", "Q8", None,
                               [2 ** 31] * 8, [0, 8]])
        hb = json.dumps(header).encode()
        hb += b" " * (-len(hb) % 8)
        return struct.pack("<Q", len(hb)) + hb + data[8 + hl:]
    raise ValueError(kind)


# ------------------------------------------------------------------------------- the files and readers
@dataclasses.dataclass
class Target:
    name: str
    good: pathlib.Path            # the good file
    read: object                  # read(path of the mutated copy) -> anything
    errors: tuple                 # the reader's own errors
    place: object = None          # place(scratch, data) -> path to read; default: scratch/<good name>
    kinds: tuple = MUTATIONS


def build(work: pathlib.Path) -> list[Target]:
    """Make the good files (a prepared corpus, a micro run, its attestation, plan, bundle, export)."""
    from mlx_open1b.audit import AttestError
    from mlx_open1b.audit.coverage import report
    from mlx_open1b.audit.plan import load_plan, make_plan
    from mlx_open1b.audit.replay import audit
    from mlx_open1b.audit.run import load_run
    from mlx_open1b.checkpoint import CheckpointError, load_checkpoint
    from mlx_open1b.config import ModelConfig, RunConfig, TrainConfig
    from mlx_open1b.data.format import DataError, Manifest, ShardInfo, SourceInfo, read_shard, write_shard
    from mlx_open1b.data.tokenizer import Tokenizer, default_tokenizer_path
    from mlx_open1b.export import ExportError, export, load_export
    from mlx_open1b.fsutil import sha256_file, write_json_atomic
    from mlx_open1b.ledger import LedgerError, verify_chain
    from mlx_open1b.parity import BundleError, compare_bundles, export_bundle, format_comparison, load_bundle
    from mlx_open1b.rundir import RunDir, RunDirError
    from mlx_open1b.train import Trainer

    corpus = work / "corpus"                 # a tiny corpus written straight in the shard format
    rng = random.Random(0)
    docs = [np.array([rng.randrange(1, VOCAB) for _ in range(rng.randint(4, 40))], np.uint32) for _ in range(30)]
    shards = []
    for k in range(0, 30, 10):
        f = f"web/shard-{k // 10:05d}.arrow"
        write_shard(corpus / f, docs[k:k + 10])
        shards.append(ShardInfo(f, 10, int(sum(map(len, docs[k:k + 10]))), sha256_file(corpus / f)))
    tokens = sum(s.tokens for s in shards)
    Manifest("0" * 64, VOCAB, 0, [SourceInfo("web", 1.0, 30, tokens, tokens / 30, shards, None)],
             created_by="fuzz").save(corpus)
    model = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                        ffn_hidden=48, seq_len=16, window=8, global_every=2)
    cfg = RunConfig(model, TrainConfig(seed=7, microbatch_seqs=2, phases=((0, 2),), total_tokens=4000,
                                       peak_lr=1e-2, warmup_tokens=64, checkpoint_every=2, eval_every=0,
                                       eval_windows=2), "micro")
    run = work / "run"
    tr = Trainer.new(run, cfg, corpus, log=lambda m: None)
    tr.train(2)
    tr.rundir.unlock()
    genesis = tr.genesis
    att = work / "attestation.json"
    audit(run, 0, 1, auditor="fuzz", out=att)
    plan = work / "plan.json"
    write_json_atomic(plan, make_plan(run, 1, 0))
    bundle = work / "bundle.json"
    export_bundle(bundle, backend="cpu_ref", cases=1, steps=0, ops=["rmsnorm_forward", "adamw"])
    good_bundle = load_bundle(bundle)
    exported = work / "exported"
    export(run, None, "mlx", exported)
    view = load_run(run)
    ckpt = RunDir(run).checkpoint(2)
    shard = sorted((corpus / "web").glob("shard-*.arrow"))[0]

    def in_copy(src_dir: pathlib.Path, name: str):
        def place(scratch: pathlib.Path, data: bytes) -> pathlib.Path:
            d = scratch / src_dir.name
            if not d.exists():
                shutil.copytree(src_dir, d)
            (d / name).write_bytes(data)
            return d
        return place

    def compare(p):
        b = load_bundle(p)
        return format_comparison(compare_bundles(good_bundle, b), good_bundle, b)

    def attest(p):
        return report(run, [p])

    tok_errors = (DataError,)
    return [
        Target("checkpoint meta.json", ckpt / "meta.json", load_checkpoint, (CheckpointError,), in_copy(ckpt, "meta.json")),
        Target("checkpoint state.safetensors", ckpt / "state.safetensors", load_checkpoint, (CheckpointError,),
               in_copy(ckpt, "state.safetensors")),
        Target("run.json", run / "run.json", lambda d: RunDir(d).info(), (RunDirError,), in_copy(run, "run.json")),
        Target("ledger", run / "ledger.jsonl", lambda p: verify_chain(p, genesis), (LedgerError,)),
        Target("manifest", corpus / "manifest.json", Manifest.load, (DataError,), in_copy(corpus, "manifest.json")),
        Target("shard", shard, read_shard, (DataError,)),
        Target("plan", plan, lambda p: load_plan(p, view), (AttestError,)),
        Target("attestation", att, attest, (AttestError,)),
        Target("bundle", bundle, compare, (BundleError,)),
        Target("tokenizer", pathlib.Path(default_tokenizer_path()), Tokenizer.load, tok_errors),
        Target("export config.json", exported / "config.json", load_export, (ExportError,),
               in_copy(exported, "config.json")),
        Target("export weights", exported / "weights.safetensors", load_export, (ExportError,),
               in_copy(exported, "weights.safetensors")),
    ]


# ------------------------------------------------------------------------------- running
def _alarm(signum, frame):
    raise Hang()


def run_case(t: Target, seed: int, scratch: pathlib.Path, good: bytes, case_seconds: float):
    """(outcome, detail): outcome is ok, refused, crash, hang or memory."""
    rng = random.Random(seed)
    kind = rng.choice(t.kinds if t.good.suffix == ".safetensors" else [k for k in t.kinds if k != "header"])
    data = mutate(good, rng, kind)
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir()
    path = t.place(scratch, data) if t.place else scratch / t.good.name
    if not t.place:
        path.write_bytes(data)
    signal.setitimer(signal.ITIMER_REAL, case_seconds)
    try:
        t.read(path)
        return "ok", kind
    except t.errors:
        return "refused", kind
    except Hang as e:
        tb = traceback.extract_tb(e.__traceback__)[-2] if len(traceback.extract_tb(e.__traceback__)) > 1 else None
        return "hang", f"{kind}" + (f" (at {pathlib.Path(tb.filename).name}:{tb.lineno})" if tb else "")
    except MemoryError:
        return "memory", kind
    except RecursionError:
        return "crash", f"{kind}: RecursionError"
    except Exception as e:       # noqa: BLE001 - what this script looks for
        tb = traceback.extract_tb(e.__traceback__)[-1]
        return "crash", f"{kind}: {type(e).__name__}: {str(e)[:160]} ({pathlib.Path(tb.filename).name}:{tb.lineno})"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _worker(t: Target, seeds: list, scratch: pathlib.Path, case_seconds: float, memory: int, out) -> None:
    """Run the cases of `seeds` in this (forked) process, sending (seed, outcome, detail) for each."""
    signal.signal(signal.SIGALRM, _alarm)
    resource.setrlimit(resource.RLIMIT_AS, (memory, resource.getrlimit(resource.RLIMIT_AS)[1]))
    good = t.good.read_bytes()
    for seed in seeds:
        out.send((seed, *run_case(t, seed, scratch, good, case_seconds)))
    out.close()


def run_target(t: Target, seeds: list, scratch: pathlib.Path, case_seconds: float, memory: int):
    """(seed, outcome, detail) of every case, each reader run in a forked process so that a case
    that kills the process (a segfault in a C library) is a crash reported with its seed, and the
    cases after it still run, in a new process."""
    ctx = multiprocessing.get_context("fork")
    i = 0
    while i < len(seeds):
        r, w = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_worker, args=(t, seeds[i:], scratch, case_seconds, memory, w))
        p.start()
        w.close()
        while True:
            try:
                msg = r.recv()
            except EOFError:
                break
            i += 1
            yield msg
        p.join()
        if i < len(seeds):
            yield seeds[i], "crash", f"the process died (exit code {p.exitcode}) on this case"
            i += 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=100_000, help="cases in all, spread over the readers")
    ap.add_argument("--seed", type=int, default=0, help="base seed; case i of a reader uses seed + i")
    ap.add_argument("--only", default=None, help="comma-separated reader names (as printed)")
    ap.add_argument("--case-seconds", type=float, default=5.0, help="a case running longer is a hang")
    ap.add_argument("--memory-gb", type=float, default=6.0, help="address-space cap (an allocation sized by a "
                                                                   "hostile header fails with MemoryError)")
    a = ap.parse_args(argv)
    work = pathlib.Path(tempfile.mkdtemp(prefix="open1b-fuzz-"))
    try:
        t0 = time.perf_counter()
        targets = build(work)
        if a.only:
            want = {x.strip() for x in a.only.split(",")}
            targets = [t for t in targets if t.name in want]
            if not targets:
                print(f"--only: no reader named {a.only!r}", file=sys.stderr)
                return 2
        print(f"good files made in {time.perf_counter() - t0:.1f} s; {len(targets)} readers, {a.cases} cases")
        memory = int(a.memory_gb * (1 << 30))
        per = max(1, -(-a.cases // len(targets)))       # at least --cases in all
        failures, total, t_all = [], 0, time.perf_counter()
        print(f"{'reader':30s} {'cases':>7s} {'refused':>8s} {'ok':>6s} {'crash':>6s} {'hang':>5s} {'memory':>6s} "
              f"{'cases/s':>8s}")
        for t in targets:
            counts = dict.fromkeys(("ok", "refused", "crash", "hang", "memory"), 0)
            t1 = time.perf_counter()
            seeds = [a.seed + i for i in range(per)]
            for seed, outcome, detail in run_target(t, seeds, work / "scratch", a.case_seconds, memory):
                counts[outcome] += 1
                if outcome in ("crash", "hang", "memory"):
                    failures.append(f"{t.name} seed {seed}: {outcome}: {detail}")
            dt = time.perf_counter() - t1
            total += per
            print(f"{t.name:30s} {per:7d} {counts['refused']:8d} {counts['ok']:6d} {counts['crash']:6d} "
                  f"{counts['hang']:5d} {counts['memory']:6d} {per / dt if dt else math.inf:8.0f}", flush=True)
        print(f"{total} cases in {time.perf_counter() - t_all:.1f} s; {len(failures)} crashes, hangs or "
              f"out-of-memory")
        for f in failures[:50]:
            print("  " + f)
        return 1 if failures else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
