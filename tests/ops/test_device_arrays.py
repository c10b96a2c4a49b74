"""The backends' device arrays end to end (the metal backend works on mx.array, the cuda
backend on cupy arrays): ops return the kind they are given, the model program keeps every
activation and gradient on the device, the trainer keeps its state there, and the bits are those
of the numpy path and the C reference.

Here the Metal kernels run in the emulator, but the arrays are real mx.arrays (mlx[cpu]), so the
program's handling of mx.arrays — lazy slices, no in-place writes, joins — is what runs on a Mac.
"""
from __future__ import annotations

import collections
import sys

import numpy as np
import pytest

from mlx_open1b import arrays, cpu_ref
from mlx_open1b.config import ModelConfig
from mlx_open1b.model import Model, init_params

from helpers import assert_bits_equal, rand_bf16, rand_f32

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'mlx[cpu]')")
from mlx_open1b.metal import ops as metal  # noqa: E402

CFG = ModelConfig(vocab_size=96, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16,
                  ffn_hidden=48, seq_len=16, window=8)


def windows(seed=0, B=2):
    return np.random.default_rng(seed).integers(0, CFG.vocab_size, (B, CFG.seq_len + 1)).astype(np.uint32)


def test_kinds():
    a = np.zeros(3, np.float32)
    assert arrays.kind(a) == "numpy" and arrays.kind(mx.array(a)) == "mlx" and arrays.kind([a]) is None
    assert arrays.any_device([a, (a, mx.array(a))]) == "mlx" and arrays.any_device([a, 1.0]) is None
    assert arrays.dtype(mx.array(np.zeros(2, np.uint16))) == np.uint16
    with pytest.raises(ValueError, match="bfloat16 has no numpy equivalent"):
        arrays.dtype(mx.zeros(2, mx.bfloat16))
    with pytest.raises(ValueError, match="mixed kinds"):
        arrays.concat([a, mx.array(a)])


@pytest.mark.parametrize("precision", ["bf16", "int8", "int4"])
def test_model_on_mx_arrays_matches_cpu_ref(precision):
    """loss_and_grad and eval_loss on mx.array params: mx.arrays out, the C reference's bits."""
    p, w = init_params(CFG, 1), windows()
    ref = Model(CFG, cpu_ref, precision=precision)
    loss, ce, zl, g = ref.loss_and_grad(p, w)
    m = Model(CFG, metal, precision=precision)
    loss2, ce2, zl2, cache = m.forward(metal.to_device(p), w)
    assert (loss2, ce2, zl2) == (loss, ce, zl)
    for lc in cache.layers:              # every cached activation stayed an mx.array
        bad = [k for k, v in vars(lc).items() if arrays.kind(v) != "mlx"]
        assert not bad, f"cache entries not on the device: {bad}"
    g2 = m.backward(metal.to_device(p), cache)
    assert arrays.kind(g2) == "mlx"
    assert_bits_equal(arrays.to_host(g2), g, f"{precision} gradient, mx.array vs cpu_ref")
    assert_bits_equal(m.eval_loss(metal.to_device(p), windows(1, 3)), ref.eval_loss(p, windows(1, 3)), "eval_loss")
    # numpy in -> numpy out on the same backend, same bits
    g3 = m.loss_and_grad(p, w)[3]
    assert isinstance(g3, np.ndarray)
    assert_bits_equal(g3, g, "numpy params on metal")


def test_only_token_sized_data_leaves_the_device():
    """During a forward and backward on mx.arrays, what crosses to the host (outside the
    emulator's own reads of kernel inputs) is the per-row values of the means, in one transfer:
    O(N) elements, never an activation or a gradient (N·d and more), and no token ids (the model
    checks them on the host before they go up). Counted at arrays.to_host, the one door."""
    calls = collections.Counter()
    sizes = []
    real = arrays.to_host

    def counting(a):
        if arrays.is_device(a):
            f = sys._getframe(1)
            calls[f"{f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_code.co_name}"] += 1
            sizes.append(int(a.size))
        return real(a)

    p, w = metal.to_device(init_params(CFG, 1)), windows(B=3)
    m = Model(CFG, metal)
    arrays.to_host = counting
    try:
        m.loss_and_grad(p, w)
    finally:
        arrays.to_host = real
    N = 3 * CFG.seq_len
    assert max(sizes) <= 3 * N, f"an array of {max(sizes)} elements came to the host ({dict(calls)})"
    assert dict(calls) == {"model.py:_means": 1}, dict(calls)


