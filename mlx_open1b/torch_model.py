"""A plain PyTorch implementation of the Open-1B architecture: NOT reproducible, on purpose.

Two uses (paper §3.5, its "PyTorch bf16" arm):
- the external reference for gradients: in float64 (autograd, library transcendentals, no bf16
  rounding of GEMM operands) it gives the mathematically intended loss and gradient of the
  architecture, against which the reproducible model program's fp32/bf16 gradient is checked
  within an argued tolerance (`reference_grad`);
- the speed and loss baseline: float32, or float32 parameters with bf16 autocast, trained with
  torch.optim.AdamW (`TorchTrainer`).

The architecture is the model program's (CONTRACT.md §6 for the op definitions):

    x  = wte[tokens];  h = RMSNorm(x, emb_norm)
    per layer l:
        a = RMSNorm(h, attn_norm);  q, k, v = a Wqᵀ, a Wkᵀ, a Wvᵀ
        q, k = QKnorm(q), QKnorm(k)          per head, no gain, eps = norm_eps
        q, k = RoPE(q), RoPE(k)              rotate-half: i pairs with i + D/2
        o = attention(q, k, v, window_l)     causal, sliding window, grouped-query, 1/sqrt(D)
        h = h + o Woᵀ
        f = RMSNorm(h, ffn_norm);  h = h + SwiGLU(f W_gate_upᵀ) W_downᵀ
    hn = RMSNorm(h, final_norm);  z = hn lm_headᵀ
    loss = mean over rows of (lse - z[target]) + zcoef · lse²

Parameters are named and ordered exactly as `ModelConfig.param_shapes()` ("wte", "emb_norm",
"layers.0.attn_norm", "layers.0.wq", …, "final_norm", "lm_head"), each with its canonical
shape ((out, in) for linear layers), so the flat parameter buffer maps onto them one to one.

Nothing here is contract arithmetic: the results depend on the library, the thread count and the
hardware. Known differences from the reproducible program, all below bf16 resolution: the
RoPE tables use float64 (or float32) library pow/sin/cos instead of the contract's fp32 software
functions; no rounding of activations/gradients to bf16 before GEMMs (float32/float64 mode);
softmax and log-sum-exp are unchunked.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig

__all__ = ["TorchModel", "TorchTrainer", "TrainResult", "attention", "bf16_bits_to_f32",
           "reference_grad", "rmsnorm", "rope", "rope_tables", "swiglu", "visibility_mask",
           "xent_zloss"]


# --------------------------------------------------------------------------------------- helpers
def bf16_bits_to_f32(u: np.ndarray) -> np.ndarray:
    """bf16 stored as uint16 bits → float32, exactly (bits << 16). Subnormals are kept as they are
    (the contract flushes them; a trained or initialized model has none)."""
    return (np.asarray(u, np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def rmsnorm(x: torch.Tensor, g: torch.Tensor | None, eps: float) -> torch.Tensor:
    """y = x · rsqrt(mean(x²) + eps) (· g): over the last axis, in x's dtype."""
    y = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return y if g is None else y * g


