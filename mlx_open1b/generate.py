"""Text generation from a run's checkpoint: greedy or sampled decoding, the same tokens on every backend.

The logits of each new token are the model program's own (Model._forward on the backend, then the
LM head GEMM, CONTRACT.md §6.1, on the final norm's bf16 output: the operands of the fused
cross-entropy), every unit at the run's precision (a GNMR run's per-step recovery paths are
training decisions, not part of the model). Everything after the logits is host arithmetic fixed
here, in fp32 with the contract's own operations (spec.arith: IEEE add/mul with §3's flush;
spec.mathfn.exp: §4's exp), so a checkpoint, a prompt and a seed give the same tokens on cpu_ref,
metal and cuda, emulated or not.

**The window.** Token i+1 is chosen from the logits of the last position of one forward pass over
the context: the last seq_len tokens of prompt + generated (cut on the left), padded on the right
with the end-of-text id to seq_len (causal attention: padding never reaches the positions before
it in bf16; in the quantized precisions the per-tensor activation scales of §6.9 see the padding,
and the rule above fixes it too).

**KV cache in bf16, recompute in the quantized precisions.** The logits are defined as those of the
full forward pass of the window above; a KV cache is used only where it gives those bits.
- bf16 (the tiny and small presets): every op is row-independent: the GEMMs (§6.1: each output
  element is one dot product in a fixed order, whatever the number of rows), the norms, RoPE (a
  position's row of the table), and the attention forward (§6.6: query row i is an online softmax
  over aligned 64-key blocks of keys 0..i, whatever comes after it). So the prompt's window is run
  once (keeping every layer's bf16 keys and values after RoPE), and each new position then runs
  alone through the blocks: its one row through the GEMMs, norms and RoPE, and the attention
  forward on the cached keys and values with the new query in the last row (the other query rows
  are zeros whose outputs are dropped: the contract has no one-row attention op, so the op runs
  t rows, still no GEMM over the window). A test checks the bits against the full forward on
  every backend. Once the context is longer than seq_len, the window slides: every position
  moves, the cache is void, and each token recomputes its window.
- int8, int6, int4 (the open1b preset): every token recomputes its window. Each quantized GEMM's
  activation scale is one absmax over every row of the tensor (§6.9), padding included, so the
  keys and values of a position depend on rows that come later: a cache cannot give those bits.

**Choosing the token** from the logits z (V fp32) of the last position. Candidates are the ids below
min(model vocabulary, tokenizer vocabulary); a NaN logit is never a candidate (no candidate left:
GenerateError, exit 3).
- temperature 0 (greedy): the candidate with the largest logit; ties go to the smallest id.
- temperature t > 0: order the candidates by logit descending, ties by id ascending; keep the first
  top_k (0: all). s = fp32(1/t) (binary64 division, rounded once). If the first logit is +inf, the
  +inf candidates have weight 1 and the others 0; otherwise w_j = exp(mul(sub(z_j, z_0), s)). The
  running sums c_j = add(c_{j-1}, w_j) in that order (c_0 = w_0 = 1). The uniform of the i-th
  generated token (i = 0, 1, ...) is u = mul(i2f(w0 >> 8), 2^-24) from word 0 of the Philox block
  (seed, STREAM_SAMPLE, i, 0) (CONTRACT.md §5); r = mul(u, c_last); the token is the first j with
  c_j > r, or the last candidate of nonzero weight when rounding leaves none.
Generation stops after max_tokens tokens or at the end-of-text id (not emitted).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable, Iterator

import numpy as np

from . import arrays
from .checkpoint import CheckpointError, load_checkpoint
from .contract import STREAM_SAMPLE
from .data.format import DataError
from .data.tokenizer import DEFAULT_TOKENIZER_SHA256, Tokenizer
from .errors import Open1bError
from .hostmath import f32
from .model import Cache, Model, views
from .rundir import RunDir
from .spec import arith
from .spec.mathfn import exp
from .spec.optim import philox_block

F32 = np.float32
_U_SCALE = F32(2.0 ** -24)


class GenerateError(Open1bError):
    """Generation that cannot run; the message names the run, checkpoint, prompt token or step."""


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0     # 0: greedy
    top_k: int = 0               # 0: every candidate
    seed: int = 0                # u64: the Philox key of the draws

    def check(self) -> "Sampling":
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise GenerateError(f"temperature: expected a finite number >= 0, got {self.temperature!r}")
        if self.temperature > 0 and not np.isfinite(f32(1.0 / self.temperature)):
            raise GenerateError(f"temperature: {self.temperature!r} is too small (1/temperature overflows fp32)")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise GenerateError(f"top_k: expected an integer >= 0, got {self.top_k!r}")
        if not (isinstance(self.seed, int) and 0 <= self.seed < 2 ** 64):
            raise GenerateError(f"seed: expected an integer in [0, 2^64), got {self.seed!r}")
        return self


def greedy(z: np.ndarray, n_candidates: int) -> np.ndarray:
    """The greedy rule on logits z (..., V): per row, the candidate (id < n_candidates) with the largest
    logit, ties to the smallest id, a NaN never chosen; -1 where every candidate is NaN. The one home
    of the rule: `choose` at temperature 0, and `open1b eval`'s generate_until and is_greedy."""
    zc = np.asarray(z)[..., :n_candidates]
    nan = np.isnan(zc)
    top = np.where(nan, -np.inf, zc).max(axis=-1, keepdims=True)      # -inf where no candidate is a number
    hit = (zc == top) & ~nan
    return np.where(hit.any(axis=-1), hit.argmax(axis=-1), -1)          # argmax of bools: the first True


