"""Distributed data-parallel training: the same ledger, record for record and bit for bit,
at any worker count; elastic resume; a lost worker stops every worker; bad input fails before any
step. Workers are real processes on gloo (torchrun, or a direct launch with torchrun's environment)."""
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from mlx_open1b import cpu_ref
from mlx_open1b.audit import audit, run_hash
from mlx_open1b.config import ModelConfig, RunConfig, TrainConfig, preset
from mlx_open1b.distributed import (ALIGN, ShardingError, check_worker_count, dyadic_blocks, microbatch_range,
                                    norm_from_partials, owner_fold, shard_elements, valid_worker_counts)
from mlx_open1b.distributed.collectives import CommError, route
from mlx_open1b.hostmath import reciprocal
from mlx_open1b.spec import optim as spec_optim
from mlx_open1b.step import TreeFold
from mlx_open1b.train import Trainer

from data_helpers import MICRO_MIX, make_corpus

pytest.importorskip("torch.distributed")


def dist_cfg(**train):
    model = ModelConfig(vocab_size=4000, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                        ffn_hidden=48, seq_len=16, window=8, global_every=2)
    # 12 microbatches: 1, 2, 3 and 4 workers split it evenly (2: blocks of 4+2 and 2+4 microbatches);
    # the clip, spike and skip paths all run within four steps
    t = dict(seed=7, microbatch_seqs=1, phases=((0, 12),), total_tokens=4000, peak_lr=1e-2, warmup_tokens=64,
             checkpoint_every=2, eval_every=2, eval_windows=3, clip_norm=0.3, spike_threshold=3.0, spike_skip=1)
    t.update(train)
    return RunConfig(model, TrainConfig(**t), "micro")


_WORKER = """
import dataclasses, json, os, sys
from mlx_open1b.config import RunConfig
from mlx_open1b.distributed import worker_main
a = json.loads(sys.argv[1])
cfg = RunConfig.from_json(a["cfg"]) if a.get("cfg") else None
if cfg is not None and os.environ.get("O1B_TEST_SEED"):        # a worker started with another config
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=int(os.environ["O1B_TEST_SEED"])))
die = tuple(a["die_at"]) if a.get("die_at") else None      # (rank, step): that worker dies mid-step


def after_microbatches(rank, step):
    if (rank, step) == die:
        os._exit(17)


h, tr = worker_main(a["run"], cfg, a.get("corpus"), steps=a["steps"], resume=a.get("resume", False),
                    timeout=a.get("timeout", 60.0), backend=a.get("backend", "cpu_ref"),
                    after_microbatches=after_microbatches)
if a.get("backend", "cpu_ref") != "cpu_ref":
    from mlx_open1b import arrays
    kinds = " ".join(sorted({arrays.kind(x) for x in (tr.state.params, tr.state.m, tr.state.v)}))
    os.write(1, f"rank {tr.comm.rank} state kinds {kinds}\\n".encode())      # one write: lines of ranks never mix
"""


@pytest.fixture(scope="module")
def worker_script(tmp_path_factory):
    f = tmp_path_factory.mktemp("dist_worker") / "worker.py"
    f.write_text(_WORKER)
    return f


def _args(run, cfg=None, corpus=None, steps=4, resume=False, timeout=60.0, backend="cpu_ref", die_at=None):
    return json.dumps({"run": str(run), "cfg": cfg.to_json() if cfg else None, "corpus": str(corpus) if corpus else None,
                       "steps": steps, "resume": resume, "timeout": timeout, "backend": backend, "die_at": die_at})


def _env(**extra):
    return dict(os.environ, OMP_NUM_THREADS="1", **extra)


def torchrun(n, script, args, **env):
    """The production launcher: python -m torch.distributed.run --standalone --nproc-per-node n."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", str(script), args]
    r = subprocess.run(cmd, env=_env(**env), capture_output=True, text=True, timeout=300)
    return r


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(n, script, args, per_rank=None, **env):
    """n workers with torchrun's environment but no agent (so that nobody signals the survivors
    when a worker dies): [(exit code, stdout, stderr)] by rank, and the seconds until all exited."""
    port, procs, t0 = free_port(), [], time.monotonic()
    for r in range(n):
        e = _env(RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port), **env, **((per_rank or {}).get(r, {})))
        procs.append(subprocess.Popen([sys.executable, str(script), args], env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    out = [(p.returncode, *p.communicate(timeout=300)) for p in procs]
    out = [(p.returncode, o, e) for p, (_, o, e) in zip(procs, out)]
    return out, time.monotonic() - t0


def ledger(run):
    return (run / "ledger.jsonl").read_bytes()


def tree(run):
    """Every file of a run directory, relative path -> bytes; not the wall-clock step times kept beside
    the ledger (timing.jsonl differs between any two runs, which is why it is not in the ledger)."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file() and p.name != "timing.jsonl"}


