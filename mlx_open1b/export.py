"""Export a checkpoint's weights for use elsewhere (`open1b export RUN --step S --format mlx|hf`).

Both formats write into a new directory (atomically: built beside it, then renamed):

    weights.safetensors (mlx) / model.safetensors (hf)   the parameters, bf16, bit-identical to the
                                                         checkpoint's (written by checkpoint.py's own
                                                         safetensors writer; no extra dependency)
    config.json                                          the architecture (below) and provenance: run
                                                         hash, genesis, step, the ledger's parameter hash
    tokenizer.json                                       the run's tokenizer (the shipped one, or the file given
                                                         as `tokenizer`, whose SHA-256 must be the run's)
    README.md                                            what maps to other libraries and what does not
    configuration_open1b.py, modeling_open1b.py (hf)     the model for `transformers`, named by config.json's
                                                         `auto_map`: AutoModelForCausalLM.from_pretrained(DIR,
                                                         trust_remote_code=True) loads it and generates
    model.py (mlx)                                       the model in `mlx.nn` (mlx_open1b/export_mlx/model.py),
                                                         needing only mlx: `model.load(DIR)`, `model.generate`
    tokenizer_config.json (hf, with tokenizer.json)      so AutoTokenizer.from_pretrained(DIR) loads the tokenizer

`mlx`: tensors under the model program's names (`wte`, `emb_norm`, `layers.<l>.attn_norm`, `wq`, `wk`,
`wv`, `wo`, `ffn_norm`, `w_gate_up` = [gate | up], `w_down`, `final_norm`, `lm_head`), shapes (out, in);
`mx.load` reads them, the shipped model.py runs them without this package (float32 activations),
`mlx_forward` below runs them in plain MLX, and `torch_state_dict` loads them into
`mlx_open1b.torch_model.TorchModel` (`load_state_dict`, strict).

Only bf16 runs export by default: a quantized run's logits come from its int8/int6/int4 GEMMs (CONTRACT.md
§6.9), which neither shipped model computes, so its float export would not be the model that was trained.
`float_model=True` (`--float-model`) exports such a run's master weights all the same, as a float model
(bit-identical weights; config.json's `source.float_model` and README.md say it does not compute the run's
quantized GEMMs), for a user who wants the weights in another tool knowing its logits are not the run's.

`hf`: the same weights under Hugging Face Llama names (`model.embed_tokens.weight`,
`model.layers.<l>.self_attn.{q,k,v,o}_proj.weight`, `input_layernorm`, `post_attention_layernorm`,
`mlp.{gate,up,down}_proj.weight` with w_gate_up split in its gate and up halves, `model.norm.weight`,
`lm_head.weight`) plus `model.embed_norm.weight`, and a Llama-like config.json with
`model_type: "open1b"` and the model code (mlx_open1b/export_hf/) that computes all of it. What does
NOT map onto HF/mlx-lm Llama (a Llama loader would silently compute
something else, so the config does not claim to be Llama):
  - the RMSNorm on the embedding output (`embed_norm`; it can be folded into the embedding table in
    fp32, at the cost of one more rounding if stored in bf16);
  - QK-norm: a gain-free RMSNorm of every query and key head before RoPE (Qwen3's q_norm/k_norm with
    all-ones weights is the same operation; Llama has none);
  - sliding-window attention on local layers (`layer_types`, `sliding_window`; every
    `global_every`-th layer and the last are global): Llama attends globally everywhere;
  - the z-loss (training only; no effect on inference).
Everything else is Llama's: untied embeddings, pre-norm RMSNorm blocks with gains, grouped-query
attention with scale 1/sqrt(head_dim), RoPE in the rotate-half convention (element i pairs with
i + D/2, HF's `rotate_half`), SwiGLU (silu(gate) * up), no biases.
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import tempfile

import numpy as np

from . import __version__, cpu_ref
from .checkpoint import CheckpointError, load_checkpoint, read_safetensors, write_safetensors
from .config import ModelConfig
from .data.tokenizer import DEFAULT_TOKENIZER_SHA256, EOT
from .errors import Open1bError
from .fsutil import WriteError, write_file
from .model import Model, ParamLayout, views
from .rundir import RunDir

# torch and mlx are optional (the `torch` and `metal` extras): imported by the exports that use them

FORMAT = "open1b-export/1"
FILES = {"mlx": "weights.safetensors", "hf": "model.safetensors"}
HF_CODE = ("configuration_open1b.py", "modeling_open1b.py")       # copied from mlx_open1b/export_hf/
_HF_DIR = pathlib.Path(__file__).resolve().parent / "export_hf"
MLX_CODE = ("model.py",)                                            # copied from mlx_open1b/export_mlx/
_MLX_DIR = pathlib.Path(__file__).resolve().parent / "export_mlx"
NOT_MAPPED = [
    "embed_norm: RMSNorm (with gain) on the embedding output; no Llama equivalent (foldable into the "
    "embedding table in fp32)",
    "qk_norm: gain-free RMSNorm of each query and key head before RoPE; Llama has none (Qwen3's q_norm/k_norm "
    "with all-ones weights is the same operation)",
    "sliding windows: local layers attend to the last `sliding_window` positions, every global_every-th layer "
    "and the last one globally (`layer_types`); Llama attends globally everywhere",
    "z_loss: a training-only term; no effect on inference",
]


class ExportError(Open1bError):
    """An export that cannot be made or read; the message names the file, step or tensor."""


# ------------------------------------------------------------------------------- names
def hf_names(cfg: ModelConfig) -> dict[str, tuple[str, slice | None]]:
    """HF name -> (canonical name, row slice of it or None)."""
    F = cfg.ffn_hidden
    out = {"model.embed_tokens.weight": ("wte", None), "model.embed_norm.weight": ("emb_norm", None)}
    for l in range(cfg.n_layers):
        p, q = f"layers.{l}.", f"model.layers.{l}."
        out.update({q + "input_layernorm.weight": (p + "attn_norm", None),
                    q + "self_attn.q_proj.weight": (p + "wq", None), q + "self_attn.k_proj.weight": (p + "wk", None),
                    q + "self_attn.v_proj.weight": (p + "wv", None), q + "self_attn.o_proj.weight": (p + "wo", None),
                    q + "post_attention_layernorm.weight": (p + "ffn_norm", None),
                    q + "mlp.gate_proj.weight": (p + "w_gate_up", slice(0, F)),
                    q + "mlp.up_proj.weight": (p + "w_gate_up", slice(F, 2 * F)),
                    q + "mlp.down_proj.weight": (p + "w_down", None)})
    out.update({"model.norm.weight": ("final_norm", None), "lm_head.weight": ("lm_head", None)})
    return out


def _config_json(cfg: ModelConfig, fmt: str, provenance: dict, tok=None) -> dict:
    windows = [cfg.layer_window(l) for l in range(cfg.n_layers)]
    eot_id = None if tok is None else tok.eot_id
    base = {"format": FORMAT, "export_format": fmt, "model_type": "open1b",
            "architecture": {f: getattr(cfg, f) for f in cfg.__dataclass_fields__},
            "layer_windows": windows, "dtype": "bfloat16", "source": provenance, "not_mapped_to_llama": NOT_MAPPED}
    if fmt == "mlx" and tok is not None:        # model.py's generate: stop there, choose among the tokenizer's ids
        base.update({"eos_token_id": eot_id, "tokenizer_vocab_size": tok.vocab_size})
    if fmt == "hf":
        base.update({
            "architectures": ["Open1BForCausalLM"], "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
            "intermediate_size": cfg.ffn_hidden, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
            "max_position_embeddings": cfg.seq_len, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.norm_eps,
            "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
            "torch_dtype": "bfloat16", "sliding_window": cfg.window,
            "layer_types": ["full_attention" if w == 0 else "sliding_attention" for w in windows],
            "qk_norm": "per-head RMSNorm without gain, before RoPE", "embed_norm": True,
            "auto_map": {"AutoConfig": "configuration_open1b.Open1BConfig",
                         "AutoModelForCausalLM": "modeling_open1b.Open1BForCausalLM"},
            "eos_token_id": eot_id})            # the separator, when the tokenizer is shipped with it
    return base


# ------------------------------------------------------------------------------- export
def export(run_dir, step: int | None, fmt: str, out_dir, tokenizer=None, float_model: bool = False) -> pathlib.Path:
    """Write checkpoint `step` (default: the latest) of the run in `fmt` to the new directory out_dir.
    tokenizer: the run's tokenizer.json to ship (default: the shipped one, when it is the run's).
    float_model: also export a quantized run, as a float model of its master weights (said so in
    config.json and README.md); no effect on a bf16 run."""
    if fmt not in FILES:
        raise ExportError(f"--format: expected mlx or hf, got {fmt!r}")
    rd = RunDir(run_dir)
    run = rd.path
    info = rd.info(error=ExportError)
    precision = info.config.precision
    if precision != "bf16" and not float_model:
        raise ExportError(f"{run}: a {precision} run: its logits come from quantized GEMMs (CONTRACT.md §6.9), "
                          f"which the exported float models do not compute; only bf16 runs export (--float-model "
                          f"exports its master weights as a float model all the same)")
    tok = _run_tokenizer(tokenizer, info.tokenizer_sha256)
    cfg = info.config.model
    step = rd.select_checkpoint(step, ExportError)
    out = pathlib.Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out}: exists and is not empty; choose a new --out")
    path = rd.checkpoint(step)
    try:
        tensors, meta = load_checkpoint(path)      # every tensor hash verified
    except CheckpointError as e:
        raise ExportError(str(e), exit_code=1) from None
    if meta.get("genesis") != info.genesis:
        raise ExportError(f"{path}: belongs to another run (genesis differs)", exit_code=1)
    want, run_hash = rd.params_hash_after(step, info.genesis, ExportError)
    if want is not None and meta.get("params_hash") != want:
        raise ExportError(f"{path}: parameter hash differs from the ledger's after step {step - 1}", exit_code=1)
    flat = tensors["params"][0]
    layout = ParamLayout(cfg)
    if flat.shape != (layout.n_params,):
        raise ExportError(f"{path}: params has {flat.shape} elements, the config {layout.n_params}", exit_code=1)
    canon = {t.name: flat[t.offset:t.offset + t.size].reshape(t.shape) for t in layout}
    if fmt == "mlx":
        named = {n: (np.ascontiguousarray(a), "bf16") for n, a in canon.items()}
    else:
        named = {hn: (np.ascontiguousarray(canon[n] if sl is None else canon[n][sl]), "bf16")
                 for hn, (n, sl) in hf_names(cfg).items()}
    provenance = {"run": str(run.resolve()), "run_hash": run_hash, "genesis": info.genesis, "step": step,
                  "params_hash": meta.get("params_hash"), "tokenizer_sha256": info.tokenizer_sha256,
                  "contract_version": info.contract_version, "exported_by": f"mlx-open1b {__version__}",
                  "precision": precision}
    if precision != "bf16":
        provenance["float_model"] = (f"the master weights of a {precision} run as a float model: it does not compute "
                                     f"the run's quantized GEMMs (CONTRACT.md §6.9), so its logits are not the run's")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as e:
        raise WriteError.of_part(out, e, "the export ") from None
    try:                             # into a temporary directory, renamed onto out once complete
        # transformers (4.x) refuses a safetensors file whose "format" is not one of its frameworks: "pt" names
        # the PyTorch layout (Linear weights (out, in)) the hf names follow
        write_safetensors(tmp / FILES[fmt], named, {"format": "pt" if fmt == "hf" else FORMAT, "open1b_format": FORMAT,
                                                     "step": str(step), "params_hash": str(meta.get("params_hash"))})
        conf = _config_json(cfg, fmt, provenance, tok)
        write_file(tmp / "config.json", [(json.dumps(conf, indent=2) + "\n").encode()])
        if tok is not None:
            write_file(tmp / "tokenizer.json", [tok.path.read_bytes()])
        for name in (HF_CODE if fmt == "hf" else MLX_CODE):
            write_file(tmp / name, [((_HF_DIR if fmt == "hf" else _MLX_DIR) / name).read_bytes()])
        if fmt == "hf":
            if tok is not None:
                write_file(tmp / "tokenizer_config.json", [(json.dumps(
                    {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOT, "bos_token": None,
                     "model_max_length": cfg.seq_len}, indent=2) + "\n").encode()])
        write_file(tmp / "README.md", [_readme(fmt, provenance).encode()])
        os.chmod(tmp, 0o755)
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise WriteError.of_part(out, e, "the export ") from None
        raise
    return out


def _run_tokenizer(path, run_sha256: str):
    """The tokenizer to ship: the file given (its SHA-256 must be the run's), else the shipped default
    when it is the run's, else None."""
    from .data.format import DataError
    from .data.tokenizer import Tokenizer
    if path is None and run_sha256 != DEFAULT_TOKENIZER_SHA256:
        return None
    try:
        tok = Tokenizer.load(path)
    except DataError as e:
        raise ExportError(f"--tokenizer: {e}") from None
    if tok.sha256 != run_sha256:
        raise ExportError(f"--tokenizer {path}: SHA-256 {tok.sha256}, but the run was trained with tokenizer "
                          f"{run_sha256}; pass the tokenizer.json its corpus was prepared with")
    return tok


def _readme(fmt: str, prov: dict) -> str:
    lines = [f"# open1b export ({fmt})", "",
             f"Checkpoint step {prov['step']} of run `{prov['run_hash']}` (genesis `{prov['genesis']}`), parameter "
             f"hash `{prov['params_hash']}` as in the run's ledger. Weights are bf16, bit-identical to the checkpoint.",
             ""]
    if "float_model" in prov:
        lines += [f"**Not the trained model's arithmetic:** {prov['float_model']}.", ""]
    lines += ["Load: `mx.load(\"" + FILES[fmt] + "\")` (MLX); `mlx_open1b.export.mlx_forward` runs them in plain MLX; "
              "`mlx_open1b.export.torch_model(DIR)` gives a `mlx_open1b.torch_model.TorchModel`.", ""]
    if fmt == "mlx":
        lines += ["MLX (no mlx-open1b needed): `import sys; sys.path.insert(0, DIR); import model`, then "
                  "`m = model.load(DIR)` (an `mlx.nn.Module`, float32 activations on the exactly widened weights), "
                  "`m(mx.array([ids]))` the logits, `model.generate(m, ids, max_tokens=32)` greedy decoding with a "
                  "key/value cache (`temperature=` samples with mx.random). tokenizer.json, where shipped, loads with "
                  "`tokenizers.Tokenizer.from_file`.", ""]
    if fmt == "hf":
        lines += ["Hugging Face `transformers` (torch; no mlx-open1b needed): "
                  "`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` runs `modeling_open1b.py` "
                  "(the full architecture below, float32 norms and softmax), `.generate(...)` included; "
                  "`AutoTokenizer.from_pretrained(DIR, trust_remote_code=True)` reads tokenizer.json where "
                  "shipped. Past `max_position_embeddings` (the run's seq_len) `generate` goes on at positions the "
                  "model never trained on; `open1b generate` and the mlx export's model.py instead keep the last "
                  "seq_len tokens at positions 0.., so their tokens differ from there on.", ""]
    lines += ["Not mapped onto Hugging Face / mlx-lm Llama (config `model_type` is `open1b` on purpose):", ""]
    lines += [f"- {n}" for n in NOT_MAPPED]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------- loading
def load_export(export_dir) -> tuple[ModelConfig, dict[str, np.ndarray], dict]:
    """(ModelConfig, {canonical name: bf16 bits (uint16)}, config.json) of an export, either format."""
    d = pathlib.Path(export_dir)
    try:
        conf = json.loads((d / "config.json").read_text())
    except FileNotFoundError:
        raise ExportError(f"{d}: no config.json (not an open1b export)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ExportError(f"{d / 'config.json'}: not a readable JSON file ({e})") from None
    if not isinstance(conf, dict) or conf.get("format") != FORMAT:
        got = conf.get("format") if isinstance(conf, dict) else None
        raise ExportError(f"{d / 'config.json'}: format {got!r}, expected {FORMAT!r}")
    try:
        cfg = ModelConfig(**conf["architecture"])
        cfg.check()
        fmt = conf["export_format"]
        FILES[fmt]
    except (KeyError, TypeError, ValueError) as e:         # ConfigError is a ValueError
        raise ExportError(f"{d / 'config.json'}: malformed ({type(e).__name__}: {e})") from None
    try:
        tensors, _ = read_safetensors(d / FILES[fmt])
    except CheckpointError as e:
        raise ExportError(str(e)) from None
    except FileNotFoundError:
        raise ExportError(f"{d}: {FILES[fmt]} is missing") from None
    if cfg.n_layers > len(tensors):        # every layer has tensors: a count no file holds is not looped over
        raise ExportError(f"{d / 'config.json'}: {cfg.n_layers} layers, but {FILES[fmt]} holds {len(tensors)} tensors")
    out: dict[str, np.ndarray] = {}
    if fmt == "mlx":
        out = {n: np.asarray(a) for n, (a, _) in tensors.items()}
    else:
        parts: dict[str, list] = {}
        for hn, (n, sl) in hf_names(cfg).items():
            if hn not in tensors:
                raise ExportError(f"{d / FILES[fmt]}: tensor {hn!r} is missing")
            parts.setdefault(n, []).append((sl.start if sl else 0, np.asarray(tensors[hn][0])))
        out = {n: (p[0][1] if len(p) == 1 else np.concatenate([a for _, a in sorted(p, key=lambda x: x[0])]))
               for n, p in parts.items()}
    for n, shape, _ in cfg.param_shapes():
        if n not in out:
            raise ExportError(f"{d / FILES[fmt]}: tensor {n!r} is missing")
        if tuple(out[n].shape) != tuple(shape):
            raise ExportError(f"{d / FILES[fmt]}: tensor {n!r} has shape {out[n].shape}, the config {shape}")
    return cfg, out, conf


def flat_params(cfg: ModelConfig, tensors: dict[str, np.ndarray]) -> np.ndarray:
    """The model program's flat bf16 buffer from canonical tensors."""
    return np.concatenate([np.ascontiguousarray(tensors[n], np.uint16).reshape(-1) for n, _, _ in cfg.param_shapes()])


def torch_state_dict(export_dir, dtype=None) -> tuple[ModelConfig, dict]:
    """(config, state dict for TorchModel.load_state_dict): bf16 values widened exactly to dtype
    (default float32)."""
    import torch
    cfg, tensors, _ = load_export(export_dir)
    dtype = dtype or torch.float32
    sd = {n: torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16).to(dtype)
          for n, a in tensors.items()}
    return cfg, sd


def torch_model(export_dir, dtype=None):
    """A TorchModel holding the export's weights."""
    import torch

    from .torch_model import TorchModel
    cfg, sd = torch_state_dict(export_dir, dtype)
    m = TorchModel(cfg, dtype or torch.float32)
    m.load_state_dict(sd, strict=True)
    return m


# ------------------------------------------------------------------------------- plain MLX forward
def mlx_weights(export_dir) -> tuple[ModelConfig, dict]:
    """(config, {canonical name: mx.array bf16}) read with mx.load (hf names mapped back)."""
    import mlx.core as mx
    d = pathlib.Path(export_dir)
    cfg, _, conf = load_export(d)      # validates names and shapes
    w = mx.load(str(d / FILES[conf["export_format"]]))
    if conf["export_format"] == "hf":
        out: dict = {}
        for hn, (n, sl) in hf_names(cfg).items():
            out.setdefault(n, []).append(w[hn])
        w = {n: (v[0] if len(v) == 1 else mx.concatenate(v, axis=0)) for n, v in out.items()}
    return cfg, w


def mlx_forward(cfg: ModelConfig, w: dict, tokens, round_bf16: bool = False):
    """Next-token logits (B, T, V) float32 of tokens (B, T) in plain MLX, float32 compute on the bf16
    weights. round_bf16=True also rounds the activations to bf16 where the model program does
    (every GEMM input), which brings the result within a few bf16 rounding flips of it."""
    import mlx.core as mx
    tok = mx.array(np.asarray(tokens, np.int32))
    B, T = tok.shape
    H, G, D, eps = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.norm_eps
    f = {n: a.astype(mx.float32) for n, a in w.items()}

    def r(x):
        return x.astype(mx.bfloat16).astype(mx.float32) if round_bf16 else x

    def rms(x, g):
        y = x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps)
        return y if g is None else y * g

    i = np.arange(D // 2, dtype=np.float64)
    ang = np.arange(T, dtype=np.float64)[:, None] * (cfg.rope_theta ** (-2.0 * i / D))[None, :]
    cos = mx.array(np.cos(ang).astype(np.float32))[None, :, None, :]
    sin = mx.array(np.sin(ang).astype(np.float32))[None, :, None, :]

    def rope(x):
        x1, x2 = x[..., :D // 2], x[..., D // 2:]
        return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    qi, kj = np.arange(T)[:, None], np.arange(T)[None, :]
    h = rms(f["wte"][tok], f["emb_norm"])
    for l in range(cfg.n_layers):
        p = f"layers.{l}."
        a = r(rms(h, f[p + "attn_norm"]))
        q = rms((a @ f[p + "wq"].T).reshape(B, T, H, D), None)
        k = rms((a @ f[p + "wk"].T).reshape(B, T, G, D), None)
        v = r((a @ f[p + "wv"].T).reshape(B, T, G, D))
        q, k = r(rope(q)), r(rope(k))
        win = cfg.layer_window(l)
        vis = (kj <= qi) & ((qi - kj < win) if win else True)
        mask = mx.array(np.where(vis, 0.0, -np.inf).astype(np.float32))
        qh = q.transpose(0, 2, 1, 3)                                     # (B, H, T, D)
        kh = mx.repeat(k.transpose(0, 2, 1, 3), H // G, axis=1)
        vh = mx.repeat(v.transpose(0, 2, 1, 3), H // G, axis=1)
        s = (qh @ kh.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(D)) + mask
        o = mx.softmax(s, axis=-1) @ vh                                  # (B, H, T, D)
        o = r(o.transpose(0, 2, 1, 3).reshape(B, T, H * D))
        h = h + o @ f[p + "wo"].T
        x = r(rms(h, f[p + "ffn_norm"]))
        gu = x @ f[p + "w_gate_up"].T
        gate, up = gu[..., :cfg.ffn_hidden], gu[..., cfg.ffn_hidden:]
        h = h + r(gate * mx.sigmoid(gate) * up) @ f[p + "w_down"].T
    hn = r(rms(h, f["final_norm"]))
    z = hn @ f["lm_head"].T
    mx.eval(z)
    return z


def program_logits(cfg: ModelConfig, params: np.ndarray, tokens, ops=None, precision: str = "bf16") -> np.ndarray:
    """The model program's own next-token logits (B, seq_len, V) fp32 for tokens (B, seq_len): its
    forward on the backend (default cpu_ref), then the LM head GEMM (CONTRACT.md §6.1) on the final
    norm's bf16 output, the same operands the fused cross-entropy uses."""
    if ops is None:
        ops = cpu_ref
    tok = np.asarray(tokens)
    B, T = tok.shape
    if T != cfg.seq_len:
        raise ValueError(f"tokens: the model program runs windows of seq_len = {cfg.seq_len} tokens, got {T}")
    windows = np.concatenate([tok, np.zeros((B, 1), tok.dtype)], axis=1).astype(np.uint32)
    model = Model(cfg, ops, precision=precision)
    *_, cache = model.forward(params, windows)
    z = ops.linear_forward(cache.hn_b, np.ascontiguousarray(views(params, model.layout)["lm_head"]))
    return np.asarray(z, np.float32).reshape(B, T, cfg.vocab_size)
