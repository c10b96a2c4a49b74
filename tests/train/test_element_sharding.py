"""Owners of element ranges: the workers' step gives one process's records, bit for bit, where the
ranges cut tensors (at sharding.ALIGN), where a rank owns a slice of the embedding only, where
ranks own nothing (more ranks than tensors), with the reduce-scatter in one round or many, and
with the GNMR controller reading per-tensor norms joined from pieces.

The workers run in this process (shape.comm.SimWorld(values=True): threads whose collectives move
the values; the CPU backend); tests/train/test_distributed.py runs real processes on gloo."""
from __future__ import annotations

import dataclasses
import math

import pytest

from mlx_open1b.distributed.sharding import ALIGN, shard_elements
from mlx_open1b.shape.comm import SimComm, SimWorld
from mlx_open1b.shape.run import shape_trainer
from runs import SENSITIVE, micro_cfg


def wide_cfg(M: int = 7, **kw):
    """Embedding and LM head of 1.5 ALIGN elements each (the layers' tensors are small)."""
    c = micro_cfg(phases=((0, M),), **kw)
    return dataclasses.replace(c, model=dataclasses.replace(c.model, vocab_size=3 * ALIGN // 64, d_model=32))


def offsets(c) -> dict:
    """{tensor name: (first element, end)} in the flat buffer."""
    out, at = {}, 0
    for name, shape, _ in c.model.param_shapes():
        out[name] = (at, at + math.prod(shape))
        at += math.prod(shape)
    return out


def run_steps(c, W: int, steps: int = 2, recv_bytes: int | None = None):
    """[(records, (lo, hi), rounds of the first step)] of W simulated workers, by rank."""
    world = SimWorld(W, values=True)

    def worker(r):
        tr = shape_trainer(c, SimComm(world, r), backend="cpu_ref")
        if recv_bytes is not None:
            tr.reduce.recv_bytes = recv_bytes
        k = tr.reduce.rounds(c.train.phases[0][1])
        return [tr.compute_step() for _ in range(steps)], (tr.own.lo, tr.own.hi), k

    return world.run(worker)


def single(c, steps: int = 2):
    tr = shape_trainer(c, None, backend="cpu_ref")
    return [tr.compute_step() for _ in range(steps)]


def test_ranges_cutting_the_embedding_and_lm_head_give_one_process_bits():
    c = wide_cfg()
    want = single(c)
    offs = offsets(c)
    wte, head = offs["wte"], offs["lm_head"]
    for W in (1, 2, 3, 4):
        got = run_steps(c, W)
        ranges = [lo_hi for _, lo_hi, _ in got]
        assert ranges == [(s.lo, s.hi) for s in shard_elements([b - a for a, b in offs.values()], W)]
        if W == 4:      # rank 0: a slice of the embedding only; both big tensors cut across ranks
            assert ranges[0] == (0, ALIGN) and ALIGN < wte[1]
            assert any(head[0] < lo < head[1] for lo, _ in ranges)
        for r, (recs, _, _) in enumerate(got):
            assert recs == want, (W, r)


class Metered(SimComm):
    """A rank whose all-to-alls note the bytes they send and receive."""

    def __init__(self, world, rank):
        super().__init__(world, rank)
        self.sizes = []

    def all_to_all(self, send, send_counts, recv_counts):
        self.sizes.append((send.nbytes, sum(recv_counts) * send.dtype.itemsize))
        return super().all_to_all(send, send_counts, recv_counts)


def test_streamed_rounds_over_cut_ranges_give_one_process_bits():
    """Many rounds, each a slice of every owner's range (slices end inside tensors and inside the
    ranges' pieces): no round sends or receives more than the bound, the bits are one process's."""
    c = wide_cfg()
    (want,) = single(c, steps=1)
    world, bound = SimWorld(3, values=True), 1 << 20

    def worker(r):
        comm = Metered(world, r)
        tr = shape_trainer(c, comm, backend="cpu_ref")
        tr.reduce.recv_bytes = bound
        return tr.compute_step(), comm.sizes

    for rec, sizes in world.run(worker):
        assert rec == want and len(sizes) > 8
        assert max(max(s) for s in sizes) <= bound


def test_more_ranks_than_tensors_some_owning_nothing():
    c = micro_cfg(phases=((0, 13),))
    c = dataclasses.replace(c, model=dataclasses.replace(c.model, n_layers=1))
    n_tensors = len(c.model.param_shapes())
    W = 13
    assert W > n_tensors
    got = run_steps(c, W)
    assert sum(1 for _, (lo, hi), _ in got if lo == hi) >= W - n_tensors
    want = single(c)
    for r, (recs, _, _) in enumerate(got):
        assert recs == want, r


def test_gnmr_reads_norms_joined_from_pieces():
    """The precision controller's per-unit norms come from the per-tensor partials, joined from the
    owners' pieces of the cut tensors: the same decisions and GNMR hash as one process."""
    c = dataclasses.replace(wide_cfg(M=4), precision="int8", gnmr=SENSITIVE)
    want = single(c, steps=3)
    assert all("gnmr" in r["hashes"] for r in want)
    for r, (recs, _, _) in enumerate(run_steps(c, 4, steps=3)):
        assert recs == want, r


@pytest.mark.parametrize("W", [2, 4])
def test_every_rank_holds_every_parameter_after_the_step(W):
    """The all-gather without padding writes every owner's range into each worker's buffer: the
    workers' parameters equal one process's after the update."""
    import numpy as np
    c = wide_cfg(M=4)
    one = shape_trainer(c, None, backend="cpu_ref")
    one.compute_step()
    world = SimWorld(W, values=True)

    def worker(r):
        tr = shape_trainer(c, SimComm(world, r), backend="cpu_ref")
        tr.compute_step()
        return tr.state.params

    for params in world.run(worker):
        assert np.array_equal(params, one.state.params)
