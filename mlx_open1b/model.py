"""The Open-1B model program (paper §3.1): explicit forward and backward of one microbatch.

Written once against the backend op interface (`ops`: today the C reference
`mlx_open1b.cpu_ref`; the Metal and CUDA backends export the same function names), llm.c style:
every activation the backward needs is kept in a cache, every gradient is `d`-prefixed, and every
sum is one the contract defines. No autograd: the backward below *is* the definition of the
gradient's bits.

Dimension letters: B windows in the microbatch, T = seq_len, N = B*T rows, d model width,
H query heads, G key/value heads, D head dim, F FFN hidden size, V vocabulary.

The architecture: untied embeddings; RMSNorm on the embedding output; per layer a pre-norm
attention block (grouped-query, gain-free QK-norm per head, RoPE, causal with a sliding window on
local layers) and a pre-norm SwiGLU block (gate and up one GEMM); a final RMSNorm; the LM head
fused with cross-entropy and z-loss. No biases.

Every parameter lives in one contiguous bf16 buffer in the canonical order of
`ModelConfig.param_shapes()`; the gradient is one fp32 buffer with the same layout.

Array kinds (mlx_open1b.arrays): the program works in the kind of the parameter buffer it is
given — numpy, or the backend's device arrays (`ops.to_device`: mx.array for metal, cupy for
cuda). With device params every activation, cache entry and gradient stays on the device; only
token ids go up (checked on the host first, so no op reads them back) and the per-row losses come
down, in one transfer per microbatch. On a device with memory of its own (cupy)
the cache does not keep the SwiGLU input: the backward recomputes it (recompute_gate_up). Host-side steps are data movement only
(slices, reshapes, joins) or contract ops of the C reference (the means' folds), so the kind never
changes a bit.

Choices that decide bits (everything else is the ops' own contract):
- wq, wk, wv are adjacent in the buffer, so they are used as one ((H+2G)·D, d) matrix: one GEMM
  forward (each output element is the same dot product as with three GEMMs) and one GEMM
  backward, whose da sums over all q, k and v outputs in one accumulator (m ascending) instead of
  three GEMMs and two adds.
- Residual adds: h_next = add(h, branch) elementwise (the running stream on the left). In the
  backward the branch's gradient is added to the running gradient dh (dh on the left).
- bf16 roundings (activations entering a GEMM in the forward, gradients entering a GEMM in the
  backward) are treated as the identity in the backward (straight-through).
- Means are mul(treefold(rows), reciprocal(N)) (CONTRACT.md §7, §8); dloss is reciprocal(N) in
  every row.
- precision "int8" (CONTRACT.md §6.9): the QKV, wo, w_gate_up and w_down GEMMs are
  qlinear_forward / qlinear_backward on the same bf16 operands the bf16 path gives
  linear_forward / linear_backward (the layer quantizes inside); the attention forward is
  attention_forward_i8 (CONTRACT.md §6.10: the P·V product of each key block in int8) and its
  backward is the bf16 path's (straight-through, on that forward's o and lse); embedding, LM head,
  norms, RoPE and loss are unchanged, and so is the cache. The fused QKV forward equals three
  separate quantized GEMMs (weight step sizes are per output row, computed from that row alone;
  the activation scale is one per-tensor absmax of the same a_b). Its backward is one
  qlinear_backward on the fused ((H+2G)·D, d) matrix — not three: the dx path rotates and
  quantizes dy·s_w over all (H+2G)·D outputs as one tensor, and the dW path quantizes dy as one
  tensor, so the fused call is the definition (as the fused bf16 backward is).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np

from . import arrays, cpu_ref, opargs
from .config import ModelConfig
from .contract import QMAX4, QMAX6, STREAM_INIT
from .hostmath import f32, reciprocal
from .spec import arith

BF16_ONE = 0x3F80          # bf16 bits of 1.0: every norm gain starts here
_INIT_CHUNK = 1 << 22      # elements per trunc_normal call in init_params (memory only; no bits)


# ------------------------------------------------------------------------------- parameters
@dataclass(frozen=True)
class TensorSpec:
    name: str
    offset: int            # element offset in the flat buffer
    shape: tuple
    decayed: bool          # weight decay applies (linear layers and the LM head)

    @property
    def size(self) -> int:
        return math.prod(self.shape)


class ParamLayout:
    """Offsets of every tensor in the flat parameter buffer, in cfg.param_shapes() order."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        specs, off = [], 0
        for name, shape, decayed in cfg.param_shapes():
            specs.append(TensorSpec(name, off, tuple(shape), decayed))
            off += math.prod(shape)
        self.tensors: tuple[TensorSpec, ...] = tuple(specs)
        self.n_params = off
        self._by_name = {t.name: t for t in specs}
        for l in range(cfg.n_layers):    # the fused QKV view relies on this adjacency
            q, k, v = (self[f"layers.{l}.{w}"] for w in ("wq", "wk", "wv"))
            assert q.offset + q.size == k.offset and k.offset + k.size == v.offset

    def __getitem__(self, name: str) -> TensorSpec:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no parameter tensor named {name!r}") from None

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def qkv_range(self, layer: int) -> tuple[int, int]:
        """[lo, hi) of layer's wq, wk, wv together: one ((H+2G)·D, d) matrix."""
        lo = self[f"layers.{layer}.wq"].offset
        v = self[f"layers.{layer}.wv"]
        return lo, v.offset + v.size


