"""Fold entries parked on the host (mlx_open1b/parking.py, step.TreeFold): the fold gives the same
bytes with no parking, with blocking copies and with pinned buffers copied on a copy stream while
the next microbatch computes; on the cupy stand-in (tests/fake_cupy.py) a copy runs only when its
event is waited for and fresh device memory holds a poison pattern, so a missing wait gives wrong
bytes; the pinned buffers are reused from step to step; the copies are counted as the carry rule
says (overlapped: asked back a microbatch ahead)."""
import numpy as np
import pytest

from mlx_open1b import arrays, cpu_ref
from mlx_open1b.parking import Parking
from mlx_open1b.step import TreeFold

from fake_cupy import FakeCupyArray, FakeStream, fake_gpu  # noqa: F401 (a fixture)
from test_memory_model import fold_walk

MS = range(1, 41)


def values(M: int, n: int = 67) -> list:
    """Microbatch gradients of mixed magnitudes: a sum in another order gives other bits."""
    rng = np.random.default_rng(M)
    return [(rng.standard_normal(n) * 10.0 ** rng.integers(-4, 5, n)).astype(np.float32) for _ in range(M)]


def folded(xs, add, to_device=lambda a: a, **kw):
    fold = TreeFold(add, **kw)
    for x in xs:
        fold.push(to_device(x.copy()))
    return fold.result()


def bits(a) -> bytes:
    return arrays.to_host(a).view(np.uint32).tobytes()


def test_plain_fold_depends_on_the_order():
    """The values make order visible: the tree fold's bytes are not a left-to-right sum's."""
    xs = values(40)
    seq = xs[0].copy()
    for x in xs[1:]:
        cpu_ref.add_inplace(seq, x)
    assert bits(folded(xs, cpu_ref.add_inplace)) != bits(seq)


@pytest.mark.parametrize("overlap", [True, False])
def test_parked_fold_gives_the_same_bytes_on_numpy(overlap):
    """Parking (copies at once on numpy, the schedule of a device's) at M = 1..40: the plain fold's
    bytes; parks, copies asked back ahead and pinned buffers as the carry rule counts them."""
    for M in MS:
        xs = values(M)
        want = bits(folded(xs, cpu_ref.add_inplace))
        park = Parking(arrays.NUMPY, overlap)
        got = folded(xs, cpu_ref.add_inplace, parking=park, pushes=M)
        assert bits(got) == want, M
        _, parks, ahead, most = fold_walk(M, overlap)
        assert park.copies["d2h"] == park.copies["h2d"] == parks, M
        if overlap:
            assert park.copies["d2h overlapped"] == parks and park.copies["h2d overlapped"] == ahead, M
            assert park.pool.allocated == most and not park._pending, M
    assert parks and most > 1 and (ahead > 0) == overlap      # M = 40 parks, holds several, asks back ahead


def _poisoned(monkeypatch, fake):
    """Fresh device memory filled with NaN bits (as stale memory would be): a device buffer read
    before its copy has run gives other bytes."""
    def empty(shape, dtype=float, order="C"):
        a = np.empty(shape, dtype, order)
        a.view(np.uint8)[...] = 0xFF
        return FakeCupyArray(a)
    monkeypatch.setattr(fake, "empty", empty)


def test_parked_fold_gives_the_same_bytes_on_the_cupy_stand_in(fake_gpu, monkeypatch):
    """The CUDA backend's add on device arrays (kernels emulated): no parking, blocking copies to
    pageable memory and back (arrays.to_host, ops.to_device), pinned buffers with copies on the
    copy stream: the same bytes at M = 1..40. The copies ran on the copy stream, the pinned
    buffers are the pool's (cupyx.empty_pinned) and none is left held."""
    import cupyx
    from mlx_open1b.cuda import ops as cu
    _poisoned(monkeypatch, fake_gpu)
    dev = fake_gpu.asarray
    for M in MS:
        xs = values(M)
        want = bits(folded(xs, cu.add_inplace, dev))
        assert bits(folded(xs, cu.add_inplace, dev, park=arrays.to_host, unpark=cu.to_device, pushes=M)) == want, M
        before = len(cupyx.pinned)
        park = Parking(arrays.CUPY)
        assert bits(folded(xs, cu.add_inplace, dev, parking=park, pushes=M)) == want, M
        _, parks, ahead, most = fold_walk(M)
        assert len(cupyx.pinned) - before == park.pool.allocated == most, M
        assert park.copies["h2d overlapped"] == ahead and park.copies["d2h"] == parks, M
        if parks:
            s = park._stream
            assert not s.null and len(s.copies) == 2 * parks and s.ran == len(s.copies), M


