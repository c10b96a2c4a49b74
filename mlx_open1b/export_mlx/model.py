"""Open-1B in MLX (shipped by `open1b export --format mlx`). Self-contained: needs only `mlx`.

    import sys; sys.path.insert(0, DIR)
    import model
    m = model.load(DIR)                                   # config.json + weights.safetensors
    logits = m(mx.array([[ids...]]))                      # (B, T, vocab) float32
    new_ids = model.generate(m, prompt_ids, max_tokens=32)

The architecture of mlx-open1b's model program in `mlx.nn` (not its reproducible arithmetic):
    h = RMSNorm(wte[ids], emb_norm)
    per layer: a = RMSNorm(h, attn_norm); q, k, v = a wqᵀ, a wkᵀ, a wvᵀ
               q, k = gain-free RMSNorm of each head, then RoPE (rotate-half, i pairs with i + D/2)
               o = causal grouped-query attention, scale 1/sqrt(D), keys within layer_windows[l]
                   positions (0: all); h = h + o woᵀ
               f = RMSNorm(h, ffn_norm); [g | u] = f w_gate_upᵀ; h = h + (silu(g) * u) w_downᵀ
    logits = RMSNorm(h, final_norm) lm_headᵀ
Parameters keep the model program's names and (out, in) shapes. The weights are bf16; `load`
widens them exactly to float32 (the default) and every activation is float32, so the logits are
the program's up to its bf16 roundings of the GEMM inputs (which this forward does not make).

Generation (`generate`, `generate_step`) follows `open1b generate`'s window rule: the context is the
last seq_len tokens of prompt + generated, at positions 0..; a key/value cache serves each new token
until the context is longer than seq_len, after which every token recomputes its window (every
position moves). Greedy choice: the largest logit among the candidate ids, ties to the smallest id,
a NaN never chosen. temperature > 0 samples with mx.random (not `open1b generate`'s Philox draws).
"""
import json
import math
import pathlib

import mlx.core as mx
import mlx.nn as nn

WEIGHTS = "weights.safetensors"
FORMAT = "open1b-export/1"


class ModelArgs:
    """config.json's architecture: vocab_size, d_model, n_layers, n_heads, n_kv_heads, head_dim,
    ffn_hidden, seq_len, rope_theta, norm_eps, and layer_windows (0: global attention)."""

    def __init__(self, architecture: dict, layer_windows, eos_token_id=None, n_candidates=None):
        a = architecture
        self.vocab_size, self.d_model, self.n_layers = int(a["vocab_size"]), int(a["d_model"]), int(a["n_layers"])
        self.n_heads, self.n_kv_heads, self.head_dim = int(a["n_heads"]), int(a["n_kv_heads"]), int(a["head_dim"])
        self.ffn_hidden, self.seq_len = int(a["ffn_hidden"]), int(a["seq_len"])
        self.rope_theta, self.norm_eps = float(a["rope_theta"]), float(a["norm_eps"])
        self.layer_windows = [int(w) for w in layer_windows]
        if len(self.layer_windows) != self.n_layers:
            raise ValueError(f"layer_windows: {len(self.layer_windows)} entries for {self.n_layers} layers")
        self.eos_token_id = eos_token_id
        self.n_candidates = self.vocab_size if n_candidates is None else min(int(n_candidates), self.vocab_size)


def _rms(x, g, eps):
    y = x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if g is None else y * g


