"""The recycled gradient buffers (arrays.BufferPool, Model.grad_buffers, the step's fold giving its
consumed operands back): a buffer is handed out again only once nothing else references it, the fold
gives back exactly the operands it consumed, and gradients and ledgers keep every bit with and
without recycling (1-4 microbatches, per-block recomputation, int8), also while the background
hash still reads a buffer the step has given back."""
from __future__ import annotations

import dataclasses
import functools
import threading

import numpy as np
import pytest

import mlx_open1b.cpu_ref as cpu_ref
from mlx_open1b import arrays
from mlx_open1b import step as step_mod
from mlx_open1b.model import Model, init_params
from mlx_open1b.step import TreeFold
from mlx_open1b.train import Trainer

from data_helpers import MICRO_MIX, make_corpus
from runs import MICRO, count_clip_copies, micro_cfg

ADD = functools.partial(arrays.add_into, cpu_ref)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    make_corpus(d, MICRO_MIX)
    return d


# ------------------------------------------------------------------------------- the pool
@pytest.mark.parametrize("hold", ["view", "reference"])
def test_a_buffer_still_referenced_is_not_handed_out(hold):
    pool = arrays.BufferPool(16, np.float32)
    a = pool.take()
    first = id(a)
    keep = a[3:7] if hold == "view" else {"held": a}       # a view holds it through its base
    pool.give(a)
    del a
    b = pool.take()
    assert id(b) != first and pool.reused == 0 and pool.made == 2
    del keep
    assert id(pool.take()) == first and pool.reused == 1


def test_a_buffer_read_by_another_thread_waits_until_that_thread_lets_go():
    pool = arrays.BufferPool(8, np.float32)
    a = pool.take()
    go, done = threading.Event(), threading.Event()

    def reader(buf):
        go.wait()
        float(buf.sum())
        done.set()
    t = threading.Thread(target=reader, args=(a,), daemon=True)
    t.start()
    pool.give(a)
    first = id(a)
    del a
    try:
        b = pool.take()
        assert id(b) != first               # the thread still holds it
    finally:
        go.set()
        done.wait(30)
        t.join(30)
    del t
    assert id(pool.take()) == first and pool.reused == 1


def test_the_pool_keeps_only_whole_numpy_buffers_of_its_size_and_dtype():
    pool = arrays.BufferPool(16, np.float32, keep=2)
    whole = np.empty(16, np.float32)
    for bad in (np.empty(17, np.float32), np.empty(16, np.float64), np.empty(32, np.float32)[:16],
                np.empty((4, 4), np.float32), whole[:]):
        pool.give(bad)
    assert pool.waiting() == 0
    pool.give(whole)
    pool.give(whole)                        # given twice: kept once
    pool.give(np.empty(16, np.float32))
    pool.give(np.empty(16, np.float32))     # over `keep`: not kept
    assert pool.waiting() == 2


def test_a_flat_buffer_writes_into_its_out_buffer_and_still_checks_every_element():
    out = np.full(6, np.nan, np.float32)
    fb = arrays.FlatBuffer(6, np.float32, arrays.NUMPY, out)
    fb.write(0, np.arange(4, dtype=np.float32))
    with pytest.raises(AssertionError, match="never written"):
        fb.result()
    fb.write(4, np.ones(2, np.float32))
    assert fb.result() is out and out.tolist() == [0, 1, 2, 3, 1, 1]
    for bad in (np.empty(5, np.float32), np.empty(6, np.float64), np.empty(12, np.float32)[::2]):
        with pytest.raises(AssertionError, match="out must be"):
            arrays.FlatBuffer(6, np.float32, arrays.NUMPY, bad)


# ------------------------------------------------------------------------------- the fold's releases
@pytest.mark.parametrize("M", range(1, 10))
def test_the_fold_releases_exactly_the_operands_it_consumed(M):
    released = []
    fold = TreeFold(ADD, release=released.append, pushes=M)
    pushed = [np.full(4, i, np.float32) for i in range(M)]
    for v in pushed:
        fold.push(v)
        held = {id(a) for _, a in fold.stack}
        assert not held & {id(r) for r in released}       # never an entry the fold still holds
    result = fold.result()
    assert sorted(map(id, released)) == sorted(id(v) for v in pushed if v is not result)
    assert result is pushed[0]


# ------------------------------------------------------------------------------- the same bits
def _bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint32)


