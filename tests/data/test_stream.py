"""The canonical stream: a pure function of (seed, manifest), worker-independent, resumable."""
import json
import subprocess
import sys
import types

import numpy as np
import pytest

from mlx_open1b import cpu_ref, step
from mlx_open1b.config import TrainConfig
from mlx_open1b.data.format import DataError, read_shard
from mlx_open1b.data.stream import Stream, Words, heldout_windows, mix_thresholds, permutation
from mlx_open1b.distributed.reduce import DistributedReduce

from data_helpers import EOT, make_corpus, mix_counts

SPEC = {"web": (0.5, 40, 30), "code": (0.3, 12, 80), "math": (0.2, 25, 10)}


@pytest.fixture()
def corpus(tmp_path):
    make_corpus(tmp_path, SPEC)
    return tmp_path


def test_pure_function_of_seed_and_manifest(corpus):
    a = Stream(corpus, 42, 16).next_windows(50)
    b = Stream(corpus, 42, 16).next_windows(50)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, Stream(corpus, 43, 16).next_windows(50))
    assert a.shape == (50, 17) and a.dtype == np.uint32


def test_windows_are_whole_documents_joined_by_separator(corpus):
    s = Stream(corpus, 7, 12)
    flat = s.next_windows(300).reshape(-1)
    # cut at separators: every piece is one document (constant id) of a stored length
    seen = {}
    cuts = np.flatnonzero(flat == EOT)
    start = 0
    for c in cuts:
        piece = flat[start:c]
        start = c + 1
        if start == 1 + len(piece) and piece.size and c == cuts[0]:
            pass
        assert piece.size >= 1 and (piece == piece[0]).all()
        seen.setdefault(int(piece[0]), []).append(piece.size)
    # per epoch a source yields each of its documents exactly once: the first 40 web documents
    # drawn are all 40 distinct documents
    web = [v for v in seen if 1000 <= v < 2000]
    assert len(web) == 40


def test_epoch_rollover_changes_order(corpus):
    s = Stream(corpus, 3, 8)
    order = []
    while len(order) < 3 * 25:
        s._next_document()
        si, k, d = s._cur
        if s.sources[si].name == "math":
            order.append((k, d))
    e0, e1, e2 = order[:25], order[25:50], order[50:75]
    assert sorted(e0) == sorted(e1) == sorted(e2)      # every document once per epoch
    assert e0 != e1 and e1 != e2                        # a new permutation each epoch