def choose(z: np.ndarray, n_candidates: int, sampling: Sampling, index: int) -> int:
    """The token chosen from logits z (V,) fp32 for the index-th generated token (module docstring)."""
    z = np.asarray(z, F32)[:n_candidates]
    ids = np.flatnonzero(~np.isnan(z))
    if ids.size == 0:
        raise GenerateError(f"generated token {index}: every logit is NaN (the checkpoint's parameters are broken)",
                            exit_code=3)
    if sampling.temperature == 0:
        return int(greedy(z, n_candidates))
    zc = z[ids]
    order = np.argsort(-zc, kind="stable")            # logit descending; equal logits keep id order
    if sampling.top_k:
        order = order[:sampling.top_k]
    ids, zc = ids[order], zc[order]
    if zc[0] == np.inf:
        w = np.where(zc == np.inf, F32(1.0), F32(0.0))
    else:
        s = F32(f32(1.0 / sampling.temperature))
        w = exp(arith.mul(arith.sub(zc, zc[0]), s))
    # c_j = add(c_{j-1}, w_j) in order: accumulate is that sequential loop (no pairwise tree), and
    # every c_j >= w_0 = 1 is normal, so add's flush never acts
    c = np.add.accumulate(w, dtype=F32)
    word = int(philox_block(sampling.seed, STREAM_SAMPLE, index)[0])
    u = arith.mul(F32(word >> 8), _U_SCALE)           # exact: a 24-bit integer times 2^-24
    r = arith.mul(u, c[-1])
    hit = np.flatnonzero(c > r)
    j = int(hit[0]) if hit.size else int(np.flatnonzero(w > 0)[-1])
    return int(ids[j])


