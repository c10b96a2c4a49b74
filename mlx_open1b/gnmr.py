"""GNMR: runtime stability control for low-precision training (seed 004, Algorithms 1 and 2), in the
contract's arithmetic so that its decisions replay bit for bit (CONTRACT.md §13).

Units are the quantized GEMMs of each layer (mode "op": qkv, wo, gate_up, down) or whole layers
(mode "block": those four and the attention P·V product switch together). After step t's
backward, each unit's gradient norm n (a §7 global norm over the unit's tensors) gives

    GNMR = 1 on the controller's first update or while the running mean A is +0,
           else div(n, add(A, eps))
    ΔGNMR = 1 until the queue holds `window` values, else div(GNMR, add(mean(queue), eps)),
           mean = mul(treefold(queue, oldest first), reciprocal(window))
    A <- add(A, mul(sub(n, A), reciprocal(t)))      (t = 1, 2, ...: the controller's updates)
    queue <- queue + [GNMR], keeping the last `window`
    R = max(div(GNMR, alpha_t), div(ΔGNMR, beta))   (alpha_t = alpha_init in the first `warm`
                                                      fraction of the token budget, else alpha)

all fp32 with the contract's add/sub/mul/div (mlx_open1b.spec.arith: host numpy, flush included).
Candidates are {R > 1} ∪ {lock > 0}; the active set is the top max_o candidates by R (ties: lower
unit index first; a NaN R ranks above every number); locks per Algorithm 2. The active set chosen
after step t is the set of units on the recovery path in step t + 1's forward and backward.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .hostmath import f32, reciprocal
from .spec import arith
from .spec.optim import treefold

F32 = np.float32
OPS = ("qkv", "wo", "gate_up", "down")
UNIT_TENSORS = {"qkv": ("wq", "wk", "wv"), "wo": ("wo",), "gate_up": ("w_gate_up",), "down": ("w_down",)}
LAYER_TENSORS = ("attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate_up", "w_down")
HIGHER = {"int4": ("int8", "bf16"), "int6": ("int8", "bf16"), "int8": ("bf16",)}


def _f(default, help: str):
    """A field with help text, as config's (GNMRConfig is a part of RunConfig: config imports this
    module, not the other way)."""
    return dataclasses.field(default=default, metadata={"help": help})


class GNMRError(ValueError):
    """A GNMR configuration or state that cannot work; the message names the field."""


@dataclass(frozen=True)
class GNMRConfig:
    alpha: float = _f(3.0, "GNMR threshold after the warm stage (risk when GNMR/alpha > 1)")
    alpha_init: float = _f(6.0, "GNMR threshold in the warm stage (noisy early history)")
    warm: float = _f(0.1, "fraction of the token budget that uses alpha_init")
    beta: float = _f(2.0, "Δ-GNMR threshold")
    max_o: int = _f(2, "budget: at most this many units on the recovery path per step")
    lock: int = _f(5, "lock length T_lock, steps a selected risky unit stays a candidate")
    window: int = _f(10, "Δ-GNMR queue length δ")
    mode: str = _f("op", "unit granularity: op (each quantized GEMM) or block (each layer)")
    eps: float = _f(1e-8, "ε of the ratios")
    high: str = _f("bf16", "the recovery path (bf16, or int8 when the run's precision is int4 or int6)")

    def check(self, precision: str) -> "GNMRConfig":
        if precision not in HIGHER:
            raise GNMRError(f"gnmr: the run's precision {precision!r} has no cheaper path to recover from "
                            f"(GNMR needs precision int8, int6 or int4)")
        if self.high not in HIGHER[precision]:
            raise GNMRError(f"gnmr.high: {self.high!r} is not a recovery path for precision {precision} "
                            f"(choose {' or '.join(HIGHER[precision])})")
        if self.mode not in ("op", "block"):
            raise GNMRError(f"gnmr.mode: expected op or block, got {self.mode!r}")
        def real(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool)
        for name in ("alpha", "alpha_init", "beta", "eps"):
            v = getattr(self, name)
            # positive, finite and normal in fp32 (a subnormal would be flushed to +0 by the contract's add)
            if not (real(v) and v > 0 and np.isfinite(f32(v)) and f32(v) >= 2.0 ** -126):
                raise GNMRError(f"gnmr.{name}: expected a positive finite number (a normal fp32), got {v!r}")
        if not (real(self.warm) and 0 <= self.warm <= 1):
            raise GNMRError(f"gnmr.warm: expected a fraction in [0, 1], got {self.warm!r}")
        for name, lo in (("max_o", 0), ("lock", 0), ("window", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise GNMRError(f"gnmr.{name}: expected an integer >= {lo}, got {v!r}")
        return self

    @classmethod
    def parse(cls, text: str) -> "GNMRConfig":
        """From the CLI form `alpha=3,beta=2,maxO=2,lock=5,window=10,mode=op` (any subset)."""
        names = {f.name: f for f in dataclasses.fields(cls)}
        alias = {"maxo": "max_o", "max_o": "max_o", "alpha_init": "alpha_init", "alpha-init": "alpha_init",
                 "t_lock": "lock"}
        kw = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            if "=" not in part:
                raise GNMRError(f"--gnmr: {part!r} is not key=value (keys: {', '.join(names)})")
            k, v = (s.strip() for s in part.split("=", 1))
            k = alias.get(k.lower(), k.lower())
            if k not in names:
                raise GNMRError(f"--gnmr: unknown key {k!r} (keys: {', '.join(names)})")
            if k in kw:
                raise GNMRError(f"--gnmr: {k} given twice")
            typ = type(names[k].default)
            try:
                kw[k] = v if typ is str else typ(v)
            except ValueError:
                raise GNMRError(f"--gnmr: {k}={v!r} is not {'an integer' if typ is int else 'a number'}") from None
        return cls(**kw)


def units(model_cfg, mode: str) -> list[tuple[str, tuple[str, ...], list[tuple[int, str]]]]:
    """(unit name, its parameter tensors in buffer order, the model units it switches) per unit,
    in unit-index order (layer-major; ops in OPS order)."""
    out = []
    for l in range(model_cfg.n_layers):
        p = f"layers.{l}."
        if mode == "block":
            out.append((f"layers.{l}", tuple(p + t for t in LAYER_TENSORS),
                        [(l, op) for op in OPS] + [(l, "attn")]))
        else:
            out += [(p + op, tuple(p + t for t in UNIT_TENSORS[op]), [(l, op)]) for op in OPS]
    return out


@dataclass
class GNMRState:
    """Everything the controller carries from step to step (checkpointed and hashed)."""
    t: int                       # updates so far
    mean: np.ndarray             # (U,) f32 running means A
    queue: np.ndarray            # (U, window) f32, oldest first; the first `filled` columns valid
    locks: np.ndarray            # (U,) int64
    active: tuple = ()           # unit indices on the recovery path in the next step

    @property
    def filled(self) -> int:
        """Values in each queue (the same for every unit): one per update, at most the window."""
        return min(self.t, self.queue.shape[1])

    @classmethod
    def fresh(cls, n_units: int, window: int) -> "GNMRState":
        return cls(0, np.zeros(n_units, F32), np.zeros((n_units, window), F32), np.zeros(n_units, np.int64), ())

    def to_json(self) -> dict:
        """Exact: fp32 values as their bit patterns."""
        return {"t": self.t, "mean": self.mean.view(np.uint32).tolist(),
                "queue": self.queue.view(np.uint32).tolist(), "filled": self.filled,
                "locks": self.locks.tolist(), "active": list(self.active)}

    @classmethod
    def from_json(cls, d: dict, n_units: int, window: int) -> "GNMRState":
        try:
            st = cls(int(d["t"]), np.array(d["mean"], np.uint32).view(F32),
                     np.array(d["queue"], np.uint32).reshape(n_units, window).view(F32),
                     np.array(d["locks"], np.int64), tuple(int(i) for i in d["active"]))
            filled = int(d["filled"])
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise GNMRError(f"gnmr state: malformed ({type(e).__name__}: {e})") from None
        if st.mean.shape != (n_units,) or st.locks.shape != (n_units,) or any(not 0 <= i < n_units for i in st.active):
            raise GNMRError(f"gnmr state: shapes do not match {n_units} units and window {window}")
        if st.t < 0 or filled != st.filled or list(st.active) != sorted(set(st.active)) or (st.locks < 0).any():
            raise GNMRError(f"gnmr state: inconsistent (t {st.t}, filled {filled}, active {list(st.active)}, "
                            f"locks {st.locks.tolist()})")
        return st

    def hash_items(self):
        """(name, array, dtype) items for hashing.collection_hash."""
        active = np.zeros(len(self.locks), np.int64)
        active[list(self.active)] = 1
        return [("t", np.array([self.t, self.filled], np.int64), "i64"), ("mean", self.mean, "f32"),
                ("queue", np.ascontiguousarray(self.queue), "f32"), ("locks", self.locks, "i64"),
                ("active", active, "i64")]


class Controller:
    """Algorithms 1 and 2 over the units of one model."""

    def __init__(self, cfg: GNMRConfig, model_cfg, total_tokens: int):
        self.cfg, self.units = cfg, units(model_cfg, cfg.mode)
        self.total_tokens = total_tokens
        self.eps, self.beta = F32(f32(cfg.eps)), F32(f32(cfg.beta))
        self.alphas = (F32(f32(cfg.alpha_init)), F32(f32(cfg.alpha)))
        self.r_window = F32(reciprocal(cfg.window))

    @property
    def names(self) -> list[str]:
        return [u[0] for u in self.units]

    def fresh(self) -> GNMRState:
        return GNMRState.fresh(len(self.units), self.cfg.window)

    def alpha_at(self, consumed_after: int) -> np.float32:
        """Two-stage threshold: alpha_init while consumed tokens < warm * total_tokens."""
        return self.alphas[0] if consumed_after < self.cfg.warm * self.total_tokens else self.alphas[1]

    def unit_norms(self, partials: dict, ops) -> np.ndarray:
        """(U,) f32: each unit's §7 global norm over its tensors (buffer order), from the tensors'
        sum-of-squares block partials {name: ops.sumsq_blocks(grad)} (the global norm's own). The
        step's partials are on the host (one transfer for all tensors), so each unit folds there with
        the C reference, as the global norm does: the contract's treefold and sqrt, the same bits as
        ops', without two launches and a blocking read back per unit."""
        from .step import norm_from_partials
        return np.array([norm_from_partials([partials[t] for t in tensors], ops) for _, tensors, _ in self.units],
                        F32).reshape(len(self.units))

    def update(self, st: GNMRState, norms: np.ndarray, consumed_after: int) -> tuple[GNMRState, dict]:
        """One step of Algorithms 1-2: the new state (whose `active` applies to the next step) and
        the step's scores {"gnmr", "dgnmr", "risk"} (U,) f32."""
        U, cfg = len(self.units), self.cfg
        n = np.asarray(norms, F32)
        if n.shape != (U,):
            raise GNMRError(f"gnmr: expected {U} unit norms, got shape {n.shape}")
        t = st.t + 1
        first = (t == 1) | (st.mean == 0)
        g = np.where(first, F32(1), arith.div(n, arith.add(st.mean, self.eps))).astype(F32)
        if st.filled == cfg.window:
            qmean = np.array([arith.mul(treefold(st.queue[b]), self.r_window) for b in range(U)], F32)
            dg = arith.div(g, arith.add(qmean, self.eps))
        else:
            dg = np.ones(U, F32)
        mean = arith.add(st.mean, arith.mul(arith.sub(n, st.mean), F32(reciprocal(t))))
        if st.filled == cfg.window:
            queue = np.concatenate([st.queue[:, 1:], g[:, None]], axis=1)
        else:
            queue = st.queue.copy()
            queue[:, st.filled] = g
        risk = arith.maximum(arith.div(g, self.alpha_at(consumed_after)), arith.div(dg, self.beta))
        locks = st.locks.copy()
        cand = [b for b in range(U) if not (risk[b] <= 1) or locks[b] > 0]     # NaN counts as risky
        key = lambda b: (0, 0.0, b) if np.isnan(risk[b]) else (1, -float(risk[b]), b)
        active = tuple(sorted(sorted(cand, key=key)[:cfg.max_o]))
        for b in range(U):
            if b in active:
                locks[b] = cfg.lock if not (risk[b] <= 1) else max(locks[b] - 1, 0)
            else:
                locks[b] = 0
        new = GNMRState(t, mean.astype(F32), queue.astype(F32), locks, active)
        return new, {"gnmr": g, "dgnmr": dg.astype(F32), "risk": risk.astype(F32)}

    def paths(self, st: GNMRState) -> dict[tuple[int, str], str]:
        """The model's set_paths argument for the units in st.active."""
        return {mu: self.cfg.high for b in st.active for mu in self.units[b][2]}
