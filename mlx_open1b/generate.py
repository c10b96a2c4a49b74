"""Text generation from a run's checkpoint: greedy or sampled decoding, the same tokens on every backend.

The logits of each new token are the model program's own (Model._forward on the backend, then the
LM head GEMM, CONTRACT.md §6.1, on the final norm's bf16 output: the operands of the fused
cross-entropy). Everything after the logits is host arithmetic fixed here, in fp32 with the
contract's own operations (spec.arith: IEEE add/mul with §3's flush; spec.mathfn.exp: §4's exp), so
a checkpoint, a prompt and a seed give the same tokens on cpu_ref, metal and cuda, emulated or not.

**The window.** Token i+1 is chosen from the logits of the last position of one forward pass over
the context: the last seq_len tokens of prompt + generated (cut on the left), padded on the right
with the end-of-text id to seq_len (causal attention: padding never reaches the positions before
it in bf16; in the quantized precisions the per-tensor activation scales of §6.9 see the padding,
and the rule above fixes it too).

**No KV cache: every token recomputes the window.** A KV cache would compute each new position alone
and keep the keys and values of the earlier ones. In the quantized precisions (int8, int6, int4;
the open1b preset) that cannot give the full forward's bits: each quantized GEMM's activation scale
is one absmax over every row of the tensor (§6.9), so the keys and values of a position depend on
rows that come later. In bf16 every op is row-independent, but the attention forward (§6.6) is
defined on a whole window of queries; one query row against cached keys is a new op that the
contract, the C reference and the Metal and CUDA kernels would all have to define with the same
block order. Recompute costs one forward pass of seq_len positions per token and needs neither.

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


def choose(z: np.ndarray, n_candidates: int, sampling: Sampling, index: int) -> int:
    """The token chosen from logits z (V,) fp32 for the index-th generated token (module docstring)."""
    z = np.asarray(z, F32)[:n_candidates]
    ids = np.flatnonzero(~np.isnan(z))
    if ids.size == 0:
        raise GenerateError(f"generated token {index}: every logit is NaN (the checkpoint's parameters are broken)",
                            exit_code=3)
    zc = z[ids]
    if sampling.temperature == 0:
        return int(ids[np.flatnonzero(zc == zc.max())[0]])
    order = np.argsort(-zc, kind="stable")            # logit descending; equal logits keep id order
    if sampling.top_k:
        order = order[:sampling.top_k]
    ids, zc = ids[order], zc[order]
    if zc[0] == np.inf:
        w = np.where(zc == np.inf, F32(1.0), F32(0.0))
    else:
        s = F32(f32(1.0 / sampling.temperature))
        w = exp(arith.mul(arith.sub(zc, zc[0]), s))
    c = np.empty_like(w)
    acc = F32(0.0)
    for j in range(w.size):                            # sequential: the sum's order is the definition
        acc = c[j] = arith.add(acc, w[j])
    word = int(philox_block(sampling.seed, STREAM_SAMPLE, index)[0])
    u = arith.mul(F32(word >> 8), _U_SCALE)           # exact: a 24-bit integer times 2^-24
    r = arith.mul(u, c[-1])
    hit = np.flatnonzero(c > r)
    j = int(hit[0]) if hit.size else int(np.flatnonzero(w > 0)[-1])
    return int(ids[j])


class Generator:
    """The model program at one verified checkpoint of a run, decoding on one backend."""

    def __init__(self, run_dir, step: int | None = None, backend: str = "cpu_ref", tokenizer=None):
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

    def encode(self, prompt: str) -> np.ndarray:
        ids = self.tok.encode(prompt)
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
        """The next-token logits (V,) fp32 after `context` (the window rule of the module docstring)."""
        ctx = np.asarray(context, np.uint32)[-self.T:]
        n = len(ctx)
        w = np.full(self.T + 1, self.eot, np.uint32)
        w[:n] = ctx
        inputs, targets, B = self.model._split(w[None])
        inputs, targets = self.ops.to_device(inputs), self.ops.to_device(targets)
        cache = Cache(B, self.T, inputs, targets)
        self.model._forward(self.params, inputs, targets, B, cache)
        z = arrays.to_host(self.ops.linear_forward(cache.hn_b, self.lm_head))     # (T, V)
        return np.asarray(z, F32)[n - 1]

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