def rope_tables(T: int, D: int, theta: float, dtype: torch.dtype, device=None):
    """cos, sin (T, D/2): angle = t · theta^(-2i/D), computed in float64 and cast once."""
    i = torch.arange(D // 2, dtype=torch.float64, device=device)
    inv_freq = theta ** (-2.0 * i / D)
    ang = torch.arange(T, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
    return torch.cos(ang).to(dtype), torch.sin(ang).to(dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, R, D), cos/sin (T, D/2): rotate-half, element i paired with i + D/2."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def swiglu(gu: torch.Tensor) -> torch.Tensor:
    """gu (..., 2F) = [gate | up] → silu(gate) · up (..., F)."""
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up


def xent_zloss(z: torch.Tensor, targets: torch.Tensor, zcoef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """z (N, V) logits, targets (N,) → per row ce = lse − z[target] and zl = zcoef · lse²."""
    lse = torch.logsumexp(z, dim=-1)
    ce = lse - z.gather(1, targets.reshape(-1, 1)).squeeze(1)
    return ce, zcoef * lse * lse


def visibility_mask(T: int, window: int, device=None) -> torch.Tensor:
    """(T, T) bool, [i, j] = key j visible to query i: j <= i and (window == 0 or i - j < window)."""
    i = torch.arange(T, device=device)[:, None]
    j = torch.arange(T, device=device)[None, :]
    m = j <= i
    if window:
        m = m & (i - j < window)
    return m


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
              impl: str = "sdpa", mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal (sliding-window) grouped-query attention.

    q (B, T, H, D), k and v (B, T, G, D) → o (B, T, H, D). Query head h reads key/value head
    h // (H/G); scale 1/sqrt(D). impl "sdpa" uses torch's fused scaled_dot_product_attention,
    "explicit" writes out scores, mask and softmax (the two are tested equal in float64)."""
    B, T, H, D = q.shape
    G = k.shape[2]
    if mask is None:
        mask = visibility_mask(T, window, q.device)
    qh = q.transpose(1, 2)                                   # (B, H, T, D)
    kh = k.transpose(1, 2).repeat_interleave(H // G, dim=1)  # (B, H, T, D): head h → group h // (H/G)
    vh = v.transpose(1, 2).repeat_interleave(H // G, dim=1)
    scale = 1.0 / math.sqrt(D)
    if impl == "sdpa":
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    elif impl == "explicit":
        s = torch.matmul(qh, kh.transpose(-1, -2)) * scale
        s = s.masked_fill(~mask, float("-inf"))
        o = torch.matmul(torch.softmax(s, dim=-1), vh)
    else:
        raise ValueError(f"attention impl must be 'sdpa' or 'explicit', got {impl!r}")
    return o.transpose(1, 2)                                 # (B, T, H, D)


# ----------------------------------------------------------------------------------------- model
class _Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype, device):
        super().__init__()
        d, H, G, D, Fh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_hidden
        kw = dict(dtype=dtype, device=device)
        self.attn_norm = nn.Parameter(torch.ones(d, **kw))
        self.wq = nn.Parameter(torch.zeros(H * D, d, **kw))
        self.wk = nn.Parameter(torch.zeros(G * D, d, **kw))
        self.wv = nn.Parameter(torch.zeros(G * D, d, **kw))
        self.wo = nn.Parameter(torch.zeros(d, H * D, **kw))
        self.ffn_norm = nn.Parameter(torch.ones(d, **kw))
        self.w_gate_up = nn.Parameter(torch.zeros(2 * Fh, d, **kw))
        self.w_down = nn.Parameter(torch.zeros(d, Fh, **kw))


class TorchModel(nn.Module):
    """The Open-1B architecture in PyTorch (see the module docstring).

    dtype: parameter and compute dtype, torch.float64 (the gradient reference) or torch.float32.
    autocast_bf16: float32 parameters, GEMMs and attention under torch.autocast(bfloat16); norms,
    RoPE and the loss stay float32 (the usual mixed-precision recipe).
    attn_impl: "sdpa" (default) or "explicit" (see `attention`).
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float64, autocast_bf16: bool = False,
                 attn_impl: str = "sdpa", device=None):
        super().__init__()
        cfg.check()
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
        if autocast_bf16 and dtype != torch.float32:
            raise ValueError("autocast_bf16 needs float32 parameters")
        self.cfg, self.dtype, self.autocast_bf16, self.attn_impl = cfg, dtype, autocast_bf16, attn_impl
        kw = dict(dtype=dtype, device=device)
        d, V = cfg.d_model, cfg.vocab_size
        self.wte = nn.Parameter(torch.zeros(V, d, **kw))
        self.emb_norm = nn.Parameter(torch.ones(d, **kw))
        self.layers = nn.ModuleList([_Layer(cfg, dtype, device) for _ in range(cfg.n_layers)])
        self.final_norm = nn.Parameter(torch.ones(d, **kw))
        self.lm_head = nn.Parameter(torch.zeros(V, d, **kw))

        params = dict(self.named_parameters())
        shapes = cfg.param_shapes()
        assert sorted(params) == sorted(n for n, _, _ in shapes), "parameter names differ from param_shapes()"
        for n, s, _ in shapes:
            assert tuple(params[n].shape) == tuple(s), (n, params[n].shape, s)
        self._params = [params[n] for n, _, _ in shapes]
        self._decayed = [dec for _, _, dec in shapes]
        self._sizes = [int(np.prod(s)) for _, s, _ in shapes]
        self._offsets = np.concatenate([[0], np.cumsum(self._sizes)]).astype(np.int64)
        cos, sin = rope_tables(cfg.seq_len, cfg.head_dim, cfg.rope_theta, dtype, device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.attn_trace: list | None = None   # set to a list to collect each layer's attention output

    # -- the flat parameter buffer -----------------------------------------------------------
    @property
    def n_params(self) -> int:
        return int(self._offsets[-1])

    def param_slices(self) -> dict[str, slice]:
        """Name → slice of the flat buffer, in canonical order."""
        return {n: slice(int(self._offsets[i]), int(self._offsets[i + 1]))
                for i, (n, _, _) in enumerate(self.cfg.param_shapes())}

    @torch.no_grad()
    def load_flat(self, flat: np.ndarray) -> "TorchModel":
        """Load the canonical flat parameter buffer: uint16 bf16 bits (widened exactly) or a float
        array of values (float32/float64, taken as they are, then cast to the model's dtype)."""
        flat = np.asarray(flat).reshape(-1)
        if flat.size != self.n_params:
            raise ValueError(f"flat buffer has {flat.size} elements, the model {self.n_params}")
        if flat.dtype == np.uint16:
            vals = bf16_bits_to_f32(flat)
        elif flat.dtype in (np.float32, np.float64):
            vals = flat
        else:
            raise TypeError(f"flat buffer must be uint16 (bf16 bits), float32 or float64, got {flat.dtype}")
        for p, lo, hi in zip(self._params, self._offsets[:-1], self._offsets[1:]):
            p.copy_(torch.from_numpy(np.ascontiguousarray(vals[lo:hi])).reshape(p.shape).to(p.dtype))
        return self

    @torch.no_grad()
    def flat_params(self) -> np.ndarray:
        """The parameters as one float64 (n_params,) array in canonical order."""
        return np.concatenate([p.detach().to(torch.float64).reshape(-1).cpu().numpy() for p in self._params])

    def flat_grad(self) -> np.ndarray:
        """The gradients as one float64 (n_params,) array in canonical order (zeros where none)."""
        out = np.zeros(self.n_params, np.float64)
        for p, lo, hi in zip(self._params, self._offsets[:-1], self._offsets[1:]):
            if p.grad is not None:
                out[lo:hi] = p.grad.detach().to(torch.float64).reshape(-1).cpu().numpy()
        return out

    @torch.no_grad()
    def init_params(self, seed: int = 0) -> "TorchModel":
        """torch's own (non-Philox) init: truncated normal N(0, sigma) cut at ±2 sigma for matrices,
        ones for gains. For identical starts with the reproducible model, use load_flat."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        s = self.cfg.init_sigma
        for p in self._params:
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                w = torch.empty(p.shape, dtype=torch.float64)
                nn.init.trunc_normal_(w, 0.0, s, -2 * s, 2 * s, generator=gen)
                p.copy_(w.to(p.dtype))
        return self

    # -- forward -------------------------------------------------------------------------------
    def _tokens(self, windows) -> tuple[torch.Tensor, torch.Tensor]:
        w = np.asarray(windows)
        if w.ndim != 2 or w.shape[1] != self.cfg.seq_len + 1:
            raise ValueError(f"windows must be (B, seq_len + 1 = {self.cfg.seq_len + 1}), got {w.shape}")
        t = torch.from_numpy(w.astype(np.int64)).to(self.wte.device)
        if int(t.min()) < 0 or int(t.max()) >= self.cfg.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.cfg.vocab_size})")
        return t[:, :-1], t[:, 1:]

    def _cdt(self) -> torch.dtype:
        return torch.float32 if self.autocast_bf16 else self.dtype

    def _block(self, l: int, layer: _Layer, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        cfg, cdt = self.cfg, self._cdt()
        B, T, _ = h.shape
        H, G, D, eps = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.norm_eps
        a = rmsnorm(h, layer.attn_norm, eps)
        q = F.linear(a, layer.wq).to(cdt).view(B, T, H, D)
        k = F.linear(a, layer.wk).to(cdt).view(B, T, G, D)
        v = F.linear(a, layer.wv).view(B, T, G, D)
        q = rope(rmsnorm(q, None, eps), self.rope_cos[:T], self.rope_sin[:T])
        k = rope(rmsnorm(k, None, eps), self.rope_cos[:T], self.rope_sin[:T])
        if self.autocast_bf16:   # the attention GEMMs in bf16, as a bf16 PyTorch run does
            q, k, v = q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)
        o = attention(q, k, v, cfg.layer_window(l), self.attn_impl, mask)
        if self.attn_trace is not None:
            self.attn_trace.append(o.detach().clone())
        h = h + F.linear(o.reshape(B, T, H * D), layer.wo).to(cdt)
        f = rmsnorm(h, layer.ffn_norm, eps)
        return h + F.linear(swiglu(F.linear(f, layer.w_gate_up)), layer.w_down).to(cdt)

    def _logits(self, inputs: torch.Tensor) -> torch.Tensor:
        """inputs (B, T) int64 -> logits (B, T, V) in the compute dtype."""
        cfg, cdt = self.cfg, self._cdt()
        T = inputs.shape[1]
        h = rmsnorm(F.embedding(inputs, self.wte), self.emb_norm, cfg.norm_eps)
        masks: dict[int, torch.Tensor] = {}
        for l, layer in enumerate(self.layers):
            W = cfg.layer_window(l)
            if W not in masks:
                masks[W] = visibility_mask(T, W, h.device)
            h = self._block(l, layer, h, masks[W])
        hn = rmsnorm(h, self.final_norm, cfg.norm_eps)
        return F.linear(hn, self.lm_head).to(cdt)

    def _forward(self, inputs: torch.Tensor, targets: torch.Tensor):
        cfg = self.cfg
        z = self._logits(inputs).reshape(-1, cfg.vocab_size)   # (N, V)
        ce, zl = xent_zloss(z, targets.reshape(-1), cfg.z_loss)
        return (ce + zl).mean(), ce.mean(), zl.mean()

    @torch.no_grad()
    def logits(self, tokens) -> torch.Tensor:
        """tokens (B, T) ints, T <= seq_len -> next-token logits (B, T, V), no loss (inference;
        used to check exported weights against the model program)."""
        t = torch.as_tensor(np.asarray(tokens, np.int64), device=self.wte.device)
        if t.ndim != 2 or not 1 <= t.shape[1] <= self.cfg.seq_len:
            raise ValueError(f"tokens must be (B, T) with 1 <= T <= seq_len = {self.cfg.seq_len}, got {tuple(t.shape)}")
        if int(t.min()) < 0 or int(t.max()) >= self.cfg.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.cfg.vocab_size})")
        if self.autocast_bf16:
            with torch.autocast(device_type=self.wte.device.type, dtype=torch.bfloat16):
                return self._logits(t)
        return self._logits(t)

    def forward(self, windows: np.ndarray):
        """windows uint32 (B, seq_len + 1) → (loss, ce_mean, z_mean), scalar tensors:
        loss = ce_mean + z_mean, z_mean = mean of zcoef · lse²."""
        inputs, targets = self._tokens(windows)
        if self.autocast_bf16:
            with torch.autocast(device_type=self.wte.device.type, dtype=torch.bfloat16):
                return self._forward(inputs, targets)
        return self._forward(inputs, targets)

    def loss_and_grad(self, flat_params: np.ndarray | None, windows: np.ndarray) -> tuple[float, np.ndarray]:
        """Load flat_params (unless None), compute the loss of windows and its gradient:
        (loss, float64 (n_params,) gradient in canonical order)."""
        if flat_params is not None:
            self.load_flat(flat_params)
        self.zero_grad(set_to_none=True)
        loss, _, _ = self(windows)
        loss.backward()
        return float(loss.detach()), self.flat_grad()


def reference_grad(cfg: ModelConfig, flat_params: np.ndarray, windows: np.ndarray) -> tuple[float, np.ndarray]:
    """The float64 reference: (loss, gradient float64 (n_params,), canonical order) of the mean
    loss over all B · seq_len rows of windows, at flat_params (uint16 bf16 bits, widened exactly)."""
    return TorchModel(cfg, torch.float64).loss_and_grad(flat_params, windows)


# ---------------------------------------------------------------------------------------- trainer
@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)        # per step: mean loss over its microbatches
    grad_norms: list[float] = field(default_factory=list)    # per step: pre-clip global l2 norm
    step_seconds: list[float] = field(default_factory=list)
    tokens: int = 0                                          # input tokens processed
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def tokens_per_s_after(self, skip: int = 1) -> float:
        """Throughput without the first `skip` steps (allocator and thread-pool warmup)."""
        secs = sum(self.step_seconds[skip:])
        n = len(self.step_seconds) - skip
        return (self.tokens * n / len(self.step_seconds)) / secs if n > 0 and secs > 0 else 0.0


class TorchTrainer:
    """The baseline recipe in plain PyTorch: AdamW (betas, eps, weight decay on linear layers and the
    LM head only), global l2 clip, gradient accumulation over microbatches (mean of microbatch
    losses). float32, or float32 parameters with bf16 autocast. Thread count: whatever the caller
    set with torch.set_num_threads."""

    def __init__(self, cfg: ModelConfig, flat_params: np.ndarray | None = None, *,
                 dtype: torch.dtype = torch.float32, autocast_bf16: bool = False, seed: int = 0,
                 betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.1, clip_norm: float = 1.0,
                 attn_impl: str = "sdpa", device=None):
        self.cfg = cfg
        self.model = TorchModel(cfg, dtype, autocast_bf16, attn_impl, device)
        if flat_params is not None:
            self.model.load_flat(flat_params)
        else:
            self.model.init_params(seed)
        params = self.model._params
        decayed = [p for p, dec in zip(params, self.model._decayed) if dec]
        plain = [p for p, dec in zip(params, self.model._decayed) if not dec]
        self.opt = torch.optim.AdamW([{"params": decayed, "weight_decay": weight_decay},
                                      {"params": plain, "weight_decay": 0.0}],
                                     lr=0.0, betas=tuple(betas), eps=eps)
        self.clip_norm = clip_norm
        self.steps_done = 0

    def step(self, microbatches: list[np.ndarray], lr: float) -> tuple[float, float]:
        """One optimizer step over the given microbatches (each (B, seq_len + 1)):
        returns (mean loss, pre-clip gradient norm)."""
        self.model.zero_grad(set_to_none=True)
        M = len(microbatches)
        total = 0.0
        for w in microbatches:
            loss, _, _ = self.model(w)
            (loss / M).backward()
            total += float(loss.detach())
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_norm)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        self.steps_done += 1
        return total / M, float(norm)

    def train_steps(self, windows_iter: Iterable[np.ndarray], n_steps: int,
                    lr: float | Callable[[int], float], microbatches: int = 1) -> TrainResult:
        """n_steps optimizer steps; each takes `microbatches` arrays from windows_iter. lr: a number,
        or a function of the step index (self.steps_done) returning one."""
        it: Iterator[np.ndarray] = iter(windows_iter)
        res = TrainResult()
        for _ in range(n_steps):
            mbs = [np.asarray(next(it)) for _ in range(microbatches)]
            rate = lr(self.steps_done) if callable(lr) else lr
            t0 = time.perf_counter()
            loss, norm = self.step(mbs, rate)
            dt = time.perf_counter() - t0
            res.losses.append(loss)
            res.grad_norms.append(norm)
            res.step_seconds.append(dt)
            res.seconds += dt
            res.tokens += sum(m.shape[0] * (m.shape[1] - 1) for m in mbs)
        return res
