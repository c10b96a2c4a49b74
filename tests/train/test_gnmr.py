"""The GNMR controller (mlx_open1b/gnmr.py, CONTRACT.md §13) against a direct transcription of the
seed's Algorithms 1 and 2 in float64 Python, on synthetic norm sequences."""
from __future__ import annotations

import numpy as np
import pytest

from mlx_open1b.config import ModelConfig
from mlx_open1b.gnmr import Controller, GNMRConfig, GNMRError, GNMRState, units

CFG = ModelConfig(vocab_size=64, d_model=16, n_layers=3, n_heads=2, n_kv_heads=1, head_dim=8,
                  ffn_hidden=24, seq_len=8, window=4, global_every=2)


class Transcription:
    """Algorithms 1 and 2 as printed (float64, per unit, lists for queues)."""

    def __init__(self, U, alpha_init, alpha, warm_steps, beta, max_o, lock, window, eps):
        self.U, self.alpha_init, self.alpha, self.warm_steps = U, alpha_init, alpha, warm_steps
        self.beta, self.max_o, self.T_lock, self.delta, self.eps = beta, max_o, lock, window, eps
        self.A = [0.0] * U
        self.Q = [[] for _ in range(U)]
        self.Lock = [0] * U
        self.t = 0

    def step(self, norms):
        self.t += 1
        t = self.t
        alpha = self.alpha_init if t <= self.warm_steps else self.alpha
        R, G, DG = [], [], []
        for b in range(self.U):                        # Algorithm 1
            n = norms[b]
            g = 1.0 if (t == 1 or self.A[b] == 0) else n / (self.A[b] + self.eps)
            dg = g / (sum(self.Q[b]) / len(self.Q[b]) + self.eps) if len(self.Q[b]) == self.delta else 1.0
            self.A[b] = self.A[b] + (n - self.A[b]) / t
            self.Q[b] = (self.Q[b] + [g])[-self.delta:]
            R.append(max(g / alpha, dg / self.beta))
            G.append(g), DG.append(dg)
        C = [b for b in range(self.U) if R[b] > 1 or self.Lock[b] > 0]   # Algorithm 2
        A = sorted(sorted(C, key=lambda b: (-R[b], b))[:self.max_o])
        for b in range(self.U):
            if b in A:
                self.Lock[b] = self.T_lock if R[b] > 1 else max(self.Lock[b] - 1, 0)
            else:
                self.Lock[b] = 0
        return tuple(A), np.array(G), np.array(DG), np.array(R)


def run_both(norm_seq, **kw):
    gc = GNMRConfig(**kw).check("int8")
    total = 1000
    ctl = Controller(gc, CFG, total)
    U = len(ctl.units)
    warm_steps = int(gc.warm * total) // 100        # consumed = 100 tokens per step below
    tr = Transcription(U, gc.alpha_init, gc.alpha, warm_steps, gc.beta, gc.max_o, gc.lock, gc.window, gc.eps)
    st = ctl.fresh()
    out = []
    for t, norms in enumerate(norm_seq):
        st, sc = ctl.update(st, np.asarray(norms, np.float32), consumed_after=100 * (t + 1) - 1)
        a, g, dg, r = tr.step([float(np.float32(x)) for x in norms])
        out.append((st, sc, a, g, dg, r, list(tr.Lock)))
    return ctl, out