class _Recorder:
    """A model that records the windows of each microbatch it is given (zero loss and gradient)."""

    def __init__(self):
        self.seen = []

    def loss_and_grad(self, params, windows):
        self.seen.append(windows)
        return 0.0, 0.0, 0.0, np.zeros(1, np.float32)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_workers_union_equals_single_stream(corpus, world):
    """A step's microbatch gets the same windows at every worker count: each worker reads the step's
    windows from its own stream, as step.take_step does, and computes the microbatches its reducer
    gives it (worker r of N: [floor(M r / N), floor(M (r+1) / N)), CONTRACT.md §7) with the step's
    own microbatch loop; together they compute each microbatch once, on the single stream's windows,
    across a change of M (by consumed tokens); the stream position stays worker-independent."""
    mb, seq_len = 2, 10
    tcfg = TrainConfig(microbatch_seqs=mb, phases=((0, 6), (3 * 6 * mb * seq_len, 4)))
    model_cfg = types.SimpleNamespace(seq_len=seq_len)
    workers = []
    for r in range(world):
        comm = types.SimpleNamespace(rank=r, world=world)
        tr = types.SimpleNamespace(ops=cpu_ref, state=types.SimpleNamespace(params=None), model=_Recorder(), timing={})
        workers.append((Stream(corpus, 42, seq_len), DistributedReduce(comm, cpu_ref, [("x", (1,), False)], {}), tr))
    single, consumed, Ms = Stream(corpus, 42, seq_len), 0, []
    for t in range(5):
        M, tokens = tcfg.tokens_per_step(model_cfg, consumed)
        consumed += tokens
        Ms.append(M)
        want = single.next_windows(M * mb)
        got = {}
        for r, (stream, reduce, tr) in enumerate(workers):
            tr.model.seen.clear()
            _, scalars = step._microbatches(tr, reduce.blocks(M), stream.next_windows(M * mb), mb)
            assert sorted(scalars) == list(range(M * r // world, M * (r + 1) // world)), (t, r)
            for i, w in zip(sorted(scalars), tr.model.seen):
                assert i not in got
                got[i] = w
        assert sorted(got) == list(range(M))
        for i, w in got.items():
            assert np.array_equal(w, want[i * mb:(i + 1) * mb]), (t, i)
    assert Ms == [6, 6, 6, 4, 4]                        # the phase change after three steps of 6
    states = [json.dumps(s.state(), sort_keys=True) for s, _, _ in workers] + [json.dumps(single.state(), sort_keys=True)]
    assert len(set(states)) == 1                        # the position is worker-independent


def test_worker_microbatches_are_contiguous_and_cover():
    for M in (1, 5, 6, 48):
        for R in range(1, min(M, 7) + 1):
            runs = [DistributedReduce(types.SimpleNamespace(rank=r, world=R), cpu_ref, [("x", (1,), False)], {}).blocks(M)
                    for r in range(R)]
            assert [i for rr in runs for s, n in rr for i in range(s, s + n)] == list(range(M))


def _resume_in_subprocess(corpus, state, n):
    code = ("import json,sys,numpy as np\n"
            "from mlx_open1b.data.stream import Stream\n"
            "st=json.loads(sys.stdin.read())\n"
            f"s=Stream({str(corpus)!r}, st['seed'], st['seq_len'], state=st)\n"
            f"sys.stdout.write(json.dumps(s.next_windows({n}).tolist()))\n")
    r = subprocess.run([sys.executable, "-c", code], input=json.dumps(state), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return np.array(json.loads(r.stdout), np.uint32)


def test_save_restore_in_new_process(corpus):
    full = Stream(corpus, 42, 9).next_windows(400)
    s = Stream(corpus, 42, 9)
    points, epoch_boundary_seen, mid_doc_seen = [1, 37, 150, 333], False, False
    done = 0
    for p in points:
        s.next_windows(p - done)
        done = p
        st = json.loads(json.dumps(s.state()))
        mid_doc_seen |= st["current"] is not None and st["current"]["offset"] > 0
        epoch_boundary_seen |= any(c["epoch"] > 0 for c in st["sources"].values())
        assert np.array_equal(_resume_in_subprocess(corpus, st, 20), full[p:p + 20]), p
    assert mid_doc_seen and epoch_boundary_seen


def test_restore_exactly_at_an_epoch_boundary(corpus):
    s = Stream(corpus, 5, 4)
    while not any(c.epoch > 0 or c.shard_pos >= len(s._shards_of_epoch(i, c.epoch))
                  for i, c in enumerate(s._cursors)):
        s.next_window()
    st = s.state()
    nxt = s.next_windows(30)
    assert np.array_equal(Stream(corpus, 5, 4, state=st).next_windows(30), nxt)


def test_skip_equals_reading(corpus):
    a = Stream(corpus, 9, 20)
    a.skip(77)
    b = Stream(corpus, 9, 20)
    b.next_windows(77)
    assert a.state() == b.state()
    assert np.array_equal(a.next_window(), b.next_window())
    assert np.array_equal(Stream(corpus, 9, 20).window(77), Stream(corpus, 9, 20).next_windows(78)[77])


def test_source_shares_within_sampling_error(tmp_path):
    make_corpus(tmp_path, {"a": (0.6, 50, 20), "b": (0.3, 30, 60), "c": (0.1, 40, 5)}, shard_docs=7)
    s = Stream(tmp_path, 1, 64)
    n = 20000
    counts, p, sigma = mix_counts(s, n)
    assert (np.abs(counts - n * p) < 4.5 * sigma).all(), (counts, n * p)
    # token shares: documents x mean length reproduce the configured shares (up to the spread of
    # document lengths, which is large in this toy corpus)
    tok = counts * np.array([src.mean_doc_len for src in s.sources])
    assert np.allclose(tok / tok.sum(), [src.share for src in s.sources], atol=0.03)


def test_bounded_draw_and_permutation_are_unbiased():
    w = Words(123, 2)
    n = 30000
    draws = np.array([w.bounded(3) for _ in range(n)])
    counts = np.bincount(draws, minlength=3)
    chi2 = (((counts - n / 3) ** 2) / (n / 3)).sum()
    assert chi2 < 13.8                       # chi-square, 2 dof, p = 0.001
    perms = {}
    for key in range(6000):
        p = tuple(permutation(key, 3, 3))
        perms[p] = perms.get(p, 0) + 1
    assert len(perms) == 6 and min(perms.values()) > 850
    assert sorted(permutation(99, 3, 1000)) == list(range(1000))


def test_bounded_draw_rejects_the_biased_zone():
    # for n = 3, 2^32 mod 3 = 1: word 0 must be rejected (it would make 0 more likely)
    class Fixed(Words):
        def __init__(self, seq):
            self.seq = list(seq)

        def next(self):
            return self.seq.pop(0)
    assert Fixed([0, 5]).bounded(3) == 5 % 3
    assert Fixed([1]).bounded(3) == 1


def test_mix_thresholds_cover_2_32(corpus):
    s = Stream(corpus, 0, 4)
    t = mix_thresholds(s.sources)
    assert t[-1] == 2 ** 32 and t == sorted(t)


def test_heldout_probe_is_fixed_and_separate(corpus):
    a = heldout_windows(corpus, "web", 8)
    assert np.array_equal(a, heldout_windows(corpus, "web", 8))
    held_ids = {int(x) for x in np.unique(a)} - {EOT}
    train = Stream(corpus, 1, 8).next_windows(200)
    tokens, _ = read_shard(corpus / "web" / "heldout.arrow")
    assert held_ids == {int(x) for x in np.unique(tokens)}
    # held-out documents carry ids 1040, 1041 (docs 40, 41 of "web"); training never shows them
    assert not np.isin(train, list(held_ids)).any()


def test_bad_state_and_corpus(corpus, tmp_path_factory):
    s = Stream(corpus, 42, 8)
    s.next_windows(3)
    st = s.state()
    with pytest.raises(DataError, match="seed is 42, this stream's is 41"):
        Stream(corpus, 41, 8, state=st)
    with pytest.raises(DataError, match="seq_len is 8, this stream's is 9"):
        Stream(corpus, 42, 9, state=st)
    other = tmp_path_factory.mktemp("other")
    make_corpus(other, SPEC, seed=1)
    with pytest.raises(DataError, match="another corpus manifest"):
        Stream(other, 42, 8, state=st)
    with pytest.raises(DataError, match="malformed"):
        Stream(corpus, 42, 8, state={"version": 1, "seed": 42})
    (corpus / "code" / "shard-00001.arrow").unlink()
    with pytest.raises(DataError, match="shard-00001.arrow: shard file is missing"):
        Stream(corpus, 42, 8).next_windows(200)
    with pytest.raises(DataError, match="no manifest"):
        Stream(tmp_path_factory.mktemp("empty"), 1, 8)