class StrictOps:
    """The metal ops, checked at every call the model program makes: every array argument and
    every array result is an mx.array. Allowed exceptions: to_device (its job) and rope_tables
    (built once at construction, from scalars)."""

    def __init__(self, calls):
        self.calls = calls

    def __getattr__(self, name):
        fn = getattr(metal, name)
        if not callable(fn) or name in ("to_device", "rope_tables"):
            return fn

        def leaves(v):
            if isinstance(v, (list, tuple)):
                for u in v:
                    yield from leaves(u)
            elif arrays.is_array(v):
                yield v

        def checked(*args, **kwargs):
            ins = list(leaves(list(args) + list(kwargs.values())))
            bad = [arrays.kind(a) for a in ins if arrays.kind(a) != "mlx"]
            assert not bad, f"{name}: {bad} arguments in the device program"
            out = fn(*args, **kwargs)
            bad = [arrays.kind(a) for a in leaves(out) if arrays.kind(a) != "mlx"]
            assert not bad, f"{name} returned {bad} arrays"
            self.calls[name] += 1
            return out
        return checked


def test_every_op_call_of_the_program_is_on_mx_arrays():
    calls = collections.Counter()
    m = Model(CFG, StrictOps(calls), precision="int8")
    p = metal.to_device(init_params(CFG, 1))
    loss, ce, zl, cache = m.forward(p, windows())
    top = {k: v for k, v in vars(cache).items() if arrays.is_array(v)}
    assert {arrays.kind(v) for v in top.values()} == {"mlx"} and {"inputs", "targets", "x0", "hn_b", "lse"} <= set(top)
    g = m.backward(p, cache)
    assert arrays.kind(g) == "mlx"
    m.eval_loss(p, windows(2, 2))
    # the means fold on the host after one transfer: no fold or scalar op reaches the device
    assert calls["qlinear_backward"] == 4 * CFG.n_layers, dict(calls)
    assert not {"treefold", "scalar_mul"} & set(calls), dict(calls)


def test_functional_ops_and_in_place_errors():
    rng = np.random.default_rng(3)
    a, b = rand_f32(rng, (5, 7)), rand_f32(rng, (5, 7))
    ma, mb = metal.to_device(a), metal.to_device(b)
    ref = a.copy()
    cpu_ref.add_inplace(ref, b)
    assert_bits_equal(arrays.to_host(metal.add(ma, mb)), ref, "add")
    assert_bits_equal(metal.add(a, b), cpu_ref.add(a, b), "add on numpy")
    assert_bits_equal(arrays.to_host(metal.scale(ma, 0.3)), cpu_ref.scale(a, 0.3), "scale")
    assert_bits_equal(arrays.to_host(ma), a, "add/scale left their input alone")
    with pytest.raises(ValueError, match="cannot be updated in place; use the functional op"):
        metal.add_inplace(ma, mb)
    with pytest.raises(ValueError, match="cannot be updated in place"):
        metal.scale_inplace(ma, 2.0)
    n = 300
    p, g = rand_bf16(rng, (n,)), rand_f32(rng, (n,), 0.1)
    m0, v0 = rand_f32(rng, (n,), 0.01), np.abs(rand_f32(rng, (n,), 0.001))
    kw = dict(lr=1e-3, weight_decay=0.1, step=3)
    want = cpu_ref.adamw(p, g, m0, v0, **kw)
    got = metal.adamw(*(metal.to_device(x) for x in (p, g, m0, v0)), **kw)
    for x, y, what in zip(got, want, ("p", "m", "v")):
        assert arrays.kind(x) == "mlx"
        assert_bits_equal(arrays.to_host(x), y, f"adamw {what}")
    with pytest.raises(ValueError, match="cannot be updated in place"):
        metal.adamw_step(*(metal.to_device(x) for x in (p, g, m0, v0)), **kw)
    with pytest.raises(ValueError, match="cpu_ref works on numpy arrays"):
        cpu_ref.linear_forward(metal.to_device(rand_bf16(rng, (2, 4))), metal.to_device(rand_bf16(rng, (3, 4))))