def synthetic(seed, steps, U, spikes=()):
    rng = np.random.default_rng(seed)
    base = np.exp(rng.normal(0, 1, U))
    seq = base * np.exp(rng.normal(0, 0.15, (steps, U)))
    for t, b, f in spikes:
        seq[t, b] *= f
    return seq.astype(np.float32)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_the_transcription(seed):
    U = len(units(CFG, "op"))
    seq = synthetic(seed, 60, U, spikes=[(20, 3, 8.0), (21, 5, 4.0), (30, 0, 10.0), (31, 1, 10.0),
                                          (31, 2, 10.0), (31, 7, 10.0), (45, 9, 3.0)])
    _, out = run_both(seq, max_o=2, lock=3, window=5, alpha=2.0, alpha_init=4.0, warm=0.2, beta=1.8)
    n_active = 0
    for t, (st, sc, a, g, dg, r, locks) in enumerate(out):
        assert st.active == a, f"step {t}: active {st.active} vs transcription {a}"
        assert st.locks.tolist() == locks, f"step {t}: locks"
        # Tolerances against the float64 transcription (u = 2^-24): the fp32 running mean
        # A_t = A + (n - A)·r_t is a convex update, so its relative error obeys e_t <= (1 - 1/t) e_{t-1}
        # + 3u, i.e. e_t <= 1.5 (t + 1) u <= 5.5e-6 at t = 60; GNMR = n/(A + eps) adds 2u. The queue
        # mean of Δ-GNMR averages such values (tree fold of <= 5 terms, one multiply: 5u), and the
        # ratio and the threshold divisions add 2u more, so both stay below 1.2e-5 (2.5e-5 bound).
        np.testing.assert_allclose(sc["gnmr"], g, rtol=1e-5, err_msg=f"step {t} GNMR")
        np.testing.assert_allclose(sc["dgnmr"], dg, rtol=2.5e-5, err_msg=f"step {t} Δ-GNMR")
        np.testing.assert_allclose(sc["risk"], r, rtol=2.5e-5, err_msg=f"step {t} risk")
        assert len(st.active) <= 2
        n_active += len(st.active)
    assert n_active > 0                 # the spikes really trigger recovery


def test_budget_never_exceeded_and_ties_by_index():
    U = len(units(CFG, "op"))
    seq = np.ones((12, U), np.float32)
    seq[6] = 50.0                        # every unit spikes by the same factor: equal risks
    _, out = run_both(seq, max_o=3, lock=2, window=3, alpha=2.0, alpha_init=2.0, warm=0.0, beta=2.0)
    st = out[6][0]
    assert st.active == (0, 1, 2)        # ties broken by unit index
    assert all(len(o[0].active) <= 3 for o in out)


def test_dgnmr_is_one_until_the_queue_is_full():
    U = len(units(CFG, "op"))
    seq = synthetic(5, 8, U)
    _, out = run_both(seq, window=4)
    for t, o in enumerate(out):
        if t < 4:
            assert (o[1]["dgnmr"] == 1).all(), t
        else:
            assert not (o[1]["dgnmr"] == 1).all(), t
    assert (out[0][1]["gnmr"] == 1).all()          # GNMR_1 = 1


def test_locks_keep_a_unit_a_candidate_then_release():
    U = len(units(CFG, "op"))
    seq = np.ones((14, U), np.float32)
    seq[5, 4] = 20.0
    _, out = run_both(seq, max_o=2, lock=3, window=2, alpha=3.0, alpha_init=3.0, warm=0.0, beta=5.0)
    actives = [o[0].active for o in out]
    # step 5 selects unit 4 (risky, lock = 3); it stays for the next 3 steps as a locked candidate
    # (lock counts down 2, 1, 0), then leaves
    assert actives[5] == (4,)
    assert actives[6] == (4,) and actives[7] == (4,) and actives[8] == (4,)
    assert actives[9] == ()
    assert [o[0].locks[4] for o in out[5:10]] == [3, 2, 1, 0, 0]


def test_injected_spike_enters_the_active_set_next_step():
    U = len(units(CFG, "block"))
    seq = synthetic(7, 30, U, spikes=[(25, 1, 6.0)])
    gc = GNMRConfig(mode="block", max_o=1).check("int8")
    ctl = Controller(gc, CFG, 10 ** 9)
    st = ctl.fresh()
    for t, n in enumerate(seq):
        st, _ = ctl.update(st, n, 100 * t)
        if t == 24:
            assert st.active == ()
        if t == 25:
            assert st.active == (1,)
            assert ctl.paths(st) == {(1, "qkv"): "bf16", (1, "wo"): "bf16", (1, "gate_up"): "bf16",
                                     (1, "down"): "bf16", (1, "attn"): "bf16"}


