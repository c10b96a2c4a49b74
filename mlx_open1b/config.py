"""Typed configuration: the model, the recipe, and the presets (tiny, small, open1b).

A run's configuration is data: these dataclasses are written to the run directory as JSON and
read back unchanged. Every field has help text (`field_help`). Schedules are anchored to
consumed tokens (paper §3.2), computed with host arithmetic only (hostmath: binary64 + - * /).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from .errors import Open1bError
from .gnmr import GNMRConfig, GNMRError
from .hostmath import cos_pi_f64


class ConfigError(Open1bError, ValueError):
    """A configuration that cannot work; the message names the field."""


def _f(default, help: str, **kw):
    return field(default=default, metadata={"help": help}, **kw)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = _f(8192, "vocabulary size (the tokenizer's)")
    d_model: int = _f(128, "residual stream width")
    n_layers: int = _f(4, "transformer blocks")
    n_heads: int = _f(4, "query heads")
    n_kv_heads: int = _f(2, "key/value heads (grouped-query attention); divides n_heads")
    head_dim: int = _f(32, "dimension of one head (even, for RoPE)")
    ffn_hidden: int = _f(352, "SwiGLU hidden size F (gate and up are one (2F, d) GEMM)")
    seq_len: int = _f(128, "tokens per training sequence (windows hold seq_len + 1)")
    window: int = _f(32, "sliding attention window of local layers")
    global_every: int = _f(5, "every global_every-th layer (and the last) attends globally")
    rope_theta: float = _f(500000.0, "RoPE base")
    norm_eps: float = _f(1e-6, "RMSNorm epsilon (also QK-norm)")
    z_loss: float = _f(1e-4, "z-loss coefficient, fused with cross-entropy")
    init_sigma: float = _f(0.02, "truncated-normal init sigma (cut at 2 sigma)")

    def check(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                     "ffn_hidden", "seq_len", "window", "global_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"model.n_kv_heads ({self.n_kv_heads}) must divide model.n_heads ({self.n_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"model.head_dim must be even for RoPE, got {self.head_dim}")
        if self.window > self.seq_len:
            raise ConfigError(f"model.window ({self.window}) is larger than model.seq_len ({self.seq_len})")

    def is_global(self, layer: int) -> bool:
        """Every global_every-th layer (1-based) and the last layer attend globally."""
        return (layer + 1) % self.global_every == 0 or layer == self.n_layers - 1

    def layer_window(self, layer: int) -> int:
        """The attention window of a layer; 0 means global (causal only)."""
        return 0 if self.is_global(layer) else self.window

    def param_shapes(self) -> list[tuple[str, tuple[int, ...], bool]]:
        """(name, shape, decayed) in the canonical order of the contiguous parameter buffer.
        decayed: weight decay applies (linear layers and the LM head, not embeddings or gains)."""
        d, h, g, hd, F, V = self.d_model, self.n_heads, self.n_kv_heads, self.head_dim, self.ffn_hidden, self.vocab_size
        out = [("wte", (V, d), False), ("emb_norm", (d,), False)]
        for l in range(self.n_layers):
            p = f"layers.{l}."
            out += [(p + "attn_norm", (d,), False), (p + "wq", (h * hd, d), True), (p + "wk", (g * hd, d), True),
                    (p + "wv", (g * hd, d), True), (p + "wo", (d, h * hd), True),
                    (p + "ffn_norm", (d,), False), (p + "w_gate_up", (2 * F, d), True), (p + "w_down", (d, F), True)]
        out += [("final_norm", (d,), False), ("lm_head", (V, d), True)]
        return out

    def n_params(self) -> int:
        return sum(_prod(s) for _, s, _ in self.param_shapes())

    def n_nonembedding(self) -> int:
        """Parameters outside the input embedding and the LM head."""
        return sum(_prod(s) for n, s, _ in self.param_shapes() if n not in ("wte", "lm_head"))


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@dataclass(frozen=True)
class TrainConfig:
    seed: int = _f(42, "the run's single seed: init, data order, everything")
    microbatch_seqs: int = _f(4, "sequences per microbatch")
    phases: tuple = _f(((0, 2),), "batch phases: ((from_tokens, microbatches per step), ...) by consumed tokens")
    total_tokens: int = _f(2_000_000, "token budget: the cosine ends here")
    peak_lr: float = _f(3e-3, "peak learning rate")
    warmup_tokens: int = _f(40_960, "linear warmup, in consumed tokens")
    final_lr_frac: float = _f(0.1, "the cosine decays to this fraction of the peak at total_tokens")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    eps: float = _f(1e-8, "AdamW epsilon")
    weight_decay: float = _f(0.1, "decoupled weight decay (linear layers and LM head only)")
    clip_norm: float = _f(1.0, "global l2 clip")
    spike_threshold: float = _f(5.0, "a pre-clip norm above this skips the next spike_skip steps")
    spike_skip: int = _f(5, "optimizer steps skipped after a spike")
    checkpoint_every: int = _f(100, "steps between checkpoints")
    eval_every: int = _f(50, "steps between held-out mixture CE evaluations")
    eval_windows: int = _f(8, "held-out windows per source for the mixture CE")

    def check(self, model: ModelConfig) -> None:
        if self.microbatch_seqs < 1:
            raise ConfigError(f"train.microbatch_seqs must be >= 1, got {self.microbatch_seqs}")
        starts = [p[0] for p in self.phases]
        if not self.phases or starts[0] != 0 or starts != sorted(starts) or any(p[1] < 1 for p in self.phases):
            raise ConfigError(f"train.phases must start at 0 tokens, ascend, and have >= 1 microbatch: {self.phases}")
        if not 0 <= self.warmup_tokens < self.total_tokens:
            raise ConfigError(f"train.warmup_tokens ({self.warmup_tokens}) must be in [0, total_tokens)")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ConfigError("train.beta1 and train.beta2 must be in [0, 1)")
        if not 0 <= self.seed < 2 ** 64:
            raise ConfigError(f"train.seed must be in [0, 2^64), got {self.seed}")

    def tokens_per_step(self, model: ModelConfig, consumed: int) -> tuple[int, int]:
        """(microbatches, tokens) of the step taken when `consumed` tokens have been consumed."""
        m = self.phases[0][1]
        for start, mm in self.phases:
            if consumed >= start:
                m = mm
        return m, m * self.microbatch_seqs * model.seq_len

    def lr_at(self, consumed_after: int) -> float:
        """Learning rate of the step whose batch brings the consumed tokens to `consumed_after`:
        linear warmup to the peak over warmup_tokens, then one cosine to final_lr_frac * peak at
        total_tokens, held there after. binary64 + - * / only (cos from hostmath)."""
        peak, t = self.peak_lr, consumed_after
        if t < self.warmup_tokens:
            return peak * t / self.warmup_tokens
        if t >= self.total_tokens:
            return peak * self.final_lr_frac
        frac = (t - self.warmup_tokens) / (self.total_tokens - self.warmup_tokens)
        low = peak * self.final_lr_frac
        return low + (peak - low) * 0.5 * (1.0 + cos_pi_f64(frac))


def steps_for_tokens(train: TrainConfig, model: ModelConfig, budget: int) -> int:
    """Optimizer steps until at least `budget` tokens are consumed (each step's batch size by the
    phase its starting token count falls in)."""
    consumed, steps = 0, 0
    while consumed < budget:
        consumed += train.tokens_per_step(model, consumed)[1]
        steps += 1
    return steps


PRECISIONS = ("bf16", "int8", "int6", "int4")


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = _f(ModelConfig(), "the architecture")
    train: TrainConfig = _f(TrainConfig(), "the recipe")
    preset: str = _f("tiny", "the preset this configuration started from")
    precision: str = _f("bf16", "linear-layer arithmetic of the attention Q/K/V/O and FFN GEMMs: bf16 "
                                "(CONTRACT.md §6.1), int8 (W8A8 quantized, §6.9), int6 or int4 (§6.9's simulated "
                                "int6 / int4 paths, GNMR's low-cost stress paths)")
    gnmr: object = _f(None, "GNMR precision controller (mlx_open1b.gnmr.GNMRConfig; CONTRACT.md §13), or None")
    attention_pv: str = _f("int8", "attention forward of the quantized precisions: int8 (the P·V product in "
                                   "int8, CONTRACT.md §6.10) or fp32 (§6.6: int8 runs started before §6.10)")

    def check(self) -> "RunConfig":
        self.model.check()
        self.train.check(self.model)
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.attention_pv not in ("int8", "fp32"):
            raise ConfigError(f"attention_pv must be int8 or fp32, got {self.attention_pv!r}")
        if self.gnmr is not None:
            if not isinstance(self.gnmr, GNMRConfig):
                raise ConfigError(f"gnmr: expected a GNMRConfig, got {type(self.gnmr).__name__}")
            try:
                self.gnmr.check(self.precision)
            except GNMRError as e:
                raise ConfigError(str(e)) from None
        return self

    def to_json(self) -> dict:
        """The JSON form, in the oldest version that expresses this config (the rule at _ADDED_KEYS)."""
        d = dataclasses.asdict(self)
        for key, (_, written, _) in _ADDED_KEYS.items():
            if not written(self):
                del d[key]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "RunConfig":
        """A config from its JSON form of any version (the rule at _ADDED_KEYS): a key that version
        lacks reads as that version meant it."""
        try:
            m = ModelConfig(**d["model"])
            t = dict(d["train"])
            t["phases"] = tuple(tuple(p) for p in t["phases"])
            given = {key: d[key] if key in d else absent(d) for key, (_, _, absent) in _ADDED_KEYS.items()}
            if given["gnmr"] is not None:
                missing = sorted(f.name for f in dataclasses.fields(GNMRConfig) if f.name not in d["gnmr"])
                if missing:
                    raise ConfigError(f"config gnmr: missing {', '.join(missing)} (a run's controller settings are "
                                      f"written in full)")
                given["gnmr"] = GNMRConfig(**d["gnmr"])
            return cls(model=m, train=TrainConfig(**t), preset=d.get("preset", "custom"),
                       precision=d.get("precision", "bf16"), **given)
        except (KeyError, TypeError) as e:
            raise ConfigError(f"config: malformed ({e})") from None

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)


# ------------------------------------------------------------------------ the config's JSON form
# The rule for every change to RunConfig's JSON, kept here and nowhere else. A run's config JSON
# is hashed into its genesis (ledger.genesis_hash, part of every run hash) and written into
# run.json and every checkpoint's meta.json, so a new field must leave the JSON of every config
# that could be written before it byte for byte as it was. Version 1 of the form has the keys
# model, train, preset and precision; each later version adds a key (_ADDED_KEYS). A config is
# written in the oldest version that expresses it: an added key is written only when the config
# needs it. A reader infers the version from the keys present (config_version) and reads each
# absent key as the versions without it meant it. The version number itself is never written:
# writing it would change the genesis of every run.
_ADDED_KEYS = {   # key: (version, written(config), its value when absent(config JSON))
    # a GNMR controller (CONTRACT.md §13): written only when the run has one
    "gnmr": (2, lambda c: c.gnmr is not None, lambda d: None),
    # the quantized precisions' int8 P·V attention forward (§6.10): written only when a quantized
    # run uses it (bf16 runs have no quantized attention); quantized configs without the key were
    # written before §6.10, and their attention forward is §6.6's (fp32)
    "attention_pv": (3, lambda c: c.precision != "bf16" and c.attention_pv != "fp32",
                     lambda d: "int8" if d.get("precision", "bf16") == "bf16" else "fp32"),
}


def config_version(d: dict) -> int:
    """The version of a config's JSON form: the newest version among its keys (rule above)."""
    return max([1] + [v for key, (v, _, _) in _ADDED_KEYS.items() if key in d])


