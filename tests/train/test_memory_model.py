"""The memory model (mlx_open1b.shape, benchmarks/memory_model.py) against hand counts.

The expected bytes are derived here from the model's shapes and the step's rules (the binary-carry
fold, the sharding, the all-to-all's routing), not from the tool: a buffer the code adds or drops
makes these tests fail, and so does a ledger that misses one."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from mlx_open1b import arrays, backend, hashing
from mlx_open1b.distributed.sharding import ALIGN, dyadic_blocks, microbatch_range, shard_elements
from mlx_open1b.shape import array as xp
from mlx_open1b.shape.ledger import COUNTED_COPY
from mlx_open1b.shape.run import measure
from mlx_open1b.step import PARK_LEVEL, TreeFold
from runs import micro_cfg

PHASES = ((0, 6), (200, 13))     # M = 13: entries of level 2 and 3 wait on the host


def cfg():
    return micro_cfg(phases=PHASES)


def long_cfg():
    """Long windows and a small vocabulary: the activations outweigh the parameters, so a worker's
    peak is a backward, not the reduce-scatter."""
    c = micro_cfg(phases=((0, 6),))        # on 2 workers: rank 1 computes (3), then (4, 5)
    return dataclasses.replace(c, model=dataclasses.replace(c.model, vocab_size=256, seq_len=128))


def wide_cfg():
    """Embedding and LM head of 1.5 ALIGN elements: 4 owners' ranges cut both (the first owner holds
    a slice of the embedding only)."""
    c = micro_cfg(phases=((0, 6),))
    return dataclasses.replace(c, model=dataclasses.replace(c.model, vocab_size=3 * ALIGN // 64, d_model=32))


def activation_bytes(c) -> int:
    """The model Cache of one microbatch (model.py: LayerCache and Cache), from the shapes."""
    m, t = c.model, c.train
    N, d, H, G, D, F = t.microbatch_seqs * m.seq_len, m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.ffn_hidden
    layer = (4 * N * d + 4 * N + 2 * N * d             # h_in, rstd_attn, a_b
             + 4 * N * H * D + 4 * N * H              # q_pre, rstd_q
             + 4 * N * G * D + 4 * N * G              # k_pre, rstd_k
             + 2 * N * H * D + 2 * 2 * N * G * D      # q_b, k_b, v_b
             + 4 * N * H * D + 4 * N * H + 2 * N * H * D   # o, lse, o_b
             + 4 * N * d + 4 * N + 2 * N * d          # h_mid, rstd_ffn, f_b
             + 2 * N * F)                             # s_b (gu is recomputed on a device of its own memory)
    top = 4 * N * d + 4 * N + 4 * N * d + 4 * N + 2 * N * d + 4 * N + 4 * N + 4 * N   # x0 ... targets
    return m.n_layers * layer + top


def fold_walk(M: int, overlap: bool = True) -> tuple[int, int, int, int]:
    """(fold-stack entries on the device at the peak, entries parked on the host, of them brought
    back ahead, most parked at once) of the microbatch fold: while microbatch i is computed the
    binary-carry stack holds one entry per set bit of i and the gradient of i is being written; an
    entry of level >= PARK_LEVEL left idle under a new top waits on the host (the shape kind has
    memory of its own, like cupy), except at the last two pushes (the sum reads it at once). Overlapped
    (parking.py), the device also holds, while microbatch i is computed, the entry parked at push
    i-1 (its copy is waited for at push i) and the first parked entry push i reads (or, if it is
    the last, the sum after it), asked back when push i-1 returned."""
    stack, best, parks, ahead, most = [], (-1, 0), 0, 0, 0     # stack: [level, on the device]
    pending = fetched = 0
    for i in range(M):
        on_device = sum(1 for _, d in stack if d) + pending + fetched
        if on_device + 1 > best[0]:
            best = (on_device + 1, on_device)
        last, pending = i == M - 1, 0
        level = 0
        while stack and stack[-1][0] == level:
            stack.pop()
            level += 1
        if i < M - 2 and stack and stack[-1][0] >= PARK_LEVEL and stack[-1][1]:
            stack[-1][1] = False
            parks, pending = parks + 1, int(overlap)
        stack.append([level, True])
        most = max(most, sum(1 for _, d in stack if not d))
        k, lv, reads = len(stack) - 1, 0, []
        while k >= 0 and stack[k][0] == lv:
            reads.append(stack[k])
            k, lv = k - 1, lv + 1
        if i + 1 == M - 1:
            reads += stack[:k + 1]
        fetched = int(overlap and not last and any(not d for _, d in reads))
        ahead += fetched
    return best[1], parks, ahead, most


def test_shape_arrays_are_a_kind_without_values():
    a = xp.empty((4, 6), np.float32)
    assert arrays.kind(a) == arrays.SHAPE and arrays.is_device(a) and arrays.writable(a)
    assert a[:, 2:4].shape == (4, 2) and not a[:, 2:4].flags.c_contiguous and a[1:3].flags.c_contiguous
    assert arrays.contiguous(a[:, 2:4])._buf is not a._buf        # copied, as numpy would
    assert a.reshape(-1)[6:12]._buf is a._buf                     # views share the buffer
    with pytest.raises(TypeError, match="no values"):
        np.asarray(a)
    # hashing covers the header only (name, dtype, shape): a shape array never passes for data
    assert hashing.tensor_digests([("x", a, "f32")]) != hashing.tensor_digests([("x", np.zeros((4, 6), np.float32), "f32")])


def test_shape_backend_is_loaded_by_name_and_not_a_training_choice():
    ops = backend.load(backend.SHAPE_ONLY)
    assert ops.NAME == "shape" and all(hasattr(ops, n) for n in backend.NAMES)
    assert backend.SHAPE_ONLY not in backend.BACKENDS         # the CLI's --backend choices
    y = ops.linear_forward(xp.empty((3, 8), np.uint16), xp.empty((5, 8), np.uint16))
    assert (y.shape, arrays.dtype(y)) == ((3, 5), np.float32)
    with pytest.raises(ValueError, match="dimension 1"):       # the real argument checks run
        ops.linear_forward(xp.empty((3, 8), np.uint16), xp.empty((5, 7), np.uint16))


def test_one_worker_step_against_a_hand_count():
    c = cfg()
    P = c.model.n_params()
    rope = 2 * c.model.seq_len * (c.model.head_dim // 2) * 4
    for (start, M), (m,) in zip(PHASES, measure(c, 1, resolution=0)):
        assert m.microbatches == M
        o = m.device.owners
        stack, parks, ahead, most = fold_walk(M)
        assert o["params"] == 2 * P and o["moments"] == 2 * 4 * P
        assert o["activations"] == activation_bytes(c)
        assert (o.get("fold stack", 0), o["gradients"]) == (stack * 4 * P, 4 * P), M
        assert o["constants"] == rope
        assert m.peak["device"] == m.device.bytes == sum(o.values()) and o["transients"] > 0
        assert m.before["device"] == 10 * P + (rope if start else 0)        # state (+ tables after step 0)
        # the hashes read the gradient, the parameters and both moments on the host (14 bytes per
        # parameter); each parked fold entry goes down once and comes back once
        assert 14 * P + parks * 4 * P <= m.moved["d2h"] < 14 * P + parks * 4 * P + M * 64 * 1024
        assert parks * 4 * P <= m.moved["h2d"] < parks * 4 * P + M * 64 * 1024
        # on the copy stream under later compute: the hashes' copies and every park's; of the
        # entries coming back, those asked for a microbatch ahead
        assert (m.moved["d2h_async"], m.moved["h2d_async"]) == (14 * P + parks * 4 * P, ahead * 4 * P), M
        # the copies of COUNTED_COPY bytes or more: the hashes' four, each park's down and back up
        assert min(2 * P, 4 * P) >= COUNTED_COPY
        assert (m.moved["d2h_n"], m.moved["h2d_n"]) == (4 + parks, parks), M
        assert (m.moved["d2h_async_n"], m.moved["h2d_async_n"]) == (4 + parks, ahead), M
        # pinned: the hashes' copies and the pool of parked entries (the most parked at once)
        assert m.host.owners["pinned"] == 14 * P + most * 4 * P, (M, m.host.owners)
        assert m.peak["host"] >= 2 * 4 * P                                   # m and v copies at once
        assert m.moved["net_out"] == m.moved["net_in"] == 0


@pytest.mark.parametrize("W, make", [(2, cfg), (3, cfg), (2, long_cfg), (4, wide_cfg)])
def test_workers_step_against_a_hand_count(W, make):
    c = make()
    P = c.model.n_params()
    sizes = [math.prod(s) for _, s, _ in c.model.param_shapes()]
    shards = shard_elements(sizes, W)
    if make is wide_cfg:          # the layout this config is for: both big tensors cut at ALIGN
        assert [(sh.lo, sh.hi) for sh in shards[:1]] == [(0, ALIGN)] and shards[3].lo == P - sizes[-1] + ALIGN
    backward_peaks = 0
    for (_, M), ranks in zip(c.train.phases, measure(c, W, resolution=0)):
        blocks = [dyadic_blocks(*microbatch_range(M, W, w)) for w in range(W)]
        for m, sh in zip(ranks, shards):
            r = m.rank
            mine, others = len(blocks[r]), sum(len(b) for w, b in enumerate(blocks) if w != r)
            assert m.owned == sh.size and m.computed == sum(1 << lv for _, lv in blocks[r])
            # all-to-all: my blocks' slices of every other owner's range out, every other worker's
            # blocks of my range in; all-gather (no padding): my range to each other, every other range in
            gather_out, gather_in = (W - 1) * sh.size * 2, (P - sh.size) * 2
            assert (m.moved["gather_out"], m.moved["gather_in"]) == (gather_out, gather_in), (M, r)
            out = 4 * mine * (P - sh.size) + gather_out
            into = 4 * others * sh.size + gather_in
            assert (m.moved["net_out"], m.moved["net_in"]) == (out, into), (M, r)
            o = m.device.owners
            assert o["params"] == 2 * P and o.get("moments", 0) == 8 * sh.size
            # the reduce-scatter: the partials and the send buffer (route), then the send and the
            # receive buffers (all-to-all), then the receive buffer and the copy of the owner's sum
            base = 2 * P + 8 * sh.size + 2 * c.model.seq_len * (c.model.head_dim // 2) * 4
            stages = (2 * 4 * mine * P, 4 * (mine * P + (mine + others) * sh.size),
                      4 * ((mine + others) * sh.size + sh.size))
            assert m.peak["device"] >= base + max(stages)
            if "activations" not in o:      # the step's peak is the reduce-scatter
                assert m.peak["device"] == base + max(stages), (M, r)
            else:       # a backward: the gradient being written, the fold's entries (one per set bit of
                # the microbatch's place in its block; blocks here are too short to park) and, in a
                # later block's first microbatch, the partial before it on its way to the host (its
                # copy is waited for at the next push)
                held = max(bin(q).count("1") + (q == 0 and b > 0)
                           for b, (_, lv) in enumerate(blocks[r]) for q in range(1 << lv))
                assert o["gradients"] + o.get("fold stack", 0) == 4 * P * (1 + held), (M, r)
                assert o["activations"] == activation_bytes(c)
                backward_peaks += len(blocks[r]) > 1
            assert m.peak["device"] == sum(o.values())
    assert backward_peaks or make is not long_cfg       # long_cfg: a worker of two blocks peaks in a backward


@pytest.mark.parametrize("W", [1, 2])
def test_replay_measures_what_the_real_program_does(W):
    c = cfg()
    real, replayed = measure(c, W, replay=False, resolution=0), measure(c, W, replay=True, resolution=0)
    for a_ranks, b_ranks in zip(real, replayed):
        for a, b in zip(a_ranks, b_ranks):
            assert (a.peak, a.before, a.moved, a.device.owners, a.host.owners) == \
                   (b.peak, b.before, b.moved, b.device.owners, b.host.owners)


@pytest.mark.parametrize("M", [1, 2, 4, 5, 13, 32, 45])
def test_parked_fold_adds_the_same_bits(M):
    """TreeFold with idle high levels moved away (here: copied to another buffer and back) adds the
    same operands in the same order as the plain fold, pushed by microbatch or by aligned block (a
    worker's partials, as an owner pushes them)."""
    from mlx_open1b import cpu_ref
    rng = np.random.default_rng(M)
    xs = [rng.standard_normal(257).astype(np.float32) * np.float32(10.0 ** rng.integers(-3, 4)) for _ in range(M)]

    def block(start, level):
        f = TreeFold(cpu_ref.add_inplace)
        for x in xs[start:start + (1 << level)]:
            f.push(x.copy())
        return f.result()

    by_block = [(block(start, lv), lv) for w in range(3) if w < M
                for start, lv in dyadic_blocks(*microbatch_range(M, min(3, M), w))]
    for pushes in ([(x, 0) for x in xs], by_block):
        moved = []
        plain = TreeFold(cpu_ref.add_inplace)
        parked = TreeFold(cpu_ref.add_inplace, lambda a: moved.append(a.size) or a.copy(), lambda a: a.copy(),
                          pushes=len(pushes))
        for x, lv in pushes:
            plain.push(x.copy(), lv)
            parked.push(x.copy(), lv)
        assert (plain.result().view(np.uint32) == parked.result().view(np.uint32)).all()
        if pushes is not by_block:
            # the first park at the 5th push, never at the last two
            assert len(moved) == fold_walk(M)[1] and (len(moved) > 0) == (M > 6)


def test_benchmark_prints_the_table(tmp_path, capsys):
    import importlib.util
    import json
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "memory_model.py"
    spec = importlib.util.spec_from_file_location("memory_model", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "rows.json"
    assert bench.main(["--preset", "tiny", "--workers", "1,2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["workers"], r["M"]) for r in rows] == [(1, 2), (2, 2)]
    assert all(r["peak"] == sum(r["owners"].values()) for r in rows)
    printed = capsys.readouterr().out
    assert "peak" in printed and "MODEL" in printed and "not measured on a device" in printed   # the figures' label
    assert not list(tmp_path.glob("*.tmp*"))                                                     # written atomically
    assert bench.main(["--preset", "tiny", "--workers", "3"]) == 2          # more workers than microbatches
    assert "valid worker counts are 1-2" in capsys.readouterr().err


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_recomputed_swiglu_input_gives_the_same_gradient_bits(precision):
    """The backward's recomputed gate/up product (Model(recompute_gate_up=True), what a device of
    its own memory does) is the forward's: loss and gradient bits equal the cached path's."""
    from mlx_open1b import cpu_ref
    from mlx_open1b.model import Model, init_params
    c = micro_cfg()
    params = init_params(c.model, 3)
    windows = np.random.default_rng(5).integers(0, c.model.vocab_size, (2, c.model.seq_len + 1)).astype(np.uint32)
    kept = Model(c.model, cpu_ref, precision=precision, recompute_gate_up=False).loss_and_grad(params, windows)
    again = Model(c.model, cpu_ref, precision=precision, recompute_gate_up=True)
    _, _, _, cache = again.forward(params, windows)
    assert all(lc.gu is None for lc in cache.layers)
    got = again.loss_and_grad(params, windows)
    bits = lambda xs: np.array(xs, np.float64).view(np.uint64).tolist()     # noqa: E731  (fp32 values as floats)
    assert bits(got[:3]) == bits(kept[:3]) and (got[3].view(np.uint32) == kept[3].view(np.uint32)).all()


def test_reduce_scatter_in_rounds_gives_the_bits_of_one_process():
    """The workers' step (3 workers, CPU backend, collectives that move the values) gives the record
    of one process, with the reduce-scatter in one round or in many (each a slice of every owner's
    range)."""
    from mlx_open1b.shape.comm import SimComm, SimWorld
    from mlx_open1b.shape.run import shape_trainer
    c = micro_cfg(phases=((0, 7),))
    want = shape_trainer(c, None, backend="cpu_ref").compute_step()
    for recv_bytes, rounds in ((1 << 32, 1), (4096, None)):
        world = SimWorld(3, values=True)

        def worker(r):
            tr = shape_trainer(c, SimComm(world, r), backend="cpu_ref")
            tr.reduce.recv_bytes = recv_bytes
            return tr.compute_step(), tr.reduce.rounds(7)

        for rec, k in world.run(worker):
            assert rec == want and (k == rounds if rounds else k > 3), (recv_bytes, k)


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_recomputed_blocks_give_the_same_gradient_bits(precision):
    """Per-block recomputation (Model(recompute_blocks=True)): the cache holds each block's input
    alone and the backward recomputes the block's forward; loss and gradient bits equal the cached
    path's, with a unit on another path (as GNMR sets them) taken by both forwards."""
    from mlx_open1b import cpu_ref
    from mlx_open1b.model import Model, init_params
    c = micro_cfg()
    params = init_params(c.model, 3)
    windows = np.random.default_rng(7).integers(0, c.model.vocab_size, (2, c.model.seq_len + 1)).astype(np.uint32)
    paths = {(0, "gate_up"): "bf16" if precision == "int8" else "int8"}
    kept_m = Model(c.model, cpu_ref, precision=precision)
    kept_m.set_paths(paths)
    kept = kept_m.loss_and_grad(params, windows)
    again = Model(c.model, cpu_ref, precision=precision, recompute_blocks=True)
    again.set_paths(paths)
    _, _, _, cache = again.forward(params, windows)
    assert len(cache.layers) == c.model.n_layers and all(isinstance(h, np.ndarray) for h in cache.layers)
    got = again.loss_and_grad(params, windows)
    bits = lambda xs: np.array(xs, np.float64).view(np.uint64).tolist()     # noqa: E731  (fp32 values as floats)
    assert bits(got[:3]) == bits(kept[:3]) and (got[3].view(np.uint32) == kept[3].view(np.uint32)).all()


@pytest.mark.parametrize("precision", ["bf16", "int8"])      # int8: the open1b preset's kernels on the shape backend
def test_recomputed_blocks_lower_the_modelled_peak(precision):
    """The memory model with --recompute-blocks: the activations' share of the device peak falls
    to at most one block's cache plus every block's input (N x d fp32 each)."""
    import dataclasses
    from mlx_open1b.shape.run import measure
    c = micro_cfg(microbatch_seqs=8)
    c = dataclasses.replace(c, precision=precision,
                            model=dataclasses.replace(c.model, vocab_size=64, n_layers=6))   # activations lead
    kept, again = measure(c, 1)[0][0], measure(c, 1, recompute_blocks=True)[0][0]
    assert again.peak["device"] < kept.peak["device"]
    N = c.train.microbatch_seqs * c.model.seq_len
    inputs = c.model.n_layers * N * c.model.d_model * 4
    assert again.device.owners.get("activations", 0) <= inputs + kept.device.owners["activations"] / c.model.n_layers