# ------------------------------------------------------------------------------ pure parts
def test_microbatch_ranges_and_dyadic_blocks():
    for M in range(1, 21):
        for N in range(1, M + 1):
            covered = []
            for w in range(N):
                lo, hi = microbatch_range(M, N, w)
                assert hi > lo
                blocks = dyadic_blocks(lo, hi)
                for (s, L), nxt in zip(blocks, blocks[1:] + [(hi, 0)]):
                    assert s % (1 << L) == 0 and s + (1 << L) == nxt[0]
                    # maximal: the block cannot double while staying aligned and inside the range
                    assert not (s % (2 << L) == 0 and s + (2 << L) <= hi)
                covered += [(s, L) for s, L in blocks]
            assert sum(1 << L for _, L in covered) == M and covered[0][0] == 0
    assert dyadic_blocks(0, 12) == [(0, 3), (8, 2)] and dyadic_blocks(6, 12) == [(6, 1), (8, 2)]
    assert dyadic_blocks(1, 3) == [(1, 0), (2, 0)]


def test_shard_elements_near_equal_cut_only_where_blocks_and_chunks_begin():
    """Every cut is the allowed point (a tensor boundary, or ALIGN elements from a tensor's start)
    nearest r/N of the buffer; ranges are contiguous and within ALIGN of P/N; ALIGN starts a norm
    block and a hash chunk of bf16 and f32 elements."""
    from mlx_open1b.contract import NORM_BLOCK
    from mlx_open1b.hashing import CHUNK
    assert ALIGN % NORM_BLOCK == 0 and (2 * ALIGN) % CHUNK == 0 and (4 * ALIGN) % CHUNK == 0
    opens = [[int(np.prod(s)) for _, s, _ in preset(p).model.param_shapes()] for p in ("small", "open1b")]
    rng = np.random.default_rng(2)
    drawn = [[int(x) for x in rng.integers(1, 3 * ALIGN, rng.integers(1, 7))] for _ in range(30)]
    for sizes in opens + drawn + [[10, 1, 1, 1, 1], [3 * ALIGN + 5, 7, 0, 2 * ALIGN]]:
        P, offs = sum(sizes), np.cumsum([0] + sizes)
        allowed = sorted({int(o) for o in offs} | {int(o) + k * ALIGN for o, n in zip(offs, sizes)
                                                    for k in range(1, -(-n // ALIGN))})
        for N in (1, 2, 3, 5, 8, 48, 64):
            sh = shard_elements(sizes, N)
            assert [s.rank for s in sh] == list(range(N)) and sh[0].lo == 0 and sh[-1].hi == P
            assert all(a.hi == b.lo for a, b in zip(sh, sh[1:]))
            for r in range(1, N):
                x = (r * P + N // 2) // N
                best = min(allowed, key=lambda c: (abs(c - x), c))
                assert sh[r].lo == best, (sizes, N, r)
            if len(allowed) > 1 and max(np.diff(allowed)) <= ALIGN:
                assert all(abs(s.size - P / N) <= ALIGN for s in sh)
            for s in sh:                                    # the tensors each range touches
                touched = [t for t in range(len(sizes)) if offs[t] < s.hi and offs[t + 1] > s.lo]
                if s.size:
                    assert (s.t0, s.t1) == (touched[0], touched[-1] + 1)
    sh = shard_elements([10, 1, 1, 1, 1], 4)         # more ranks than useful cuts: ranges left empty
    assert [s.size for s in sh] == [0, 10, 1, 3]         # targets 4, 7, 11 of 14: cuts 0, 10, 11
    sh = shard_elements([3 * ALIGN + 5], 2)                  # one tensor, cut inside
    assert [(s.lo, s.hi, s.t0, s.t1) for s in sh] == [(0, 2 * ALIGN, 0, 1), (2 * ALIGN, 3 * ALIGN + 5, 0, 1)]


def test_worker_counts():
    assert list(valid_worker_counts(((0, 12),))) == list(range(1, 13))
    assert list(valid_worker_counts(((0, 4), (100, 8)))) == [1, 2, 3, 4]
    check_worker_count(4, ((0, 4), (100, 8)))
    with pytest.raises(ShardingError, match=r"5 workers.*4 microbatches per step from 0 tokens.*valid worker counts are 1-4"):
        check_worker_count(5, ((0, 4), (100, 8)))
    with pytest.raises(ShardingError, match="valid worker counts are 1-2"):
        check_worker_count(0, ((0, 2),))


def _grads(rng, M, P):
    # magnitudes spread over many octaves so that the order of the adds shows in the bits
    return [(rng.standard_normal(P) * np.exp2(rng.integers(-12, 12, P))).astype(np.float32) for _ in range(M)]


@pytest.mark.parametrize("M", [5, 7, 12])
def test_reduce_scatter_keys_on_microbatch_index_not_arrival(M):
    """Owners fold the block partials they receive, in any arrival order, to the bits of the
    single-device fold over microbatch index; the brief's plain routing (every microbatch on its
    own, level 0) gives the same bits."""
    rng = np.random.default_rng(M)
    sizes = [int(x) for x in rng.integers(1, 300, 9)]
    P = sum(sizes)
    grads = _grads(rng, M, P)
    ref = spec_optim.treefold(list(grads))                  # the spec's fold, not the code under test
    cpu_ref.scale_inplace(ref, reciprocal(M))
    seq = grads[0].copy()                                   # a left-to-right sum: different bits
    for g in grads[1:]:
        cpu_ref.add_inplace(seq, g)
    cpu_ref.scale_inplace(seq, reciprocal(M))
    assert not np.array_equal(seq.view(np.uint32), ref.view(np.uint32))
    for N in sorted({1, 2, 3, M - 1, M} - {0}):
        shards = shard_elements(sizes, N)
        inbox = {r: [] for r in range(N)}                   # what every owner receives
        for w in range(N):
            blocks = dyadic_blocks(*microbatch_range(M, N, w))
            parts = []
            for s, L in blocks:
                f = TreeFold(cpu_ref.add_inplace)
                for i in range(s, s + (1 << L)):
                    f.push(grads[i].copy())
                parts.append(f.result())
            send, counts = route(parts, shards)
            off = 0
            for sh in shards:                               # the all-to-all, by hand
                for (s, L) in blocks:
                    inbox[sh.rank].append((s, L, send[off:off + sh.size].copy()))
                    off += sh.size
            assert off == sum(counts) == len(send)
        for sh in shards:
            if not sh.size:
                continue
            for plain in (False, True):
                if plain:                                   # every microbatch routed alone
                    arrivals = [(i, 0, grads[i][sh.lo:sh.hi].copy()) for i in range(M)]
                else:
                    arrivals = list(inbox[sh.rank])
                order = rng.permutation(len(arrivals))
                got = owner_fold([arrivals[k] for k in order], M, cpu_ref.add_inplace)
                cpu_ref.scale_inplace(got, reciprocal(M))
                assert np.array_equal(got.view(np.uint32), ref[sh.lo:sh.hi].view(np.uint32)), (N, sh, plain)


def test_owner_fold_rejects_gaps_and_misaligned_blocks():
    a = [np.ones(3, np.float32) for _ in range(4)]
    with pytest.raises(ValueError, match="cover microbatches 0-2, the step has 4"):
        owner_fold([(0, 1, a[0]), (2, 0, a[1])], 4, cpu_ref.add_inplace)
    with pytest.raises(ValueError, match="does not continue"):
        owner_fold([(0, 0, a[0]), (1, 1, a[1]), (3, 0, a[2])], 4, cpu_ref.add_inplace)
    with pytest.raises(ValueError, match="does not continue"):
        owner_fold([(0, 0, a[0]), (2, 0, a[1])], 2, cpu_ref.add_inplace)


def test_norm_and_hashes_from_owner_pieces_are_the_whole_tensors():
    """Owners' ranges cut tensors (at ALIGN): their block partials and Merkle leaves, joined in rank
    order, give the global norm and the tensor hashes of the whole buffer (f32 and bf16)."""
    from mlx_open1b import hashing
    from mlx_open1b.step import join_digests, join_partials, piece_digests, tensor_views
    rng = np.random.default_rng(3)
    sizes = [ALIGN + 5000, 3, 2 * ALIGN + 9000, 4096, 1, 700]
    shapes = [(f"t{i}", (n,), False) for i, n in enumerate(sizes)]
    g = _grads(rng, 1, sum(sizes))[0]
    bf = (rng.integers(0, 1 << 16, g.size)).astype(np.uint16)
    tensors = [a for *_, a in tensor_views(shapes, g)]
    want = cpu_ref.global_norm(tensors)
    want_hash = {dn: hashing.collection_hash(dn, [(n, a, dn) for (n, *_), a in zip(
        shapes, [v for *_, v in tensor_views(shapes, x)])]) for dn, x in (("f32", g), ("bf16", bf))}
    for N in (1, 2, 3, 6, 8):
        shards = shard_elements(sizes, N)
        if N in (2, 3):
            assert any(0 < s.lo - off < n for s in shards for off, n in zip(np.cumsum([0] + sizes), sizes))
        parts, digests = [], {"f32": [], "bf16": []}
        for sh in shards:                                   # each owner, in rank order
            views = list(tensor_views(shapes, g[sh.lo:sh.hi], sh.lo))
            parts.append({n: cpu_ref.sumsq_blocks(a) for n, _, _, _, a in views})
            for dn, x in (("f32", g), ("bf16", bf)):
                digests[dn].append(piece_digests([(n, s, dn, at, a)
                                                  for n, s, _, at, a in tensor_views(shapes, x[sh.lo:sh.hi], sh.lo)]))
        joined = join_partials(parts)
        assert list(joined) == [n for n, _, _ in shapes]
        # each tensor's own block partials, bit for bit (the folded norm below hides a swap of pieces: a few
        # hundred partials of similar size fold to the same float32 in most orders)
        for (n, *_), t in zip(shapes, tensors):
            assert np.array_equal(joined[n].view(np.uint32), cpu_ref.sumsq_blocks(t).view(np.uint32)), (N, n)
        got = norm_from_partials(list(joined.values()), cpu_ref)
        assert np.float32(got).view(np.uint32) == np.float32(want).view(np.uint32), N
        for dn in ("f32", "bf16"):
            assert hashing.collection_hash_from_tensor_hashes(dn, join_digests(digests[dn])) == want_hash[dn], (N, dn)


def test_comm_error_names_the_collective():
    e = CommError("all_to_all_single", RuntimeError(
        "[/x/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1. This is typically caused by "
        "a remote worker crashing. Check the logs.\nmore"))
    assert str(e) == "all_to_all_single: Connection closed by peer [127.0.0.1]:1."


class _DeviceArray(np.ndarray):
    """A stand-in for a cupy array (reported as cupy by the patched arrays.kind; DLPack-exportable
    like one), to follow the kinds through the collectives without a GPU."""


def _fake_cupy():
    import types
    dev = lambda a: a.view(_DeviceArray)
    m = types.ModuleType("cupy")
    m.uint8 = np.uint8
    m.empty = lambda shape, dtype=float: dev(np.empty(shape, dtype))
    m.zeros = lambda shape, dtype=float: dev(np.zeros(shape, dtype))
    m.ascontiguousarray = lambda a: a if a.flags.c_contiguous else dev(np.ascontiguousarray(a))
    m.concatenate = lambda arrs, axis=0: dev(np.concatenate([a.view(np.ndarray) for a in arrs], axis=axis))
    return m


def test_collectives_return_the_kind_given(monkeypatch):
    """A one-worker gloo group in this process: all_to_all, all_gather and broadcast return (or
    write) arrays of the kind given — numpy, or the cupy stand-in that travels by DLPack — with the
    bytes unchanged, and route joins partials in their kind."""
    import torch.distributed as dist

    from mlx_open1b import arrays
    from mlx_open1b.distributed.collectives import Comm
    from mlx_open1b.distributed.sharding import Shard
    real_kind = arrays.kind
    monkeypatch.setattr(arrays, "kind", lambda a: arrays.CUPY if isinstance(a, _DeviceArray) else real_kind(a))
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    rng = np.random.default_rng(5)
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        comm = Comm(0, 1)
        for kind, to in ((arrays.NUMPY, lambda a: a), (arrays.CUPY, lambda a: a.copy().view(_DeviceArray))):
            x = rng.standard_normal(37).astype(np.float32)
            got = comm.all_to_all(to(x), [37], [37])
            assert arrays.kind(got) == kind and got.dtype == np.float32 and got.tobytes() == x.tobytes()
            part = to(x[:5].copy())
            comm.all_gather_into(part, [5])
            assert arrays.kind(part) == kind and part.tobytes() == x[:5].tobytes()
            b = to(rng.integers(0, 2 ** 16, 9).astype(np.uint16))
            before = b.tobytes()
            comm.broadcast(b, 0)
            assert arrays.kind(b) == kind and b.tobytes() == before
            parts = [to(rng.standard_normal(10).astype(np.float32)) for _ in range(3)]
            send, counts = route(parts, [Shard(0, 0, 1, 0, 4), Shard(1, 1, 2, 4, 10)])
            want = np.concatenate([np.asarray(p)[lo:hi] for lo, hi in ((0, 4), (4, 10)) for p in parts])
            assert arrays.kind(send) == kind and counts == [12, 18] and send.tobytes() == want.tobytes()
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------ real workers
# CI runs 1 worker (the degenerate group) and 3 (an uneven split); 2 and 4 (an even split, and
# workers that own pieces of one tensor) are also in test_cut_tensors_same_run_directory_at_4_workers
# and test_checkpoint_at_2_workers_resume_at_3_int8, and run here under -m slow.
@pytest.mark.parametrize("counts", [(1, 3), pytest.param((2, 4), marks=pytest.mark.slow)], ids=lambda c: "w%d_%d" % c)
def test_same_ledger_at_1_2_3_4_workers(tmp_path, corpus, worker_script, counts):
    cfg = dist_cfg()
    single = tmp_path / "single"
    h = Trainer(single, cfg, corpus).train(4)
    recs = [json.loads(line) for line in ledger(single).splitlines()]
    assert any(r["clipped"] for r in recs) and any(r["skipped"] for r in recs) and any(r["spike"] for r in recs)
    assert any("eval" in r for r in recs)
    want = tree(single)
    for n in counts:
        run = tmp_path / f"w{n}"
        r = torchrun(n, worker_script, _args(run, cfg, corpus, steps=4))
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"run hash {h}" in r.stdout
        assert ledger(run) == ledger(single), n
        assert tree(run) == want, n         # run.json, ledger and every checkpoint, byte for byte
    # one process certifies the largest run, knowing nothing of its worker count
    att = audit(tmp_path / f"w{counts[-1]}", 0, 3)
    assert att["verdict"] == "certified" and att["run_hash"] == h
    assert run_hash(tmp_path / f"w{counts[-1]}")["run_hash"] == h


def test_cut_tensors_same_run_directory_at_4_workers(tmp_path, corpus, worker_script):
    """Embedding and LM head of 4000 x 200 elements (1.5 ALIGN): at 4 workers rank 0 owns a slice of
    the embedding only and both tensors are cut across ranks (their gradients, moments, hashes and
    norm partials in pieces); the run directory is one process's, byte for byte."""
    cfg = dist_cfg(checkpoint_every=3)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, d_model=200))
    sizes = [int(np.prod(s)) for _, s, _ in cfg.model.param_shapes()]
    shards = shard_elements(sizes, 4)
    assert (shards[0].lo, shards[0].hi) == (0, ALIGN) and ALIGN < sizes[0]
    assert any(sum(sizes) - sizes[-1] < s.lo < sum(sizes) for s in shards)
    single = tmp_path / "single"
    h = Trainer(single, cfg, corpus).train(3)
    run = tmp_path / "w4"
    r = torchrun(4, worker_script, _args(run, cfg, corpus, steps=3))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"run hash {h}" in r.stdout
    assert tree(run) == tree(single)


@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_device_array_state_at_2_and_4_workers(tmp_path, corpus, worker_script, n):
    """The metal backend keeps each worker's state in mx.arrays (device arrays; the collectives move
    them through host copies here, cupy ones by DLPack): the same run directory as one cpu_ref
    process, byte for byte, also where a worker owns no tensor (4 workers, under -m slow); resumed
    at 3."""
    pytest.importorskip("mlx.core")
    cfg = dist_cfg(eval_every=4)
    single = tmp_path / "single"
    Trainer(single, cfg, corpus).train(5)
    run = tmp_path / f"w{n}"
    r = torchrun(n, worker_script, _args(run, cfg, corpus, steps=4, backend="metal"))
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in range(n):                   # every worker kept its state in mx.arrays to the end
        assert f"rank {rank} state kinds mlx\n" in r.stdout, r.stdout
    assert ledger(run) == b"".join(ledger(single).splitlines(keepends=True)[:4])
    r = torchrun(3, worker_script, _args(run, resume=True, steps=5, backend="metal"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert tree(run) == tree(single)


def test_checkpoint_at_2_workers_resume_at_3_int8(tmp_path, corpus, worker_script):
    # 12 microbatches for two steps, then 5: 3 workers split 5 unevenly (1 + 2 + 2, unaligned blocks)
    # int8 linear layers (the open1b preset's): per-tensor activation scales, still the same bits
    cfg = dist_cfg(phases=((0, 12), (2 * 12 * 16, 5)), checkpoint_every=3)
    cfg = dataclasses.replace(cfg, precision="int8")
    single = tmp_path / "single"
    Trainer(single, cfg, corpus).train(6)
    run = tmp_path / "run"
    r = torchrun(2, worker_script, _args(run, cfg, corpus, steps=4))      # checkpoints at 3 and 4 (the end)
    assert r.returncode == 0, r.stderr[-3000:]
    import shutil
    shutil.rmtree(run / "ckpt-00000004")                                   # resume from step 3 (mid-run)
    r = torchrun(3, worker_script, _args(run, resume=True, steps=6))
    assert r.returncode == 0, r.stderr[-3000:]
    assert ledger(run) == ledger(single)
    assert tree(run) == tree(single)


def test_killed_worker_stops_every_worker_and_the_run_resumes(tmp_path, corpus, worker_script):
    cfg = dist_cfg()
    single = tmp_path / "single"
    Trainer(single, cfg, corpus).train(5)
    run = tmp_path / "run"
    timeout = 30.0
    res, took = launch(3, worker_script, _args(run, cfg, corpus, steps=5, timeout=timeout,
                                               die_at=(1, 2)))  # rank 1 dies in the middle of step 2
    assert res[1][0] == 17
    for rank in (0, 2):
        code, _, err = res[rank]
        assert code == 3, err[-2000:]
        assert f"error: [rank {rank}/3] worker lost during step 2" in err, err[-2000:]
        assert "the last checkpoint (step 2) is intact" in err
    assert took < timeout
    assert len(ledger(run).splitlines()) == 2                   # steps 0 and 1; checkpoint 2 is complete
    from mlx_open1b.checkpoint import list_checkpoints, load_checkpoint
    assert [s for s, _ in list_checkpoints(run)] == [0, 2]
    load_checkpoint(list_checkpoints(run)[-1][1])
    r = torchrun(2, worker_script, _args(run, resume=True, steps=5))
    assert r.returncode == 0, r.stderr[-3000:]
    assert ledger(run) == ledger(single)


def test_bad_input_fails_before_any_step(tmp_path, corpus, worker_script):
    # a worker count the batch cannot be split over
    res, _ = launch(3, worker_script, _args(tmp_path / "a", dist_cfg(phases=((0, 2),)), corpus))
    for code, _, err in res:
        assert code == 2 and "3 workers" in err and "valid worker counts are 1-2" in err, err[-2000:]
    assert not (tmp_path / "a").exists()
    # a worker with another configuration
    res, _ = launch(2, worker_script, _args(tmp_path / "b", dist_cfg(), corpus), per_rank={1: {"O1B_TEST_SEED": "8"}})
    for code, _, err in res:
        assert code == 2 and "workers disagree" in err and "rank 1: config train.seed = 8 (rank 0: 7)" in err, err[-2000:]
    assert not (tmp_path / "b").exists()
    # another corpus on rank 1 (same vocabulary, other documents)
    other = tmp_path / "other"
    make_corpus(other, MICRO_MIX, seed=5)
    a0, a1 = _args(tmp_path / "c", dist_cfg(), corpus), _args(tmp_path / "c", dist_cfg(), other)
    port, procs = free_port(), []
    for r, a in enumerate((a0, a1)):
        procs.append(subprocess.Popen([sys.executable, str(worker_script), a], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True,
                                      env=_env(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))))
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 2 and "rank 1: manifest_fingerprint" in err and str(other) in err, err[-2000:]
    assert not (tmp_path / "c").exists()
    # resuming a run that does not exist
    res, _ = launch(2, worker_script, _args(tmp_path / "none", resume=True))
    for code, _, err in res:
        assert code == 2 and "no run to resume" in err, err[-2000:]


def test_missing_rendezvous(tmp_path, corpus, worker_script):
    a = _args(tmp_path / "r", dist_cfg(), corpus, timeout=2.0)
    env = _env(RANK="0", WORLD_SIZE="2")
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    r = subprocess.run([sys.executable, str(worker_script), a], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "MASTER_ADDR, MASTER_PORT not set" in r.stderr, r.stderr[-2000:]
    t0 = time.monotonic()                                           # rank 0 waits for a rank 1 that never comes
    r = subprocess.run([sys.executable, str(worker_script), a], capture_output=True, text=True, timeout=120,
                       env=_env(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())))
    assert r.returncode == 2 and "rendezvous at 127.0.0.1" in r.stderr and "rank 0 of 2" in r.stderr, r.stderr[-2000:]
    assert time.monotonic() - t0 < 60
    assert not (tmp_path / "r").exists()


# Run at the start of every Python process of a CLI run (sitecustomize on PYTHONPATH): rank 1 dies
# in the middle of step 1, after its microbatches and before the reduce-scatter, as a killed worker would.
_DIE_IN_STEP_1 = """
import os
if os.environ.get("RANK") == "1":
    from mlx_open1b.distributed import trainer as _trainer
    _init = _trainer.DistributedTrainer.__init__

    def _dying(self, *args, **kw):
        kw["after_microbatches"] = lambda rank, step: step == 1 and os._exit(17)
        _init(self, *args, **kw)
    _trainer.DistributedTrainer.__init__ = _dying
"""


def test_cli_nproc(tmp_path, default_corpus):
    """`open1b train --nproc 2` (torchrun under the hood) writes the ledger of `open1b train`, also
    when a worker dies on the way and the run is resumed."""
    dying = tmp_path / "dying"
    dying.mkdir()
    (dying / "sitecustomize.py").write_text(_DIE_IN_STEP_1)

    def cli(*args, **env):
        return subprocess.run([sys.executable, "-m", "mlx_open1b.cli.main", "train", "--data", str(default_corpus),
                               "--steps", "3", *args], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                              env=_env(**env))
    r1 = cli("--out", str(tmp_path / "one"), "--threads", "2")
    assert r1.returncode == 0, r1.stderr[-3000:]
    two = tmp_path / "two"
    r2 = cli("--out", str(two), "--nproc", "2",
             PYTHONPATH=os.pathsep.join([str(dying)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    assert r2.returncode == 3, r2.stderr[-3000:]
    # the survivor either sees the lost connection or is stopped by torchrun, which stops every
    # worker when one fails; either way it says so and names the step
    assert ("[rank 0/2] worker lost during step 1" in r2.stderr
            or "[rank 0/2] worker stopped during step 1" in r2.stderr), r2.stderr[-3000:]
    assert "distributed training stopped" in r2.stderr and "is step 0 (intact)" in r2.stderr
    r2 = cli("--out", str(two), "--nproc", "2", "--resume")
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert "2 workers (gloo)" in r2.stderr and r2.stdout.strip().splitlines()[-1] == r1.stdout.strip().splitlines()[-1]
    assert ledger(two) == ledger(tmp_path / "one")
    r3 = cli("--out", str(tmp_path / "three"), "--nproc", "3")      # the tiny preset has 2 microbatches per step
    assert r3.returncode == 2 and "--nproc 3" in r3.stderr and "valid worker counts are 1-2" in r3.stderr
    assert not (tmp_path / "three").exists()


def test_gnmr_run_same_ledger_at_2_workers(tmp_path, corpus, worker_script):
    """The GNMR controller (CONTRACT.md §13) decides from the owners' norm partials on every worker:
    the same decisions and ledger as one process."""
    from mlx_open1b.gnmr import GNMRConfig
    cfg = dataclasses.replace(dist_cfg(), precision="int8",
                              gnmr=GNMRConfig(alpha=1.02, alpha_init=1.02, warm=0.0, beta=1.02, max_o=2, lock=2,
                                              window=2))
    single = tmp_path / "single"
    Trainer(single, cfg, corpus).train(4)
    recs = [json.loads(line) for line in ledger(single).splitlines()]
    assert any(r["gnmr"]["active"] for r in recs)
    run = tmp_path / "w2"
    r = torchrun(2, worker_script, _args(run, cfg, corpus, steps=4))
    assert r.returncode == 0, r.stderr[-3000:]
    assert tree(run) == tree(single)