@pytest.mark.parametrize("precision,recompute", [("bf16", False), ("int8", False), ("bf16", True)])
def test_a_gradient_into_a_used_buffer_has_the_bits_of_one_into_a_new_buffer(precision, recompute):
    params = init_params(MICRO, 3)
    win = np.random.default_rng(5).integers(0, MICRO.vocab_size, (2, MICRO.seq_len + 1)).astype(np.uint32)
    ref = Model(MICRO, precision=precision, recompute_blocks=recompute).loss_and_grad(params, win)[3]
    m = Model(MICRO, precision=precision, recompute_blocks=recompute)
    m.grad_buffers = pool = arrays.BufferPool(m.n_params, np.float32)
    for fill in (np.nan, -0.0, 3.0):        # what the buffer held before: never read
        used = pool.take()
        used[:] = fill
        pool.give(used)
        del used
        g = m.loss_and_grad(params, win)[3]
        assert pool.reused >= 1
        np.testing.assert_array_equal(_bits(g), _bits(ref))
        pool.give(g)
        del g


def _train(run, corpus, cfg, steps: int, recycle: bool, **attrs):
    tr = Trainer(run, cfg, corpus)
    tr.recycle_grads = recycle
    for k, v in attrs.items():
        setattr(tr, k, v)
    if "recompute_blocks" in attrs:
        tr._build_model()
    h = tr.train(steps)
    return h, tr.model.grad_buffers


@pytest.mark.parametrize("M,precision,recompute", [(1, "bf16", False), (2, "bf16", False), (3, "int8", False),
                                                   (4, "bf16", True)])
def test_ledger_is_the_same_with_and_without_recycled_buffers(tmp_path, corpus, M, precision, recompute,
                                                            monkeypatch):
    """The run hash covers every step's gradient, parameter and optimizer-state hashes."""
    cfg = micro_cfg(phases=((0, M),), checkpoint_every=100, eval_every=0)
    cfg = dataclasses.replace(cfg, precision=precision)
    extra = {"recompute_blocks": True} if recompute else {}
    copies = count_clip_copies(monkeypatch)
    new, pool = _train(tmp_path / "new", corpus, cfg, 3, True, **extra)
    # every gradient through the pool, and each clip's copy of a gradient still being hashed
    assert pool.made + pool.reused == 3 * M + len(copies)
    old, none = _train(tmp_path / "old", corpus, cfg, 3, False, **extra)
    assert none is None
    assert pool.reused >= (1 if M > 1 else 0)
    assert new == old


@pytest.mark.parametrize("clip", [False, True])
def test_a_buffer_whose_hash_is_still_running_is_not_written(tmp_path, corpus, monkeypatch, clip):
    """The step gives its gradient back while the background thread may still hash it: here each
    step's gradient hash is held back until the next step's microbatch has written its gradient, so
    handing the buffer out then would change the ledger. With every update clipped, each clip also
    copies the gradient being hashed into a buffer of the pool."""
    steps = 3
    cfg = micro_cfg(phases=((0, 1),), checkpoint_every=100, eval_every=0, clip_norm=1e-6 if clip else 1e30,
                    spike_threshold=1e30)      # no spike: no skipped update
    old, _ = _train(tmp_path / "old", corpus, cfg, steps, False)
    real_digests, real_lg = step_mod.piece_digests, Model.loss_and_grad
    cond, count = threading.Condition(), {"mb": 0, "hash": 0}

    def slow_digests(items):
        items = list(items)
        if any(n == "wte" and dn == "f32" for n, _, dn, _, _ in items):    # a step's gradient
            with cond:
                k = count["hash"]
                count["hash"] += 1
                if k + 1 < steps:       # until step k + 1's microbatch is done (one per step)
                    assert cond.wait_for(lambda: count["mb"] >= k + 2, timeout=30)
        return real_digests(items)

    def lg(self, *a):
        out = real_lg(self, *a)
        with cond:
            count["mb"] += 1
            cond.notify_all()
        return out
    monkeypatch.setattr(step_mod, "piece_digests", slow_digests)
    monkeypatch.setattr(Model, "loss_and_grad", lg)
    copies = count_clip_copies(monkeypatch)
    new, pool = _train(tmp_path / "new", corpus, cfg, steps, True)
    assert count == {"mb": steps, "hash": steps}
    assert new == old
    if clip:
        # the held-back hashes (every step's but the last) were pending at their clips
        assert len(copies) >= steps - 1
    else:                                           # step 1 could not have step 0's buffer
        assert pool.made == 2 and pool.reused == steps - 2