# ---------------------------------------------------------------------------------- presets
_PAPER_WARMUP_BATCH = 768 * 4096       # tokens per step in the warmup phase (Table 4)

PRESETS: dict[str, RunConfig] = {
    # trains on the embedded default corpus in about five minutes on 2 CPU cores
    "tiny": RunConfig(ModelConfig(), TrainConfig(total_tokens=1_000_000, warmup_tokens=20_480,
                                                 checkpoint_every=50, eval_every=50), "tiny"),
    "small": RunConfig(
        ModelConfig(d_model=256, n_layers=8, n_heads=8, n_kv_heads=2, head_dim=32, ffn_hidden=704,
                    seq_len=256, window=64),
        TrainConfig(microbatch_seqs=4, phases=((0, 4),), total_tokens=20_000_000, peak_lr=1.5e-3,
                    warmup_tokens=400_000, checkpoint_every=100, eval_every=100), "small"),
    # exactly the paper's Tables 3 and 4: 24 x 2048, 16/4 heads of 128, FFN 5632, vocab 128,256,
    # seq 4096, window 512 (global every 5th layer), 48 GPUs x 4 sequences, accumulation 4 / 6 / 12
    "open1b": RunConfig(
        ModelConfig(vocab_size=128_256, d_model=2048, n_layers=24, n_heads=16, n_kv_heads=4, head_dim=128,
                    ffn_hidden=5632, seq_len=4096, window=512),
        TrainConfig(microbatch_seqs=4, phases=((0, 192), (4_000_000_000, 288), (360_000_000_000, 576)),
                    total_tokens=400_000_000_000, peak_lr=4.5e-4, warmup_tokens=667 * _PAPER_WARMUP_BATCH,
                    checkpoint_every=100, eval_every=1000, eval_windows=64), "open1b", precision="int8"),
}


def preset(name: str) -> RunConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return PRESETS[name]