class _Rope:
    """cos, sin (positions, D/2) float32 tables, angles in float64 (Python floats): seq_len positions,
    doubled when a longer sequence asks for more (not rebuilt for each new token)."""

    def __init__(self, D, theta, seq_len):
        self.D, self.freq, self.seq_len = D, [theta ** (-2.0 * i / D) for i in range(D // 2)], seq_len
        self.cos = self.sin = None

    def tables(self, n):
        have = 0 if self.cos is None else self.cos.shape[0]
        if have < n:
            ang = [[p * f for f in self.freq] for p in range(max(n, 2 * have, self.seq_len))]
            self.cos = mx.array([[math.cos(a) for a in row] for row in ang], dtype=mx.float32)
            self.sin = mx.array([[math.sin(a) for a in row] for row in ang], dtype=mx.float32)
        return self.cos, self.sin

    def __call__(self, x, offset):
        """x (B, T, R, D) at positions offset .. offset + T - 1."""
        T, D = x.shape[1], self.D
        cos, sin = self.tables(offset + T)
        c, s = cos[offset:offset + T][None, :, None, :], sin[offset:offset + T][None, :, None, :]
        x1, x2 = x[..., :D // 2], x[..., D // 2:]
        return mx.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


class KVCache:
    """One layer's keys (after RoPE) and values, (B, n_kv_heads, n, D) float32."""

    def __init__(self):
        self.keys = self.values = None

    @property
    def offset(self):
        return 0 if self.keys is None else self.keys.shape[2]

    def update(self, k, v):
        if self.keys is not None:
            k, v = mx.concatenate([self.keys, k], axis=2), mx.concatenate([self.values, v], axis=2)
        self.keys, self.values = k, v
        return k, v


class Layer(nn.Module):
    def __init__(self, args: ModelArgs, window: int, rope: _Rope):
        super().__init__()
        d, H, G, D, F = args.d_model, args.n_heads, args.n_kv_heads, args.head_dim, args.ffn_hidden
        self.attn_norm, self.ffn_norm = mx.ones((d,)), mx.ones((d,))
        self.wq, self.wk, self.wv = mx.zeros((H * D, d)), mx.zeros((G * D, d)), mx.zeros((G * D, d))
        self.wo, self.w_gate_up, self.w_down = mx.zeros((d, H * D)), mx.zeros((2 * F, d)), mx.zeros((d, F))
        self._cfg = (H, G, D, F, window, args.norm_eps)
        self._rope = rope

    def __call__(self, h, offset, cache=None):
        H, G, D, F, window, eps = self._cfg
        B, T, _ = h.shape
        a = _rms(h, self.attn_norm, eps)
        q = self._rope(_rms((a @ self.wq.T).reshape(B, T, H, D), None, eps), offset).transpose(0, 2, 1, 3)
        k = self._rope(_rms((a @ self.wk.T).reshape(B, T, G, D), None, eps), offset).transpose(0, 2, 1, 3)
        v = (a @ self.wv.T).reshape(B, T, G, D).transpose(0, 2, 1, 3)
        if cache is not None:
            k, v = cache.update(k, v)                     # keys at positions 0 .. offset + T - 1
        n = k.shape[2]
        qi = mx.arange(offset, offset + T)[:, None]
        kj = mx.arange(n)[None, :]
        vis = kj <= qi
        if window:
            vis = vis & (qi - kj < window)
        k, v = mx.repeat(k, H // G, axis=1), mx.repeat(v, H // G, axis=1)
        s = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(D))
        s = mx.where(vis, s, -mx.inf)                      # the query's own key is always visible
        o = (mx.softmax(s, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(B, T, H * D)
        h = h + o @ self.wo.T
        gu = _rms(h, self.ffn_norm, eps) @ self.w_gate_up.T
        g, u = gu[..., :F], gu[..., F:]
        return h + (g * mx.sigmoid(g) * u) @ self.w_down.T


class Open1B(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        d, V = args.d_model, args.vocab_size
        rope = _Rope(args.head_dim, args.rope_theta, args.seq_len)
        self.wte, self.emb_norm = mx.zeros((V, d)), mx.ones((d,))
        self.layers = [Layer(args, w, rope) for w in args.layer_windows]
        self.final_norm, self.lm_head = mx.ones((d,)), mx.zeros((V, d))

    def __call__(self, tokens, cache=None):
        """tokens (B, T) int -> next-token logits (B, T, vocab) float32; cache: make_cache()'s list,
        holding the keys and values of the positions before these (extended in place)."""
        offset = 0 if cache is None else cache[0].offset
        eps = self.args.norm_eps
        h = _rms(self.wte[tokens].astype(mx.float32), self.emb_norm, eps)
        for l, layer in enumerate(self.layers):
            h = layer(h, offset, None if cache is None else cache[l])
        return _rms(h, self.final_norm, eps) @ self.lm_head.T

    def make_cache(self):
        return [KVCache() for _ in self.layers]


def load(path, dtype=mx.float32) -> Open1B:
    """The model of an `open1b export --format mlx` directory, weights widened (exactly) to dtype
    (mx.bfloat16: kept as stored; the activations stay float32 either way)."""
    d = pathlib.Path(path)
    try:
        conf = json.loads((d / "config.json").read_text())
    except FileNotFoundError:
        raise ValueError(f"{d}: no config.json (not an open1b export)") from None
    if not isinstance(conf, dict) or conf.get("format") != FORMAT or conf.get("export_format") != "mlx":
        raise ValueError(f"{d / 'config.json'}: not an open1b --format mlx export")
    args = ModelArgs(conf["architecture"], conf["layer_windows"], conf.get("eos_token_id"),
                     conf.get("tokenizer_vocab_size"))
    m = Open1B(args)
    weights = mx.load(str(d / WEIGHTS))
    m.load_weights([(n, w.astype(dtype)) for n, w in weights.items()], strict=True)
    mx.eval(m.parameters())
    return m


def choose_greedy(z, n_candidates):
    """The largest of z[:n_candidates] (float32), ties to the smallest id, a NaN never chosen."""
    z = z[:n_candidates]
    nan = mx.isnan(z)
    top = mx.max(mx.where(nan, -mx.inf, z))
    hit = (z == top) & ~nan
    if not hit.any().item():
        raise ValueError("every logit is NaN")
    return int(mx.min(mx.where(hit, mx.arange(z.shape[0]), z.shape[0])).item())


def generate_step(model: Open1B, prompt_ids, max_tokens: int, temperature: float = 0.0, seed: int = 0,
                  use_cache: bool = True, stop_at_eos: bool = True):
    """Yield (token id, logits (vocab,) float32 it was chosen from), one new token at a time."""
    args = model.args
    ids = [int(i) for i in prompt_ids]
    if not ids:
        raise ValueError("prompt_ids: empty (give at least one token)")
    bad = [i for i in ids if not 0 <= i < args.vocab_size]
    if bad:
        raise ValueError(f"prompt_ids: id {bad[0]} outside the vocabulary [0, {args.vocab_size})")
    key = mx.random.key(seed)
    cache, cached = None, 0                 # the cache holds the keys/values of ids[:cached]
    for i in range(max_tokens):
        if use_cache and cache is not None and len(ids) <= args.seq_len and cached == len(ids) - 1:
            z = model(mx.array([ids[-1:]]), cache)[0, -1]
        else:                                # the window: the last seq_len tokens at positions 0..
            window = ids[-args.seq_len:]
            cache = model.make_cache() if use_cache else None
            z = model(mx.array([window]), cache)[0, -1]
        cached = len(ids)
        if temperature == 0:
            nxt = choose_greedy(z, args.n_candidates)
        else:
            key, sub = mx.random.split(key)
            zc = z[:args.n_candidates]
            nxt = int(mx.random.categorical(mx.where(mx.isnan(zc), -mx.inf, zc) / temperature, key=sub).item())
        if stop_at_eos and nxt == args.eos_token_id:
            return
        yield nxt, z
        ids.append(nxt)


def generate(model: Open1B, prompt_ids, max_tokens: int, temperature: float = 0.0, seed: int = 0,
             use_cache: bool = True) -> list:
    """The generated token ids (at most max_tokens; stops before the end-of-text id)."""
    return [t for t, _ in generate_step(model, prompt_ids, max_tokens, temperature, seed, use_cache)]