def test_state_json_round_trip_is_exact():
    gc = GNMRConfig(window=3).check("int8")
    ctl = Controller(gc, CFG, 1000)
    st = ctl.fresh()
    for n in synthetic(1, 5, len(ctl.units), spikes=[(3, 2, 9.0)]):
        st, _ = ctl.update(st, n, 10)
    back = GNMRState.from_json(st.to_json(), len(ctl.units), 3)
    assert back.mean.view(np.uint32).tolist() == st.mean.view(np.uint32).tolist()
    assert back.queue.view(np.uint32).tolist() == st.queue.view(np.uint32).tolist()
    assert back.locks.tolist() == st.locks.tolist() and back.active == st.active
    with pytest.raises(GNMRError, match="gnmr state"):
        GNMRState.from_json(st.to_json(), len(ctl.units) + 1, 3)


def test_config_parse_and_errors():
    gc = GNMRConfig.parse("alpha=2.5, beta=1.5,maxO=3,lock=4,window=6,mode=block")
    assert (gc.alpha, gc.beta, gc.max_o, gc.lock, gc.window, gc.mode) == (2.5, 1.5, 3, 4, 6, "block")
    with pytest.raises(GNMRError, match="unknown key"):
        GNMRConfig.parse("gamma=1")
    with pytest.raises(GNMRError, match="not an integer"):
        GNMRConfig.parse("maxO=two")
    with pytest.raises(GNMRError, match="precision"):
        GNMRConfig().check("bf16")
    with pytest.raises(GNMRError, match="gnmr.high"):
        GNMRConfig(high="int8").check("int8")
    with pytest.raises(GNMRError, match="gnmr.mode"):
        GNMRConfig(mode="layer").check("int8")
    with pytest.raises(GNMRError, match="gnmr.window"):
        GNMRConfig(window=0).check("int8")


def test_unit_norms_are_global_norms_of_the_units_tensors():
    """From the global norm's own block partials, each unit's norm equals cpu_ref.global_norm over
    the unit's tensors, bit for bit."""
    from mlx_open1b import cpu_ref
    from mlx_open1b.model import ParamLayout
    layout = ParamLayout(CFG)
    g = (np.random.default_rng(0).standard_normal(layout.n_params) * 1e-2).astype(np.float32)
    parts = {t.name: cpu_ref.sumsq_blocks(g[t.offset:t.offset + t.size]) for t in layout}
    for mode in ("op", "block"):
        ctl = Controller(GNMRConfig(mode=mode).check("int8"), CFG, 1000)
        got = ctl.unit_norms(parts, cpu_ref)
        for i, (name, tensors, _) in enumerate(ctl.units):
            want = np.float32(cpu_ref.global_norm([g[layout[t].offset:layout[t].offset + layout[t].size]
                                                   for t in tensors]))
            assert got[i].view(np.uint32) == want.view(np.uint32), name


def test_unit_norms_of_host_partials_launch_nothing():
    """The step's partials are on the host: the units fold there (the C reference), so a device
    backend's ops are never called (no launch, no blocking read back per unit), and the norms are
    the C reference's bits."""
    from mlx_open1b import cpu_ref

    class NoDevice:
        def __getattr__(self, name):
            raise AssertionError(f"unit_norms called the device op {name}")

    rng = np.random.default_rng(1)
    ctl = Controller(GNMRConfig(mode="op").check("int8"), CFG, 1000)
    names = {t for _, tensors, _ in ctl.units for t in tensors}
    parts = {t: cpu_ref.sumsq_blocks((rng.standard_normal(300) * 1e-2).astype(np.float32)) for t in names}
    got = ctl.unit_norms(parts, NoDevice())
    want = ctl.unit_norms(parts, cpu_ref)
    assert got.dtype == np.float32 and got.shape == (len(ctl.units),)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
