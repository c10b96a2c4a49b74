"""The weight gradients' dw_out (linear_backward, qlinear_backward, xent_backward, embedding_backward;
mlx_open1b/backend.py): on every backend the gradient written into a given array is the one returned
without it, bit for bit, and that array is what comes back; a bad dw_out is a ValueError naming it,
before anything is written. The model program hands its gradient buffer's views to the C reference
(no copy of any weight gradient per microbatch), with the gradient's bits unchanged."""
from __future__ import annotations

import numpy as np
import pytest

from mlx_open1b import arrays, backend
from mlx_open1b.model import Model, init_params

from fake_cupy import fake_gpu  # noqa: F401 (a fixture)
from helpers import assert_bits_equal, loadable_backends, rand_bf16
from runs import micro_cfg


LOADED = loadable_backends()
IDS = [n for n, _ in LOADED]
LAYERS = [("linear_backward", {}), ("qlinear_backward", {}), ("qlinear_backward", {"qmax": 7})]
LAYER_IDS = ["bf16", "int8", "int4"]


def _operands(seed=5, N=19, K=40, M=24):
    rng = np.random.default_rng(seed)
    return rand_bf16(rng, (N, M), 0.1), rand_bf16(rng, (N, K)), rand_bf16(rng, (M, K), 0.05)


@pytest.mark.parametrize("name,ops", LOADED, ids=IDS)
@pytest.mark.parametrize("op,kw", LAYERS, ids=LAYER_IDS)
def test_dw_written_into_dw_out_is_the_returned_dw(name, ops, op, kw):
    dy, x, w = _operands()
    fn = getattr(ops, op)
    dx0, dw0 = fn(dy, x, w, **kw)
    buf = np.full(3 + w.size + 5, np.nan, np.float32)       # a view inside a larger buffer, as the model's
    out = buf[3:3 + w.size].reshape(w.shape)
    dx1, dw1 = fn(dy, x, w, dw_out=out, **kw)
    assert dw1 is out
    assert_bits_equal(arrays.to_host(dx1), arrays.to_host(dx0), f"{name} {op} dx")
    assert_bits_equal(out, arrays.to_host(dw0), f"{name} {op} dw")
    assert np.isnan(buf[:3]).all() and np.isnan(buf[-5:]).all()        # nothing written outside it
    out2 = np.full(w.shape, np.nan, np.float32)
    dxn, dwn = fn(dy, x, w, need_dx=False, dw_out=out2, **kw)
    assert dxn is None and dwn is out2
    assert_bits_equal(out2, out, f"{name} {op} dw alone")
    if op == "linear_backward":              # no rows: dW is all zeros, written
        out3 = np.full(w.shape, np.nan, np.float32)
        _, dw0 = fn(dy[:0], x[:0], w, dw_out=out3, **kw)
        assert dw0 is out3 and not out3.view(np.uint32).any()


@pytest.mark.parametrize("name,ops", LOADED, ids=IDS)
def test_lm_head_and_embedding_gradients_into_dw_out(name, ops):
    rng = np.random.default_rng(9)
    N, C, V = 13, 16, 40
    h, w = rand_bf16(rng, (N, C)), rand_bf16(rng, (V, C), 0.1)
    targets = rng.integers(0, V, N).astype(np.int32)
    loss, lse, ce = ops.xent_forward(h, w, targets, 1e-4)
    dloss = np.full(N, np.float32(1.0 / N), np.float32)
    dh0, dw0 = ops.xent_backward(h, w, targets, 1e-4, lse, dloss)
    out = np.full((V, C), np.nan, np.float32)
    dh1, dw1 = ops.xent_backward(h, w, targets, 1e-4, lse, dloss, dw_out=out)
    assert dw1 is out
    assert_bits_equal(arrays.to_host(dh1), arrays.to_host(dh0), f"{name} xent dh")
    assert_bits_equal(out, arrays.to_host(dw0), f"{name} xent dw")
    dout = rng.standard_normal((N, C)).astype(np.float32)
    e0 = ops.embedding_backward(targets, dout, V)
    out = np.full((V, C), np.nan, np.float32)
    assert ops.embedding_backward(targets, dout, V, dw_out=out) is out
    assert_bits_equal(out, arrays.to_host(e0), f"{name} embedding dwte")
    with pytest.raises(ValueError, match="dw_out: dimension 0"):
        ops.xent_backward(h, w, targets, 1e-4, lse, dloss, dw_out=np.zeros((V + 1, C), np.float32))
    with pytest.raises(ValueError, match="dw_out: .*dtype float32"):
        ops.embedding_backward(targets, dout, V, dw_out=np.zeros((V, C), np.float64))