def views(buf, layout: ParamLayout) -> dict:
    """name -> reshaped view into buf (the bf16 params, or an fp32 gradient or moment buffer; for
    mx.arrays the slices are lazy copies)."""
    _check_flat("buf", buf, None, layout.n_params)
    return {t.name: buf[t.offset:t.offset + t.size].reshape(t.shape) for t in layout}


def init_params(cfg: ModelConfig, seed: int, ops=cpu_ref, lo: int = 0, hi: int | None = None) -> np.ndarray:
    """The initial bf16 parameter buffer (n_params,) uint16, or its elements [lo, hi) (hi - lo,)
    alone. Every matrix element i is bf16(trunc_normal(seed, STREAM_INIT, index i,
    sigma=cfg.init_sigma)), i its offset in the buffer; every norm gain is 1.0. Element i is a pure
    function of (seed, i), so any range is the same bits as that slice of the whole buffer: each
    worker of a run initializes only the range it owns."""
    layout = ParamLayout(cfg)
    P = layout.n_params
    hi = P if hi is None else int(hi)
    lo = int(lo)
    if not 0 <= lo <= hi <= P:
        raise ValueError(f"init_params: range [{lo}, {hi}) is not inside the {P} parameters")
    buf = np.empty(hi - lo, np.uint16)
    for t in layout:
        a, b = max(lo, t.offset), min(hi, t.offset + t.size)
        if a >= b:
            continue
        if len(t.shape) == 1:
            buf[a - lo:b - lo] = BF16_ONE
            continue
        for c in range(a, b, _INIT_CHUNK):
            n = min(_INIT_CHUNK, b - c)
            buf[c - lo:c - lo + n] = ops.f32_to_bf16(ops.trunc_normal(seed, STREAM_INIT, c, n, cfg.init_sigma))
    return buf


def _check_flat(name: str, a, dtype, n: int) -> None:
    if not arrays.is_array(a):
        raise ValueError(f"{name}: expected an array (numpy, mx.array or cupy), got {type(a).__name__}")
    if dtype is not None and arrays.dtype(a) != dtype:
        raise ValueError(f"{name}: expected dtype {np.dtype(dtype)} (bf16 is held as uint16), got {arrays.dtype(a)}")
    if tuple(a.shape) != (n,):
        raise ValueError(f"{name}: expected shape ({n},) (the flat parameter buffer), got {a.shape}")
    if not arrays.c_contiguous(a):
        raise ValueError(f"{name}: must be C-contiguous")