def test_a_missing_wait_gives_other_bytes(fake_gpu, monkeypatch):
    """The stand-in catches a compute stream that does not wait for the copies (the plant: its
    wait_event does nothing): the parked fold's bytes differ from the plain fold's."""
    from cupy import cuda
    from mlx_open1b.cuda import ops as cu
    _poisoned(monkeypatch, fake_gpu)
    xs, dev = values(12), fake_gpu.asarray
    want = bits(folded(xs, cu.add_inplace, dev))
    monkeypatch.setattr(cuda, "get_current_stream", lambda: FakeStream())   # waits for nothing
    assert bits(folded(xs, cu.add_inplace, dev, parking=Parking(arrays.CUPY), pushes=12)) != want


def test_a_copy_queued_before_the_copy_stream_waits_is_caught(fake_gpu):
    """The stand-in refuses a copy queued on the copy stream before it has waited for the kernels
    the compute stream launched ahead of it (on a GPU the copy could read a source not yet written,
    or write a block still in use). The plant: the copy stream's wait_event does nothing."""
    from mlx_open1b.cuda import ops as cu
    xs, dev = values(12), fake_gpu.asarray
    assert bits(folded(xs, cu.add_inplace, dev, parking=Parking(arrays.CUPY), pushes=12)) == \
        bits(folded(xs, cu.add_inplace, dev))
    wait = FakeStream.wait_event
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(FakeStream, "wait_event", lambda self, event: wait(self, event) if self.null else None)
        with pytest.raises(AssertionError, match="has not waited"):
            folded(xs, cu.add_inplace, dev, parking=Parking(arrays.CUPY), pushes=12)


def test_an_abandoned_step_leaves_no_copy_under_way(fake_gpu, monkeypatch):
    """A microbatch that raises (at each index in turn) while copies are queued, parked entries on
    their way down or back: the step lets go of its folds only after the copy stream has run them
    all (Parking.drain), so no device array is let go before its queued copy ran."""
    import gc
    from types import SimpleNamespace
    from mlx_open1b import step
    from mlx_open1b.cuda import ops as cu
    _poisoned(monkeypatch, fake_gpu)
    M, xs, dev = 20, values(20), fake_gpu.asarray
    in_flight = 0
    for bad in range(1, M):
        tr = SimpleNamespace(ops=cu, state=SimpleNamespace(params=dev(np.zeros(1, np.float32))))

        def loss_and_grad(params, windows, tr=tr, bad=bad):
            nonlocal in_flight
            i = windows[0]
            if i == bad:
                s = tr.parking._stream
                in_flight += s is not None and s.ran < len(s.copies)
                raise KeyboardInterrupt
            return 0.0, 0.0, 0.0, dev(xs[i].copy())
        tr.model = SimpleNamespace(loss_and_grad=loss_and_grad)
        with pytest.raises(KeyboardInterrupt):
            step._microbatches(tr, [(0, 12), (12, M - 12)], list(range(M)), 1)
        gc.collect()
        s = tr.parking._stream
        if s is not None:
            s.synchronize()         # a copy still queued whose device array is gone raises here
            assert not tr.parking._pending, bad
    assert in_flight > 0          # some raise came while a copy was queued


def test_pinned_pool_is_reused_across_steps():
    """A pool's buffers taken by one step's parks are the next step's: no growth after the first."""
    park = Parking(arrays.NUMPY)
    for step in range(3):
        folded(values(29), cpu_ref.add_inplace, parking=park, pushes=29)
        if step == 0:
            first = (park.pool.allocated, park.pool.nbytes)
    assert (park.pool.allocated, park.pool.nbytes) == first == (fold_walk(29)[3], fold_walk(29)[3] * 67 * 4)


@pytest.mark.slow
def test_trainer_parks_on_the_cupy_stand_in_with_the_bits_of_cpu_ref(tmp_path, fake_gpu):
    """Training on device arrays (the CUDA backend, kernels emulated) with M = 9 microbatches per
    step: the fold parks an entry each step, asks it back a microbatch ahead, and the ledger is the
    cpu_ref run's byte for byte; the pinned pool is allocated in the first step and reused after."""
    import cupyx
    from data_helpers import MICRO_MIX, make_corpus
    from mlx_open1b.train import Trainer
    from runs import micro_cfg
    make_corpus(tmp_path / "corpus", MICRO_MIX)
    c, steps = micro_cfg(phases=((0, 9),)), 3
    Trainer(tmp_path / "ref", c, tmp_path / "corpus").train(steps)
    tr = Trainer(tmp_path / "cuda", c, tmp_path / "corpus", backend="cuda")
    tr.train(1)
    pinned = len(cupyx.pinned)
    tr.train(steps)
    _, parks, ahead, most = fold_walk(9)
    park = tr.parking
    assert arrays.kind(tr.state.params) == arrays.CUPY and (parks, ahead, most) == (1, 1, 1)
    assert len(cupyx.pinned) == pinned == 4 + most and park.pool.allocated == most      # hashes' 4, the pool's
    assert park.copies["d2h overlapped"] == park.copies["h2d overlapped"] == steps * parks
    assert (tmp_path / "cuda" / "ledger.jsonl").read_bytes() == (tmp_path / "ref" / "ledger.jsonl").read_bytes()