class Generator:
    """The model program at one verified checkpoint of a run, decoding on one backend."""

    def __init__(self, run_dir, step: int | None = None, backend: str = "cpu_ref", tokenizer=None,
                 kv_cache: bool | None = None):
        """kv_cache: None: in bf16 (module docstring); False: recompute every window; True: refused
        in the quantized precisions."""
        from .train import TrainError, get_backend
        rd = RunDir(run_dir)
        if not rd.path.is_dir():
            raise GenerateError(f"{rd.path}: no such run directory")
        info = rd.info(error=GenerateError)
        self.cfg = info.config
        step = rd.select_checkpoint(step, GenerateError)
        try:
            tensors, meta = load_checkpoint(rd.checkpoint(step))
        except CheckpointError as e:
            raise GenerateError(str(e), exit_code=1) from None
        want, _ = rd.params_hash_after(step, info.genesis, GenerateError)
        if meta.get("genesis") != info.genesis or (want is not None and meta.get("params_hash") != want):
            raise GenerateError(f"{rd.checkpoint(step)}: does not match the run's ledger", exit_code=1)
        try:
            if tokenizer is None:
                if info.tokenizer_sha256 != DEFAULT_TOKENIZER_SHA256:
                    raise GenerateError(f"{rd.path}: trained with tokenizer {info.tokenizer_sha256[:12]}…, not the "
                                        f"shipped one; pass its tokenizer.json (--tokenizer)")
                tokenizer = Tokenizer.load(None)
            elif isinstance(tokenizer, (str, os.PathLike)):
                tokenizer = Tokenizer.load(tokenizer)
        except DataError as e:
            raise GenerateError(str(e)) from None
        if tokenizer.sha256 != info.tokenizer_sha256:
            raise GenerateError(f"{tokenizer.path}: SHA-256 {tokenizer.sha256[:12]}…, but {rd.path} was trained "
                                f"with tokenizer {info.tokenizer_sha256[:12]}…")
        try:
            self.ops = get_backend(backend)
        except TrainError as e:
            raise GenerateError(str(e)) from None
        self.tok, self.step, self.backend, self.run_dir = tokenizer, step, backend, rd.path
        self.model = Model(self.cfg.model, self.ops, precision=self.cfg.precision, attention_pv=self.cfg.attention_pv)
        self.params = self.ops.to_device(np.array(tensors["params"][0], copy=True))
        self.lm_head = arrays.contiguous(views(self.params, self.model.layout)["lm_head"])
        self.T, self.V = self.cfg.model.seq_len, self.cfg.model.vocab_size
        self.eot = tokenizer.eot_id
        self.n_candidates = min(self.V, tokenizer.vocab_size)
        bf16 = self.cfg.precision == "bf16"
        if kv_cache and not bf16:
            raise GenerateError(f"kv_cache: a {self.cfg.precision} run's logits depend on every row of the window "
                                f"(per-tensor activation scales, CONTRACT.md §6.9); only bf16 runs decode with a "
                                f"KV cache")
        self.kv_cache = bf16 if kv_cache is None else bool(kv_cache)
        self._kv = None            # (context ids, [(k_b, v_b) per layer] (1, n, G, D) bf16) of the cached rows

    def encode(self, prompt: str) -> np.ndarray:
        """The prompt's token ids; GenerateError where the tokenizer cannot represent it (a character
        it drops: a tokenizer without a byte-level alphabet) or where an id is outside the model's vocabulary."""
        ids = self.tok.encode(prompt)
        back = self.tok.decode(ids)
        if back != prompt:
            i = next((k for k, (a, b) in enumerate(zip(prompt, back)) if a != b), min(len(prompt), len(back)))
            raise GenerateError(f"prompt: the tokenizer {self.tok.path} does not encode it as written (character "
                                f"{i}, {prompt[i:i + 1]!r}, comes back as {back[i:i + 1]!r})")
        return self.check_ids(ids, "prompt")

    def check_ids(self, ids, what: str = "prompt") -> np.ndarray:
        """Prompt token ids as uint32; GenerateError naming the first id outside the model's vocabulary."""
        a = np.asarray(ids)
        if a.ndim != 1 or a.size == 0:
            raise GenerateError(f"{what}: empty (give at least one token)")
        bad = np.flatnonzero((a < 0) | (a >= self.V))
        if bad.size:
            i = int(bad[0])
            piece = "" if what != "prompt" else f" ({self.tok.decode(a[i:i + 1])!r})"
            raise GenerateError(f"{what}: token {i} is id {int(a[i])}{piece}, outside the model's vocabulary "
                                f"[0, {self.V}) ({bad.size} such tokens)")
        return a.astype(np.uint32)

    def logits(self, context: np.ndarray) -> np.ndarray:
        """The next-token logits (V,) fp32 after `context` (the window rule of the module docstring):
        from the KV cache when it holds all of the context but its last token, else by the full
        forward pass of the window (which fills the cache)."""
        ctx = np.asarray(context, np.uint32)
        kv = self._kv
        if (self.kv_cache and kv is not None and len(ctx) <= self.T and len(ctx) == len(kv[0]) + 1
                and np.array_equal(ctx[:-1], kv[0])):
            return self._decode(ctx)
        return self._window_logits(ctx)

    def _window_logits(self, ctx: np.ndarray) -> np.ndarray:
        ctx = ctx[-self.T:]
        n = len(ctx)
        w = np.full(self.T + 1, self.eot, np.uint32)
        w[:n] = ctx
        inputs, targets, B = self.model._split(w[None])
        inputs, targets = self.ops.to_device(inputs), self.ops.to_device(targets)
        cache = Cache(B, self.T, inputs, targets)
        self.model._forward(self.params, inputs, targets, B, cache)
        z = arrays.to_host(self.ops.linear_forward(cache.hn_b, self.lm_head))     # (T, V)
        if self.kv_cache:
            self._kv = (ctx.copy(), [(arrays.contiguous(lc.k_b[:, :n]), arrays.contiguous(lc.v_b[:, :n]))
                                     for lc in cache.layers])
        return np.asarray(z, F32)[n - 1]

    def _decode(self, ctx: np.ndarray) -> np.ndarray:
        """The logits of the last token of ctx at position t = len(ctx) - 1, the rows before it cached:
        Model._block_forward's program on one row (bf16 only; the module docstring says why the
        bits are the full forward's)."""
        m, ops, cfg = self.model, self.ops, self.cfg.model
        eps, put = m.eps, m._put
        t = len(ctx) - 1
        H, G, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        w = views(self.params, m.layout)
        cos_t, sin_t = m._rope()
        cos1, sin1 = arrays.contiguous(cos_t[t:t + 1]), arrays.contiguous(sin_t[t:t + 1])   # position t's row
        x0 = ops.embedding_forward(put(ctx[t:].astype(np.int32)), w["wte"])          # (1, d)
        h, _ = ops.rmsnorm_forward(x0, w["emb_norm"], eps)
        q_rows = put(np.zeros((1, t + 1, H, D), np.uint16))                           # bf16 zeros
        new = []
        for l, (k_c, v_c) in enumerate(self._kv[1]):
            p = f"layers.{l}."
            lo, hi = m.layout.qkv_range(l)
            a_b, _ = ops.rmsnorm_forward(h, w[p + "attn_norm"], eps, bf16_out=True)
            qkv = m._linear_forward(l, "qkv", a_b, self.params[lo:hi].reshape((H + 2 * G) * D, -1))
            qn, _ = ops.rmsnorm_forward(arrays.contiguous(qkv[:, :H * D]).reshape(H, D), None, eps)
            kn, _ = ops.rmsnorm_forward(arrays.contiguous(qkv[:, H * D:(H + G) * D]).reshape(G, D), None, eps)
            q_b = ops.f32_to_bf16(ops.rope_forward(qn.reshape(1, 1, H, D), cos1, sin1))
            k_b = arrays.concat([k_c, ops.f32_to_bf16(ops.rope_forward(kn.reshape(1, 1, G, D), cos1, sin1))], axis=1)
            v_b = arrays.concat([v_c, ops.f32_to_bf16(arrays.contiguous(qkv[:, (H + G) * D:]).reshape(1, 1, G, D))],
                                axis=1)
            new.append((k_b, v_b))
            q = arrays.concat([q_rows[:, :t], q_b], axis=1) if t else q_b
            o, _ = m._path(l, "attn")[2](q, k_b, v_b, m.windows[l], m.attn_scale)     # (1, t+1, H, D)
            o_b = ops.f32_to_bf16(arrays.contiguous(o[:, t:]).reshape(1, H * D))
            h_mid = ops.add(h, m._linear_forward(l, "wo", o_b, w[p + "wo"]))
            f_b, _ = ops.rmsnorm_forward(h_mid, w[p + "ffn_norm"], eps, bf16_out=True)
            gu = m._linear_forward(l, "gate_up", f_b, w[p + "w_gate_up"])
            s_b = ops.swiglu_forward(gu, bf16_out=True)
            h = ops.add(h_mid, m._linear_forward(l, "down", s_b, w[p + "w_down"]))
        hn_b, _ = ops.rmsnorm_forward(h, w["final_norm"], eps, bf16_out=True)
        z = arrays.to_host(ops.linear_forward(hn_b, self.lm_head))                   # (1, V)
        self._kv = (ctx.copy(), new)
        return np.asarray(z, F32)[0]

    def tokens(self, prompt_ids, max_tokens: int, sampling: Sampling = Sampling()) -> Iterator[int]:
        """The generated token ids, one at a time (stops at max_tokens or before the end-of-text id)."""
        sampling.check()
        ids = list(int(i) for i in self.check_ids(prompt_ids))
        for i in range(max_tokens):
            nxt = choose(self.logits(np.array(ids, np.uint32)), self.n_candidates, sampling, i)
            if nxt == self.eot:
                return
            ids.append(nxt)
            yield nxt

    def generate(self, prompt_ids, max_tokens: int, sampling: Sampling = Sampling(),
                 on_text: Callable[[str], None] | None = None) -> list[int]:
        """All generated ids; on_text receives the decoded text as it grows (whole characters only)."""
        out: list[int] = []
        shown = ""
        for t in self.tokens(prompt_ids, max_tokens, sampling):
            out.append(t)
            if on_text is not None:
                text = self.tok.decode(out)
                if not text.endswith("\ufffd") and text.startswith(shown):   # a character still incomplete
                    on_text(text[len(shown):])
                    shown = text
        if on_text is not None:
            text = self.tok.decode(out)
            if text != shown:
                on_text(text[len(shown):] if text.startswith(shown) else "\n" + text)
        return out