# ----------------------------------------------------------------------------------- cache
@dataclass
class LayerCache:
    """What one block's backward reads (N = B*T rows)."""
    h_in: np.ndarray       # (N, d) fp32   residual stream entering the block (attn_norm's x)
    rstd_attn: np.ndarray  # (N,) fp32
    a_b: np.ndarray        # (N, d) bf16   attn_norm output, the QKV GEMM's input
    q_pre: np.ndarray      # (N*H, D) fp32 q before QK-norm
    rstd_q: np.ndarray     # (N*H,) fp32
    k_pre: np.ndarray      # (N*G, D) fp32 k before QK-norm
    rstd_k: np.ndarray     # (N*G,) fp32
    q_b: np.ndarray        # (B, T, H, D) bf16  after QK-norm and RoPE
    k_b: np.ndarray        # (B, T, G, D) bf16  after QK-norm and RoPE
    v_b: np.ndarray        # (B, T, G, D) bf16
    o: np.ndarray          # (B, T, H, D) fp32  attention output
    lse: np.ndarray        # (B, H, T) fp32     attention logsumexp
    o_b: np.ndarray        # (N, H*D) bf16      wo's input
    h_mid: np.ndarray      # (N, d) fp32   stream after the attention residual (ffn_norm's x)
    rstd_ffn: np.ndarray   # (N,) fp32
    f_b: np.ndarray        # (N, d) bf16   ffn_norm output, w_gate_up's input
    gu: np.ndarray | None  # (N, 2F) fp32  [gate | up], swiglu's input (None: the backward recomputes it)
    s_b: np.ndarray        # (N, F) bf16   swiglu output, w_down's input


@dataclass
class Cache:
    """Everything the backward of one microbatch reads; the params are passed again."""
    B: int
    T: int
    inputs: np.ndarray     # (N,) int32    token ids
    targets: np.ndarray    # (N,) int32    next-token ids
    x0: np.ndarray | None = None        # (N, d) fp32 embedding rows (emb_norm's x)
    rstd_emb: np.ndarray | None = None  # (N,) fp32
    layers: list = field(default_factory=list)   # LayerCache per block (the block's input with recompute_blocks)
    h_last: np.ndarray | None = None   # (N, d) fp32 stream after the last block (final_norm's x)
    rstd_final: np.ndarray | None = None  # (N,) fp32
    hn_b: np.ndarray | None = None     # (N, d) bf16 final_norm output, the LM head's input
    lse: np.ndarray | None = None      # (N,) fp32  logsumexp of the logits (xent)
    xent_saved: object = None          # what xent_forward(keep=True) kept for the backward (None: nothing)
    ids: tuple = ()    # (inputs, targets) on the host, checked by Model._split: no op reads ids back


