"""Evaluation of a run's checkpoints: an lm-eval model adapter and a small offline task set.

`Open1BLM(run, step, backend)` loads checkpoint `step` (verified: tensor hashes, and the parameter
hash against the run's ledger) and scores text with the model program itself on any backend. It
implements lm-eval-harness's model interface:

    loglikelihood(requests)          [(context, continuation)] -> [(sum log p(continuation), is_greedy)]
    loglikelihood_rolling(requests)  [(text,)] -> [sum log p(text)]  (disjoint windows of seq_len tokens,
                                     the first token conditioned on the end-of-text separator)
    generate_until(requests)         [(context, {"until": [...], "max_gen_toks": n})] -> [text]  (greedy)

Requests may be lm-eval `Instance`s (their `.args`) or plain tuples. When `lm_eval` is installed the
class derives from `lm_eval.api.model.LM` and is registered as model "open1b", so
`lm_eval.simple_evaluate(model=Open1BLM(...), tasks=[...])` works; nothing here needs it.

Scores are the model program's own numbers: the log-probability of a token is minus the row
cross-entropy of the contract's fused LM-head cross-entropy (CONTRACT.md §6.8) for that position,
and is_greedy/generation use the greedy rule of `open1b generate` (mlx_open1b.generate.greedy: the
largest logit among the tokenizer's ids, ties to the smallest id, a NaN never chosen) on the LM-head
GEMM's logits of the same operands. A window
holds seq_len tokens: longer contexts are cut on the left; shorter windows are padded on the right
with the separator (causal attention: padding never changes earlier positions).

Offline tasks (files shipped in mlx_open1b/data/assets/eval-*.jsonl, no network): `arith`
(arithmetic in the default corpus's style), `facts` (encyclopedic completions), `code` (Python
completions) — multiple choice, metrics acc and acc_norm (log-likelihood per character) — and
`text` (held-out-style paragraphs, rolling log-likelihood: token perplexity and bits per byte).

The same files as lm-eval tasks (`lm_eval_task(name)`: an inline task config, `dataset_path: json`
on the shipped file, tasks named open1b_<name>), for the harness's own metrics:

    from lm_eval import simple_evaluate
    simple_evaluate(model=Open1BLM(run), tasks=[lm_eval_task("arith"), lm_eval_task("text")])

or by name, from YAML files (`write_lm_eval_tasks(DIR)`) and the registered model name (importing
this module registers it; the `lm_eval` command line does not import it):

    simple_evaluate(model="open1b", model_args="run_dir=RUN,step=S", tasks=["open1b_arith"],
                    task_manager=lm_eval.tasks.TaskManager(include_path=DIR))

tests/report/test_lm_eval_integration.py runs both, offline, when lm-eval is installed
(`pip install 'mlx-open1b[eval]'`; it is not in the test extra).
"""
from __future__ import annotations

import importlib.resources
import json
import math
import os
import pathlib

import numpy as np

from . import arrays
from .checkpoint import CheckpointError, load_checkpoint
from .data.tokenizer import DEFAULT_TOKENIZER_SHA256, Tokenizer
from .errors import Open1bError
from .fsutil import write_bytes_atomic
from .generate import greedy
from .model import Cache, Model, views
from .rundir import RunDir
from .train import TrainError, get_backend

try:                                                   # optional: lm-eval-harness
    from lm_eval.api.model import LM as _LMBase
except Exception:   # noqa: BLE001 - absent or broken install: plain object
    _LMBase = object

TASKS = {"arith": "multiple_choice", "facts": "multiple_choice", "code": "multiple_choice", "text": "rolling"}


class EvalError(Open1bError):
    """An evaluation that cannot run; the message names the run, step or file."""


def _args(req):
    return tuple(req.args) if hasattr(req, "args") else tuple(req)