def test_trainer_state_stays_on_the_device(tmp_path):
    """A metal run keeps params and moments as mx.arrays between steps, writes the cpu_ref run's
    ledger and checkpoints byte for byte, and resumes from them."""
    from runs import micro_cfg
    from data_helpers import MICRO_MIX, make_corpus
    from mlx_open1b.train import Trainer
    corpus = tmp_path / "corpus"
    make_corpus(corpus, MICRO_MIX)
    cfg = micro_cfg(spike_threshold=0.5)        # spikes, skips and clipping all happen
    Trainer(tmp_path / "ref", cfg, corpus).train(4)
    tr = Trainer(tmp_path / "mx", cfg, corpus, backend="metal")
    tr.train(3)
    assert {arrays.kind(a) for a in (tr.state.params, tr.state.m, tr.state.v)} == {"mlx"}
    tr2 = Trainer(tmp_path / "mx", resume=True, backend="metal")
    assert arrays.kind(tr2.state.params) == "mlx"
    tr2.train(4)
    ref, got = (tmp_path / "ref" / "ledger.jsonl").read_bytes(), (tmp_path / "mx" / "ledger.jsonl").read_bytes()
    assert got == ref
    cks = sorted((tmp_path / "ref").glob("ckpt-*"))
    assert len(cks) == 3
    for ck in cks:
        for f in sorted(ck.iterdir()):
            assert (tmp_path / "mx" / ck.name / f.name).read_bytes() == f.read_bytes(), f"{ck.name}/{f.name}"


def test_auto_backend(monkeypatch):
    """--backend auto (the default): metal where MLX runs on a Metal GPU, cuda where CuPy sees a GPU,
    cpu_ref elsewhere — never an emulator."""
    from click.testing import CliRunner
    from mlx_open1b.cli.main import cli
    from mlx_open1b.cuda import runtime as cuda_runtime
    from mlx_open1b.metal import runtime as metal_runtime
    from mlx_open1b.train import get_backend, resolve_backend
    if not metal_runtime.real_metal() and not cuda_runtime.real_cuda():
        assert resolve_backend("auto") == "cpu_ref" and get_backend("auto") is cpu_ref
    assert resolve_backend("cuda") == "cuda"
    monkeypatch.setattr(metal_runtime, "real_metal", lambda: False)
    monkeypatch.setattr(cuda_runtime, "real_cuda", lambda: True)
    assert resolve_backend("auto") == "cuda"
    monkeypatch.setattr(metal_runtime, "real_metal", lambda: True)
    monkeypatch.setattr(metal_runtime, "available", lambda: (True, "Metal (test)"))
    assert resolve_backend("auto") == "metal"
    monkeypatch.setattr(metal_runtime, "available", lambda: (False, "mlx too old"))
    assert resolve_backend("auto") == "cuda"
    res = CliRunner().invoke(cli, ["train", "--backend", "nosuch"])
    assert res.exit_code == 2 and "auto" in res.output


def _launch_inputs(monkeypatch):
    """Every launch of metal/ops.py as (kernel, input kinds of its data arrays: those of more than a
    few elements, not the host-made parameter blocks)."""
    launches, run = [], metal._run

    def recording(name, inputs, *args, **kwargs):
        launches.append((name, {arrays.kind(a) for a in inputs if arrays.is_array(a) and a.size > 16}))
        return run(name, inputs, *args, **kwargs)
    monkeypatch.setattr(metal, "_run", recording)
    return launches