@pytest.mark.parametrize("name,ops", LOADED, ids=IDS)
@pytest.mark.parametrize("op,kw", LAYERS[:2], ids=LAYER_IDS[:2])
def test_a_bad_dw_out_is_refused_naming_it_and_nothing_is_written(name, ops, op, kw):
    dy, x, w = _operands(6)
    fn = getattr(ops, op)
    ro = np.zeros(w.shape, np.float32)
    ro.flags.writeable = False
    bad = {"shape": (np.zeros((w.shape[0] + 1, w.shape[1]), np.float32), "dimension 0"),
           "dtype": (np.zeros(w.shape, np.float64), "dtype float32"),
           "strided": (np.zeros((w.shape[0], 2 * w.shape[1]), np.float32)[:, ::2], "C-contiguous"),
           "read-only": (ro, "read-only")}
    for what, (out, msg) in bad.items():
        keep = out.copy()
        with pytest.raises(ValueError, match=f"dw_out: .*{msg}"):
            fn(dy, x, w, dw_out=out, **kw)
        assert np.array_equal(out, keep, equal_nan=True), what
    good = np.zeros(w.shape, np.float32)
    with pytest.raises(ValueError, match="dw_out: given with need_dw=False"):
        fn(dy, x, w, need_dw=False, dw_out=good, **kw)
    assert not good.any()


def test_flat_buffer_slot_counts_as_written_and_only_numpy_buffers_give_one():
    fb = arrays.FlatBuffer(10, np.float32, arrays.NUMPY)
    s = fb.slot(2, (2, 3))
    assert s.shape == (2, 3) and np.shares_memory(s, fb.buf)
    s[...] = 1.0
    fb.write(0, np.zeros(2, np.float32))
    with pytest.raises(AssertionError, match="never written"):
        fb.result()
    fb.write(8, np.zeros(2, np.float32))
    assert_bits_equal(fb.result(), np.array([0, 0, 1, 1, 1, 1, 1, 1, 0, 0], np.float32))
    fb2 = arrays.FlatBuffer(4, np.float32, arrays.NUMPY)
    fb2.slot(0, (3,))
    fb2.write(2, np.zeros(2, np.float32))
    with pytest.raises(AssertionError, match="written twice"):
        fb2.result()


@pytest.mark.parametrize("op,kw", LAYERS[:2], ids=LAYER_IDS[:2])
def test_a_host_dw_out_is_written_by_an_op_on_device_arrays(op, kw, fake_gpu):
    """Device mode (the CUDA backend on device arrays, metal on mx.arrays): the numpy dw_out is not
    moved to the device with the inputs (returns_given_kind leaves an output where it is); dW is
    written into it and it comes back, the other results on the device."""
    from mlx_open1b import cpu_ref
    dy, x, w = _operands(8)
    want = getattr(cpu_ref, op)(dy, x, w, **kw)[1]
    for name in ("cuda", "metal"):
        try:
            ops = backend.load(name)
        except backend.BackendUnavailable:
            continue
        up = fake_gpu.asarray if name == "cuda" else ops.to_device
        out = np.full(w.shape, np.nan, np.float32)
        dx, dw = getattr(ops, op)(up(dy), up(x), up(w), dw_out=out, **kw)
        assert dw is out and arrays.kind(dx) == (arrays.CUPY if name == "cuda" else arrays.MLX), name
        assert_bits_equal(out, want, f"{name} {op} dw on device arrays")
        if name == "metal":
            with pytest.raises(ValueError, match="dw_out: an mx.array cannot be written in place"):
                getattr(ops, op)(up(dy), up(x), up(w), dw_out=up(out), **kw)


class Spy:
    """A backend whose ops named in `seen` record the dw_out each call is given."""

    def __init__(self, mod, names):
        self._mod, self.seen = mod, {n: [] for n in names}

    def __getattr__(self, name):
        fn = getattr(self._mod, name)
        if name not in self.seen:
            return fn

        def call(*a, dw_out=None, **k):
            self.seen[name].append(dw_out)
            return fn(*a, dw_out=dw_out, **k)
        return call


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_the_model_writes_weight_gradients_in_place_with_the_same_bits(monkeypatch, precision):
    """The C reference writes every linear layer's dW, the LM head's and the embedding's into the
    gradient buffer (a view of it is their dw_out), and the gradient equals the one assembled by
    copies (slots refused), bit for bit."""
    from mlx_open1b import cpu_ref
    cfg = micro_cfg()
    rng = np.random.default_rng(2)
    windows = rng.integers(0, cfg.model.vocab_size, (2, cfg.model.seq_len + 1), dtype=np.uint32)
    params = init_params(cfg.model, 1)
    lin = "linear_backward" if precision == "bf16" else "qlinear_backward"
    spy = Spy(cpu_ref, [lin, "xent_backward", "embedding_backward"])
    m = Model(cfg.model, spy, precision=precision)
    want = {lin: 4 * cfg.model.n_layers, "xent_backward": 1, "embedding_backward": 1}

    def grad():
        for v in spy.seen.values():
            v.clear()
        *_, cache = m.forward(params, windows)
        g = m.backward(params, cache)
        assert {k: len(v) for k, v in spy.seen.items()} == want
        return g, [o for v in spy.seen.values() for o in v]
    g, outs = grad()
    assert all(o is not None and np.shares_memory(o, g) for o in outs)
    monkeypatch.setattr(arrays.FlatBuffer, "slot", lambda self, offset, shape: None)
    g2, outs = grad()
    assert all(o is None for o in outs)
    assert_bits_equal(g, g2, f"{precision} gradient, in place vs copied")