class Open1BLM(_LMBase):
    """The model program at one checkpoint of a run, as an lm-eval model."""

    def __init__(self, run_dir, step: int | None = None, backend: str = "cpu_ref", batch_size: int | str = 8,
                 tokenizer=None, device=None, max_batch_size=None):
        # device, max_batch_size: what lm-eval's simple_evaluate passes every model it builds by name;
        # unused here (the backend chooses the device; batch_size "auto" means the default)
        if str(batch_size).startswith("auto"):
            batch_size = 8
        if _LMBase is not object:
            super().__init__()
        rd = RunDir(run_dir)
        run = rd.path
        info = rd.info(error=EvalError)
        self.cfg = info.config
        step = rd.select_checkpoint(step, EvalError)
        try:
            tensors, meta = load_checkpoint(rd.checkpoint(step))
        except CheckpointError as e:
            raise EvalError(str(e), exit_code=1) from None
        want, self.run_hash = rd.params_hash_after(step, info.genesis, EvalError)
        if meta.get("genesis") != info.genesis or (want is not None and meta.get("params_hash") != want):
            raise EvalError(f"{rd.checkpoint(step)}: does not match the run's ledger", exit_code=1)
        if tokenizer is None:
            if info.tokenizer_sha256 != DEFAULT_TOKENIZER_SHA256:
                raise EvalError(f"{run}: trained with tokenizer {info.tokenizer_sha256[:12]}…, not the "
                                f"shipped one; pass its tokenizer.json")
            tokenizer = Tokenizer.load(None)
        elif isinstance(tokenizer, (str, os.PathLike)):     # a path (str has an encode method too)
            tokenizer = Tokenizer.load(tokenizer)
        if tokenizer.vocab_size > self.cfg.model.vocab_size:
            raise EvalError(f"tokenizer vocabulary {tokenizer.vocab_size} > model.vocab_size {self.cfg.model.vocab_size}")
        try:
            self.ops = get_backend(backend)
        except TrainError as e:
            raise EvalError(str(e)) from None
        self.tok, self.step, self.backend, self.batch_size = tokenizer, step, backend, max(1, int(batch_size))
        self.run_dir = run
        self.params = self.ops.to_device(np.array(tensors["params"][0], copy=True))   # the backend's arrays
        self.model = Model(self.cfg.model, self.ops, precision=self.cfg.precision,
                           attention_pv=self.cfg.attention_pv)
        self.T = self.cfg.model.seq_len
        self.eot = tokenizer.eot_id
        self.n_candidates = tokenizer.vocab_size          # <= model.vocab_size (checked above)

    # ------------------------------------------------------------------ the forward pass
    def _logits(self, windows: np.ndarray, want_logits: bool):
        """windows (B, T+1) uint32 -> (logprob (B, T) float64 of each target, logits (B, T, V) fp32 or None)."""
        inputs, targets, B = self.model._split(windows)
        inputs, targets = self.ops.to_device(inputs), self.ops.to_device(targets)
        cache = Cache(B, self.T, inputs, targets) if want_logits else None
        _, _, ce_n = self.model._forward(self.params, inputs, targets, B, cache)
        lp = -arrays.to_host(ce_n).astype(np.float64).reshape(B, self.T)
        if not want_logits:
            return lp, None
        lm = arrays.contiguous(views(self.params, self.model.layout)["lm_head"])
        z = arrays.to_host(self.ops.linear_forward(cache.hn_b, lm))
        return lp, np.asarray(z, np.float32).reshape(B, self.T, -1)

    def _rows(self, windows: np.ndarray, want_logits: bool):
        """windows (B, T+1) uint32 -> (logprob (B, T) float64 of each target, greedy id (B, T) or None; -1
        where every logit is NaN)."""
        lp, z = self._logits(windows, want_logits)
        return lp, (None if z is None else greedy(z, self.n_candidates))

    def _next_logits(self, ids) -> np.ndarray:
        """The next-token logits (V,) fp32 after ids (at most T tokens), from their window."""
        w, n = self._window(np.asarray(ids, np.uint32))
        return self._logits(w[None], True)[1][0, n - 1]

    def _window(self, ids: np.ndarray) -> tuple[np.ndarray, int]:
        """The last T+1 tokens of ids padded on the right: (window, number of real tokens)."""
        ids = np.asarray(ids, np.uint32)[-(self.T + 1):]
        w = np.full(self.T + 1, self.eot, np.uint32)
        w[:len(ids)] = ids
        return w, len(ids)

    def loglikelihood_tokens(self, pairs, want_greedy: bool = True) -> list[tuple[float, bool]]:
        """[(context ids, continuation ids)] -> [(sum log p(continuation | context), is greedy)]."""
        out: list = [None] * len(pairs)
        jobs = []
        for i, (ctx, cont) in enumerate(pairs):
            ctx, cont = np.asarray(ctx, np.uint32), np.asarray(cont, np.uint32)
            if len(cont) == 0:
                raise EvalError(f"request {i}: empty continuation")
            if len(cont) > self.T:
                raise EvalError(f"request {i}: continuation of {len(cont)} tokens exceeds seq_len {self.T}")
            if len(ctx) == 0:
                ctx = np.array([self.eot], np.uint32)
            w, n = self._window(np.concatenate([ctx, cont]))
            jobs.append((i, w, n, len(cont)))
        for b0 in range(0, len(jobs), self.batch_size):
            chunk = jobs[b0:b0 + self.batch_size]
            lp, am = self._rows(np.stack([w for _, w, _, _ in chunk]), want_greedy)
            for k, (i, w, n, c) in enumerate(chunk):
                pos = slice(n - 1 - c, n - 1)          # target positions of the continuation
                greedy = bool((am[k, pos] == w[n - c:n]).all()) if am is not None else False
                out[i] = (float(lp[k, pos].sum()), greedy)
        return out

    def _encode_pair(self, context: str, continuation: str):
        n_sp = len(context) - len(context.rstrip())
        if n_sp:                                     # lm-eval's convention: trailing spaces go right
            context, continuation = context[:-n_sp], context[-n_sp:] + continuation
        whole = self.tok.encode(context + continuation)
        ctx = self.tok.encode(context)
        if len(ctx) <= len(whole) and np.array_equal(whole[:len(ctx)], ctx):
            return ctx, whole[len(ctx):]
        return ctx, self.tok.encode(continuation)

    # ------------------------------------------------------------------ lm-eval interface
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return self.loglikelihood_tokens([self._encode_pair(*_args(r)[:2]) for r in requests])

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for r in requests:
            ids = self.tok.encode(_args(r)[0])
            full = np.concatenate([[self.eot], ids]).astype(np.uint32)
            total, pairs = 0.0, []
            for s in range(0, len(ids), self.T):
                piece = full[s:s + self.T + 1]
                pairs.append((piece[:1], piece[1:]))
            for ll, _ in self.loglikelihood_tokens(pairs, want_greedy=False):
                total += ll
            out.append(total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for r in requests:
            a = _args(r)
            context, kw = a[0], (a[1] if len(a) > 1 and isinstance(a[1], dict) else {})
            until = kw.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kw.get("max_gen_toks", 32))
            ids = list(self.tok.encode(context)) or [self.eot]
            new: list[int] = []
            text = ""
            for i in range(max_new):
                nxt = int(greedy(self._next_logits((ids + new)[-self.T:]), self.n_candidates))
                if nxt < 0:
                    raise EvalError(f"generate_until: request {len(out)}, generated token {i}: every logit is NaN "
                                    f"(the checkpoint's parameters are broken)", exit_code=3)
                if nxt == self.eot:
                    break
                new.append(nxt)
                text = self.tok.decode(new)
                if any(u in text for u in until):
                    break
            for u in until:
                if u in text:
                    text = text[:text.index(u)]
            out.append(text)
        return out