def test_slabs_on_mx_arrays(monkeypatch):
    """With a tiny work bound the slabbed ops cut mx.arrays into slabs (lazy slices) and join the
    pieces (mx concatenation): mx.arrays out, the C reference's bits, each kernel in several launches."""
    from mlx_open1b.metal import slabs
    rng = np.random.default_rng(11)
    # T = 97: four 32-row tiles per head, the attention kernels' smallest slab (metal/ops.py ATTN_ROWS)
    N, K, Mo, B, T, H, G, D, F, n = 6, 24, 5, 1, 97, 2, 1, 8, 10, 200
    x, w, dy = rand_bf16(rng, (N, K)), rand_bf16(rng, (Mo, K)), rand_bf16(rng, (N, Mo))
    q, k, v = rand_bf16(rng, (B, T, H, D)), rand_bf16(rng, (B, T, G, D)), rand_bf16(rng, (B, T, G, D))
    dout, hh = rand_f32(rng, (B, T, H, D)), rand_f32(rng, (N, 2 * F), 3.0)
    p, g, m0, v0 = rand_bf16(rng, (n,)), rand_f32(rng, (n,)), rand_f32(rng, (n,), 0.1), np.abs(rand_f32(rng, (n,), 0.01))
    kw = dict(lr=1e-3, weight_decay=0.1, step=3)
    dev = metal.to_device
    launches = _launch_inputs(monkeypatch)
    monkeypatch.setattr(slabs, "MAX_DISPATCH_WORK", 2 * K * 4)
    got = {"linear_forward": (metal.linear_forward(dev(x), dev(w)),),
           "linear_backward": metal.linear_backward(dev(dy), dev(x), dev(w))}
    monkeypatch.setattr(slabs, "MAX_DISPATCH_WORK", 6 * slabs.attention_pair_work(D))
    got["attention_forward"] = metal.attention_forward(dev(q), dev(k), dev(v), 0, 0.35)
    o, lse = (arrays.to_host(a) for a in got["attention_forward"])
    got["attention_backward"] = metal.attention_backward(dev(dout), dev(q), dev(k), dev(v), dev(o), dev(lse), 0, 0.35)
    monkeypatch.setattr(slabs, "MAX_DISPATCH_WORK", F * slabs.ITEM_UNITS["swiglu_forward"])
    got["swiglu_forward"] = (metal.swiglu_forward(dev(hh)),)
    monkeypatch.setattr(slabs, "MAX_DISPATCH_WORK", 40 * slabs.ITEM_UNITS["adamw"])
    got["adamw"] = metal.adamw(*(dev(a) for a in (p, g, m0, v0)), **kw)
    want = {"linear_forward": (cpu_ref.linear_forward(x, w),), "linear_backward": cpu_ref.linear_backward(dy, x, w),
            "attention_forward": cpu_ref.attention_forward(q, k, v, 0, 0.35),
            "attention_backward": cpu_ref.attention_backward(dout, q, k, v, o, lse, 0, 0.35),
            "swiglu_forward": (cpu_ref.swiglu_forward(hh),), "adamw": cpu_ref.adamw(p, g, m0, v0, **kw)}
    for op, outs in got.items():
        for a, b in zip(outs, want[op]):
            assert arrays.kind(a) == "mlx", op
            assert_bits_equal(arrays.to_host(a), np.asarray(b), f"{op}: slabbed on mx.arrays vs cpu_ref")
    per_kernel = collections.Counter(name for name, _ in launches)
    for kernel in ("gemm", "attention_forward", "attention_dq", "attention_dkv", "swiglu_forward", "adamw"):
        assert per_kernel[kernel] > 3, (kernel, dict(per_kernel))
    assert all(kinds <= {"mlx"} for _, kinds in launches)


def test_numpy_mode_on_the_gpu_moves_operands_once(monkeypatch):
    """On a Metal GPU (here: the switch that says so) a numpy-mode op's launches read device copies
    of its numpy operands made once per op, not with every slab's launch; numpy comes back with the
    C reference's bits, and argument errors are still those of the numpy arguments."""
    from mlx_open1b.metal import slabs
    rng = np.random.default_rng(12)
    x, w, dy = rand_bf16(rng, (6, 24)), rand_bf16(rng, (5, 24)), rand_bf16(rng, (6, 5))
    q, k, v = rand_bf16(rng, (1, 12, 2, 8)), rand_bf16(rng, (1, 12, 1, 8)), rand_bf16(rng, (1, 12, 1, 8))
    uploads, up = [], metal.to_device
    monkeypatch.setattr(metal, "to_device", lambda a: uploads.append(a.size) or up(a))
    launches = _launch_inputs(monkeypatch)
    monkeypatch.setattr(metal, "_lift_numpy", lambda: True)
    monkeypatch.setattr(slabs, "MAX_DISPATCH_WORK", 2 * 24 * 4)
    got = [metal.linear_forward(x, w), *metal.linear_backward(dy, x, w)]
    assert sorted(uploads) == sorted([x.size, w.size] + [dy.size, x.size, w.size]), uploads    # once per op
    monkeypatch.setattr(slabs, "MAX_DISPATCH_WORK", 6 * slabs.attention_pair_work(8))
    got += list(metal.attention_forward(q, k, v, 0, 0.35))
    assert len(uploads) == 8 and len(launches) > 12
    want = [cpu_ref.linear_forward(x, w), *cpu_ref.linear_backward(dy, x, w), *cpu_ref.attention_forward(q, k, v, 0, 0.35)]
    for a, b, what in zip(got, want, ("y", "dx", "dw", "o", "lse")):
        assert arrays.kind(a) == "numpy"
        assert_bits_equal(a, b, what)
    with pytest.raises(ValueError, match="x: must be C-contiguous"):
        metal.linear_forward(np.asfortranarray(rand_bf16(rng, (6, 24))), w)