# --------------------------------------------------------------------------------- program
class Model:
    """The model program on one backend. forward/backward work on one microbatch of windows
    (B, seq_len + 1) uint32; params is the flat bf16 buffer (n_params,) uint16."""

    def __init__(self, cfg: ModelConfig, ops=cpu_ref, precision: str = "bf16", attention_pv: str = "int8",
                 recompute_gate_up: bool | None = None, recompute_blocks: bool = False):
        cfg.check()
        if precision not in ("bf16", "int8", "int6", "int4"):
            raise ValueError(f"precision: expected 'bf16', 'int8', 'int6' or 'int4', got {precision!r}")
        self.cfg, self.ops, self.precision = cfg, ops, precision
        if attention_pv not in ("int8", "fp32"):
            raise ValueError(f"attention_pv: expected 'int8' (CONTRACT.md §6.10) or 'fp32' (§6.6), got {attention_pv!r}")
        # the linear layer of the Q/K/V/O and FFN GEMMs: §6.1 (bf16) or §6.9 (int8), same operands;
        # per unit (layer, op) overridable by a controller (GNMR) through set_paths. The quantized
        # paths' attention forward: §6.10's int8 P·V, or §6.6 for runs started before it
        attn_q = ops.attention_forward_i8 if attention_pv == "int8" else ops.attention_forward
        self._impl = {"bf16": (ops.linear_forward, ops.linear_backward, ops.attention_forward),
                      "int8": (ops.qlinear_forward, ops.qlinear_backward, attn_q)}
        # the simulated int4 / int6 paths (§6.9): GNMR's low-cost stress paths; attention keeps §6.10
        for name, qm in (("int4", QMAX4), ("int6", QMAX6)):
            self._impl[name] = (functools.partial(ops.qlinear_forward, qmax=qm),
                                functools.partial(ops.qlinear_backward, qmax=qm), ops.attention_forward_i8)
        self.paths: dict[tuple[int, str], str] = {}
        # the SwiGLU input gu (N, 2F) fp32, the largest cache entry (41% of it at the open1b preset),
        # is recomputed in the backward by the forward's GEMM on the same operands (the same bits)
        # instead of kept: True, False, or None: where the params are on a device with memory of its
        # own (cupy), whose memory bounds what fits
        self.recompute_gate_up = recompute_gate_up
        # per-block recomputation: the forward keeps each block's input alone and the backward runs
        # that block's forward again for its cache (the same kernels on the same operands: the same
        # bits), one block's cache live at a time instead of every block's
        self.recompute_blocks = bool(recompute_blocks)
        self.layout = ParamLayout(cfg)
        self.n_params = self.layout.n_params
        # host scalars, each rounded once to fp32 (CONTRACT.md §8)
        self.eps = f32(cfg.norm_eps)
        self.zcoef = f32(cfg.z_loss)
        self.attn_scale = f32(1.0 / math.sqrt(cfg.head_dim))   # binary64 sqrt and / correctly rounded
        self.rope_cos, self.rope_sin = ops.rope_tables(cfg.seq_len, cfg.head_dim, cfg.rope_theta)  # (T, D/2)
        self.windows = [cfg.layer_window(l) for l in range(cfg.n_layers)]
        self._kind = arrays.NUMPY        # the kind of the params of the current call (_put)
        self._tables = {arrays.NUMPY: (self.rope_cos, self.rope_sin)}
        # where numpy gradient buffers come from: an arrays.BufferPool that the trainer gives spent
        # ones back to (its fold's consumed operands), or None: a new buffer per backward
        self.grad_buffers: arrays.BufferPool | None = None

    def _put(self, a: np.ndarray):
        """Host data (token ids, dloss) in the kind of the current call's params."""
        return a if self._kind == arrays.NUMPY else self.ops.to_device(a)

    def _rope(self):
        """The RoPE tables in the current kind (moved to the device once)."""
        t = self._tables.get(self._kind)
        if t is None:
            t = self._tables[self._kind] = (self._put(self.rope_cos), self._put(self.rope_sin))
        return t

    UNIT_OPS = ("qkv", "wo", "gate_up", "down", "attn")

    def set_paths(self, paths: dict[tuple[int, str], str] | None) -> None:
        """Override the precision of single units: {(layer, op): path}, op one of UNIT_OPS (attn is
        the attention forward's P·V product), path one of the backend's paths; units not named run
        at the model's precision. The next forward and backward use it."""
        paths = dict(paths or {})
        for (l, op), path in paths.items():
            if not (0 <= l < self.cfg.n_layers) or op not in self.UNIT_OPS:
                raise ValueError(f"set_paths: unknown unit ({l}, {op!r})")
            if path not in self._impl:
                raise ValueError(f"set_paths: unit ({l}, {op}): unknown path {path!r} (have {sorted(self._impl)})")
        self.paths = paths

    def _path(self, l: int, op: str):
        return self._impl[self.paths.get((l, op), self.precision)]

    def _linear_forward(self, l, op, x, w):
        return self._path(l, op)[0](x, w)

    def _linear_backward(self, l, op, dy, x, w, grads: "_Grads", offset: int):
        """dx; dw goes into grads at offset (the kernel writes it there where grads is a numpy buffer)."""
        out = grads.slot(offset, tuple(w.shape))
        dx, dw = self._path(l, op)[1](dy, x, w, dw_out=out)
        grads.settle(offset, dw, out)
        return dx

    # ---- public API
    def forward(self, params: np.ndarray, windows: np.ndarray):
        """-> (loss, ce, zl, cache): the microbatch means of loss = ce + z-term, of ce and of the
        z-term (Python floats holding fp32 values), and the cache for backward."""
        self._check_params(params)
        inputs_h, targets_h, B = self._split(windows)
        inputs, targets = self._put(inputs_h), self._put(targets_h)
        cache = Cache(B, self.cfg.seq_len, inputs, targets, ids=(inputs_h, targets_h))
        with self._checked_ids(cache):
            loss_n, lse_n, ce_n = self._forward(params, inputs, targets, B, cache)
        return (*self._means(loss_n, lse_n, ce_n), cache)

    def backward(self, params: np.ndarray, cache: Cache) -> np.ndarray:
        """The gradient of forward's loss: fp32 (n_params,) in the parameter layout. params must
        be the buffer forward saw (the cache holds activations, not parameters)."""
        self._check_params(params)
        if not isinstance(cache, Cache) or cache.lse is None:
            raise ValueError("cache: expected the Cache returned by Model.forward")
        with self._checked_ids(cache):
            return self._backward(params, cache)

    def loss_and_grad(self, params: np.ndarray, windows: np.ndarray):
        """-> (loss, ce, zl, grads fp32 (n_params,))."""
        loss, ce, zl, cache = self.forward(params, windows)
        with self._checked_ids(cache):
            return loss, ce, zl, self._backward(params, cache)

    def eval_loss(self, params: np.ndarray, windows: np.ndarray, batch: int | None = None) -> np.ndarray:
        """Per-window mean cross-entropy (B,) fp32, forward only, nothing cached. In bf16 every op is
        row-independent, so a window's value does not depend on `batch` (windows per forward); in
        int8 the activation scales are per tensor (CONTRACT.md §6.9), so it does: callers that must
        reproduce a value keep the batching (the trainer evaluates each source as one batch)."""
        self._check_params(params)
        inputs, targets, B = self._split(windows)
        T = self.cfg.seq_len
        step = B if batch is None else int(batch)
        if step < 1:
            raise ValueError(f"batch: expected a positive number of windows, got {batch!r}")
        r = reciprocal(T)
        out = np.empty(B, np.float32)
        for b0 in range(0, B, step):
            nb = min(step, B - b0)
            rows = slice(b0 * T, (b0 + nb) * T)
            ids = (self._put(inputs[rows]), self._put(targets[rows]))
            with opargs.checked_ids(self.cfg.vocab_size, (ids[0], inputs[rows]), (ids[1], targets[rows])):
                _, _, ce_n = self._forward(params, *ids, nb, None)
            ce_h = arrays.to_host(ce_n)          # one transfer; the means on the host (same contract ops)
            for i in range(nb):
                out[b0 + i] = cpu_ref.scalar_mul(cpu_ref.treefold(ce_h[i * T:(i + 1) * T]), r)
        return out

    # ---- input checks
    def _check_params(self, params) -> None:
        _check_flat("params", params, np.uint16, self.n_params)
        self._kind = arrays.kind(params)

    def _split(self, windows):
        """windows (B, T+1) uint32 -> inputs (N,) int32, targets (N,) int32, B."""
        L, V = self.cfg.seq_len + 1, self.cfg.vocab_size
        if not isinstance(windows, np.ndarray):
            raise ValueError(f"windows: expected a numpy array, got {type(windows).__name__}")
        if windows.dtype != np.uint32:
            raise ValueError(f"windows: expected dtype uint32 (token ids), got {windows.dtype}")
        if windows.ndim != 2 or windows.shape[0] < 1 or windows.shape[1] != L:
            raise ValueError(f"windows: expected shape (B, {L}) with B >= 1 (seq_len + 1 = {L} tokens "
                             f"per window), got {windows.shape}")
        bad = np.argwhere(windows >= V)
        if bad.size:
            b, t = (int(i) for i in bad[0])
            raise ValueError(f"windows: token id {int(windows[b, t])} at [{b}, {t}] is outside the "
                             f"vocabulary [0, {V}) ({len(bad)} such ids)")
        w = windows.astype(np.int32)
        return (np.ascontiguousarray(w[:, :-1]).reshape(-1), np.ascontiguousarray(w[:, 1:]).reshape(-1),
                windows.shape[0])

    def _checked_ids(self, cache: Cache):
        """Around the ops of a microbatch: its token ids count as checked (by _split, on the host),
        so no op reads them back from the device."""
        V = self.cfg.vocab_size
        return opargs.checked_ids(V, *zip((cache.inputs, cache.targets), cache.ids))

    # ---- forward
    def _means(self, loss_n, lse_n, ce_n):
        """Microbatch means: mul(treefold(rows), 1/N). The z-term rows are recomputed on the host
        exactly as xent defines them, zl = mul(zcoef, mul(lse, lse)) (for logging). The three row
        arrays come to the host in one transfer and the folds run there (the C reference's treefold
        and scalar_mul: the contract's ops, so the same bits as the backend's, without a blocking
        read per fold)."""
        N, r = loss_n.size, reciprocal(loss_n.size)
        rows = arrays.to_host(arrays.concat([loss_n, ce_n, lse_n]))
        loss_h, ce_h, lse_h = rows[:N], rows[N:2 * N], rows[2 * N:]
        zl_n = arith.mul(np.float32(self.zcoef), arith.mul(lse_h, lse_h))
        return tuple(float(cpu_ref.scalar_mul(cpu_ref.treefold(np.ascontiguousarray(x)), r))
                     for x in (loss_h, ce_h, zl_n))

    def _forward(self, params, inputs, targets, B, cache: Cache | None):
        """-> loss_n, lse_n, ce_n (N,) fp32; fills cache when one is given."""
        ops, cfg, eps = self.ops, self.cfg, self.eps
        self._kind = arrays.kind(params)
        w = views(params, self.layout)
        x0 = ops.embedding_forward(inputs, w["wte"])                    # (N, d)
        h, rstd_emb = ops.rmsnorm_forward(x0, w["emb_norm"], eps)      # (N, d), (N,)
        keep = cache is not None and not self.recompute_blocks
        for l in range(cfg.n_layers):
            if cache is not None and not keep:
                cache.layers.append(h)             # (N, d) fp32 the block's input: _backward recomputes the rest
            lc = {} if keep else None
            h = self._block_forward(l, params, w, h, B, lc)
            if keep:
                cache.layers.append(LayerCache(**lc))
        hn_b, rstd_final = ops.rmsnorm_forward(h, w["final_norm"], eps, bf16_out=True)  # (N, d) bf16
        if cache is None:
            loss_n, lse_n, ce_n = ops.xent_forward(hn_b, w["lm_head"], targets, self.zcoef)  # (N,) each
        else:       # a training forward: the backend may keep the logits for the backward
            loss_n, lse_n, ce_n, cache.xent_saved = ops.xent_forward(hn_b, w["lm_head"], targets,
                                                                     self.zcoef, keep=True)
        if cache is not None:
            cache.x0, cache.rstd_emb = x0, rstd_emb
            cache.h_last, cache.rstd_final, cache.hn_b, cache.lse = h, rstd_final, hn_b, lse_n
        return loss_n, lse_n, ce_n

    def _block_forward(self, l, params, w, h, B, lc: dict | None, recompute_gu: bool | None = None):
        """One transformer block: h (N, d) fp32 -> h (N, d) fp32 (a new array). lc: filled with the
        block's cache; its gu kept or not by recompute_gu (None: the model's rule)."""
        ops, cfg, eps = self.ops, self.cfg, self.eps
        p = f"layers.{l}."
        N, d = h.shape
        T, H, G, D = cfg.seq_len, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        lo, hi = self.layout.qkv_range(l)
        w_qkv = params[lo:hi].reshape((H + 2 * G) * D, d)
        cos_t, sin_t = self._rope()
        # attention: h_mid = h + wo(attn(rope(qknorm(q)), rope(qknorm(k)), v))
        a_b, rstd_attn = ops.rmsnorm_forward(h, w[p + "attn_norm"], eps, bf16_out=True)   # (N, d) bf16
        qkv = self._linear_forward(l, "qkv", a_b, w_qkv)                             # (N, (H+2G)D)
        q_pre = arrays.contiguous(qkv[:, :H * D]).reshape(N * H, D)
        k_pre = arrays.contiguous(qkv[:, H * D:(H + G) * D]).reshape(N * G, D)
        v = arrays.contiguous(qkv[:, (H + G) * D:]).reshape(B, T, G, D)
        qn, rstd_q = ops.rmsnorm_forward(q_pre, None, eps)                # QK-norm, gain-free
        kn, rstd_k = ops.rmsnorm_forward(k_pre, None, eps)
        q_b = ops.f32_to_bf16(ops.rope_forward(qn.reshape(B, T, H, D), cos_t, sin_t))
        k_b = ops.f32_to_bf16(ops.rope_forward(kn.reshape(B, T, G, D), cos_t, sin_t))
        v_b = ops.f32_to_bf16(v)
        o, lse = self._path(l, "attn")[2](q_b, k_b, v_b, self.windows[l], self.attn_scale)  # (B,T,H,D), (B,H,T)
        o_b = ops.f32_to_bf16(o.reshape(N, H * D))
        h_mid = ops.add(h, self._linear_forward(l, "wo", o_b, w[p + "wo"]))        # (N, d)
        # SwiGLU: h_out = h_mid + w_down(silu(gate) * up)
        f_b, rstd_ffn = ops.rmsnorm_forward(h_mid, w[p + "ffn_norm"], eps, bf16_out=True)   # (N, d) bf16
        gu = self._linear_forward(l, "gate_up", f_b, w[p + "w_gate_up"])                 # (N, 2F)
        s_b = ops.swiglu_forward(gu, bf16_out=True)                      # (N, F) bf16
        h_out = ops.add(h_mid, self._linear_forward(l, "down", s_b, w[p + "w_down"]))  # (N, d)
        if lc is not None:
            recompute = self.recompute_gate_up if recompute_gu is None else recompute_gu
            if recompute is None:
                recompute = arrays.own_memory(params)
            lc.update(h_in=h, rstd_attn=rstd_attn, a_b=a_b, q_pre=q_pre, rstd_q=rstd_q, k_pre=k_pre,
                      rstd_k=rstd_k, q_b=q_b, k_b=k_b, v_b=v_b, o=o, lse=lse, o_b=o_b, h_mid=h_mid,
                      rstd_ffn=rstd_ffn, f_b=f_b, gu=None if recompute else gu, s_b=s_b)
        return h_out

    # ---- backward
    def _backward(self, params, c: Cache):
        ops, cfg = self.ops, self.cfg
        self._kind = arrays.kind(params)
        w = views(params, self.layout)
        grads = _Grads(self.layout, self._kind, self.grad_buffers)    # every element is written below, exactly once
        N = c.B * c.T
        dloss = self._put(np.full(N, reciprocal(N), np.float32))       # d(mean)/d(loss row)
        saved, c.xent_saved = c.xent_saved, None    # used once, and released before the blocks' backward
        out = grads.slot_of("lm_head")              # (V, d): written in place where grads is numpy
        dhn, dlm = ops.xent_backward(c.hn_b, w["lm_head"], c.targets, self.zcoef, c.lse, dloss, saved=saved,
                                     dw_out=out)                                       # (N, d), (V, d)
        grads.settle(grads.at("lm_head"), dlm, out)
        del dlm                                     # a device backend's copy: not held through the blocks
        del saved
        dh, grads["final_norm"] = ops.rmsnorm_backward(dhn, c.h_last, w["final_norm"], c.rstd_final)
        for l in reversed(range(cfg.n_layers)):
            lc = c.layers[l]
            if not isinstance(lc, LayerCache):    # the block's input alone (recompute_blocks)
                got = {}
                self._block_forward(l, params, w, lc, c.B, got, recompute_gu=False)   # one block's gu: kept
                lc = LayerCache(**got)
            dh = self._block_backward(l, params, w, grads, dh, lc, c.B)
            del lc
        dx0, grads["emb_norm"] = ops.rmsnorm_backward(dh, c.x0, w["emb_norm"], c.rstd_emb)  # (N, d)
        out = grads.slot_of("wte")
        grads.settle(grads.at("wte"), ops.embedding_backward(c.inputs, dx0, cfg.vocab_size, dw_out=out), out)  # (V, d)
        return grads.result()

    def _block_backward(self, l, params, w, dw, dh, lc: LayerCache, B):
        """dh (N, d) = dL/d(block output) -> dL/d(block input); writes the block's gradients."""
        ops, cfg, bf16 = self.ops, self.cfg, self.ops.f32_to_bf16
        p = f"layers.{l}."
        N, d = dh.shape
        T, H, G, D = cfg.seq_len, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        lo, hi = self.layout.qkv_range(l)
        w_qkv = params[lo:hi].reshape((H + 2 * G) * D, d)
        cos_t, sin_t = self._rope()
        # SwiGLU branch: h_out = h_mid + w_down(s)
        ds = self._linear_backward(l, "down", bf16(dh), lc.s_b, w[p + "w_down"], dw, dw.at(p + "w_down"))  # (N, F)
        gu = lc.gu if lc.gu is not None else self._linear_forward(l, "gate_up", lc.f_b, w[p + "w_gate_up"])
        dgu_b = ops.swiglu_backward(ds, gu, bf16_out=True)                                   # (N, 2F) bf16
        del gu
        df = self._linear_backward(l, "gate_up", dgu_b, lc.f_b, w[p + "w_gate_up"], dw, dw.at(p + "w_gate_up"))  # (N, d)
        dh_mid, dw[p + "ffn_norm"] = ops.rmsnorm_backward(df, lc.h_mid, w[p + "ffn_norm"], lc.rstd_ffn)
        dh = arrays.add_into(ops, dh, dh_mid)        # dh = dL/dh_mid: running gradient + branch
        # attention branch: h_mid = h_in + wo(o)
        do = self._linear_backward(l, "wo", bf16(dh), lc.o_b, w[p + "wo"], dw, dw.at(p + "wo"))    # (N, H*D)
        dq_r, dk_r, dv = ops.attention_backward(do.reshape(B, T, H, D), lc.q_b, lc.k_b, lc.v_b, lc.o,
                                                lc.lse, self.windows[l], self.attn_scale)
        dqn = ops.rope_backward(dq_r, cos_t, sin_t).reshape(N * H, D)
        dkn = ops.rope_backward(dk_r, cos_t, sin_t).reshape(N * G, D)
        dq, _ = ops.rmsnorm_backward(dqn, lc.q_pre, None, lc.rstd_q)     # (N*H, D)
        dk, _ = ops.rmsnorm_backward(dkn, lc.k_pre, None, lc.rstd_k)     # (N*G, D)
        dqkv = arrays.concat([dq.reshape(N, H * D), dk.reshape(N, G * D), dv.reshape(N, G * D)], axis=1)
        da = self._linear_backward(l, "qkv", bf16(dqkv), lc.a_b, w_qkv, dw, lo)   # (N, d); wq, wk, wv: one range
        dh_in, dw[p + "attn_norm"] = ops.rmsnorm_backward(da, lc.h_in, w[p + "attn_norm"], lc.rstd_attn)
        return arrays.add_into(ops, dh, dh_in)       # dh = dL/dh_in


class _Grads(arrays.FlatBuffer):
    """The fp32 gradient buffer in the parameter layout, written tensor by tensor (grads[name] =
    array of the tensor's shape) or by range (write(offset, array)); a numpy one taken from `pool`
    when one is given."""

    def __init__(self, layout: ParamLayout, k: str, pool: arrays.BufferPool | None = None):
        out = pool.take() if pool is not None and k == arrays.NUMPY else None
        super().__init__(layout.n_params, np.float32, k, out)
        self.layout = layout

    def at(self, name: str) -> int:
        """Where tensor `name` starts in the buffer."""
        return self.layout[name].offset

    def slot_of(self, name: str):
        """A writable view of tensor `name` in the buffer for a kernel to write (FlatBuffer.slot), or
        None: then settle() writes the op's result."""
        t = self.layout[name]
        return self.slot(t.offset, t.shape)

    def __setitem__(self, name: str, value) -> None:
        t = self.layout[name]
        if tuple(value.shape) != t.shape:
            raise AssertionError(f"gradient of {name}: shape {tuple(value.shape)}, expected {t.shape}")
        self.write(t.offset, value)