if _LMBase is not object:    # pragma: no cover - only with lm-eval installed
    try:
        from lm_eval.api.registry import register_model
        register_model("open1b")(Open1BLM)
    except Exception:   # noqa: BLE001 - already registered, or an incompatible version
        pass


# ------------------------------------------------------------------------------- offline tasks
def load_task(name: str) -> list[dict]:
    if name not in TASKS:
        raise EvalError(f"unknown task {name!r} (tasks: {', '.join(TASKS)})")
    p = importlib.resources.files("mlx_open1b.data") / "assets" / f"eval-{name}.jsonl"
    return [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]


def evaluate(lm: Open1BLM, tasks, limit: int | None = None) -> dict:
    """{task: metrics} on the shipped offline tasks."""
    res = {}
    for name in tasks:
        items = load_task(name)[:limit]
        if TASKS[name] == "multiple_choice":
            reqs = [(it["context"], ch) for it in items for ch in it["choices"]]
            lls = [ll for ll, _ in lm.loglikelihood(reqs)]
            acc = acc_norm = 0
            k = 0
            for it in items:
                n = len(it["choices"])
                sc = lls[k:k + n]
                k += n
                acc += int(np.argmax(sc)) == it["answer"]
                acc_norm += int(np.argmax([s / max(1, len(c)) for s, c in zip(sc, it["choices"])])) == it["answer"]
            res[name] = {"n": len(items), "acc": acc / len(items), "acc_norm": acc_norm / len(items),
                         "chance": float(np.mean([1 / len(it["choices"]) for it in items]))}
        else:
            texts = [it["text"] for it in items]
            lls = lm.loglikelihood_rolling([(t,) for t in texts])
            ntok = sum(len(lm.tok.encode(t)) for t in texts)
            nbytes = sum(len(t.encode("utf-8")) for t in texts)
            nll = -sum(lls)
            res[name] = {"n": len(items), "tokens": ntok, "token_perplexity": math.exp(nll / ntok),
                         "bits_per_byte": nll / nbytes / math.log(2)}
    return res


def lm_eval_task(name: str, cache_dir=None) -> dict:
    """The lm-eval (>= 0.4) task config of a shipped offline task, reading the shipped jsonl file
    through the `json` dataset builder (no network); cache_dir: where `datasets` caches it."""
    if name not in TASKS:
        raise EvalError(f"unknown task {name!r} (tasks: {', '.join(TASKS)})")
    path = str(importlib.resources.files("mlx_open1b.data") / "assets" / f"eval-{name}.jsonl")
    kw: dict = {"data_files": {"test": path}}
    if cache_dir is not None:
        kw["cache_dir"] = str(cache_dir)
    cfg = {"task": f"open1b_{name}", "dataset_path": "json", "dataset_kwargs": kw, "test_split": "test",
           "metadata": {"version": 1.0}}
    if TASKS[name] == "multiple_choice":       # choices carry their leading space: no target delimiter
        cfg.update(output_type="multiple_choice", doc_to_text="context", doc_to_choice="choices",
                   doc_to_target="answer", target_delimiter="",
                   metric_list=[{"metric": "acc"}, {"metric": "acc_norm"}])
    else:
        cfg.update(output_type="loglikelihood_rolling", doc_to_text="", doc_to_target="text",
                   metric_list=[{"metric": m} for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")])
    return cfg


def write_lm_eval_tasks(out_dir, names=None, cache_dir=None) -> list[pathlib.Path]:
    """open1b_<name>.yaml for lm-eval's --include_path (JSON text, which YAML reads)."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in names or list(TASKS):
        path = out / f"open1b_{name}.yaml"
        write_bytes_atomic(path, (json.dumps(lm_eval_task(name, cache_dir), indent=2) + "\n").encode())
        paths.append(path)
    return paths
