"""`open1b export --format mlx` ships model.py, an `mlx.nn` model that loads and generates with mlx-open1b
blocked from import; its logits are the model program's within an argued bound and a float32 numpy
forward's within a tight one; its greedy tokens are `open1b generate`'s wherever that bound makes the
top token certain; bad input fails clearly."""
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from mlx_open1b.checkpoint import load_checkpoint
from mlx_open1b.cli.main import cli
from mlx_open1b.config import ModelConfig, RunConfig, TrainConfig
from mlx_open1b.data.tokenizer import Tokenizer
from mlx_open1b.export import ExportError, export, program_logits
from mlx_open1b.generate import Generator, greedy
from mlx_open1b.model import ParamLayout
from mlx_open1b.train import Trainer

pytest.importorskip("mlx.core")

# Against the model program, the bound of test_export.py: the program rounds every GEMM input to bf16
# (<= 2^-9 relative each, about 11 on the path to the final norm's output hn); model.py's float32
# forward does not, so hn is off by <= EPS relative to first order, and each logit z_v = hn . w_v by
# <= EPS * |hn| * |w_v| (Cauchy-Schwarz), |hn| <= sqrt(d) * max|final norm gain|.
EPS = 11 * 2.0 ** -9
# Against a float32 numpy forward of the same formulas: only float32 reassociation (and the libraries'
# rsqrt / exp / sigmoid, a few ulps) differ, <= 2^-24 relative per op on a path of at most 64
# roundings in sequence (norms, projections, RoPE, softmax, sums over <= 48 terms): 2^-18
# (Frobenius, relative). The same bound holds between model.py's cached and uncached logits (one
# row against all rows of the same GEMMs) and between float32 and bf16-stored weights.
EPS_FP32 = 2.0 ** -18
PROMPT = "Compute 4 + 10.\n\nAnswer: 4 + 10 ="
N_GEN = 10                     # the prompt's 15 tokens + 10 new: past seq_len = 16, where the window slides

# Runs in a fresh interpreter inside the export directory: mlx_open1b refused by a meta-path finder.
CHILD = r"""
import importlib.abc, json, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "mlx_open1b":
            raise ImportError("mlx_open1b is blocked in this test")
sys.meta_path.insert(0, Block())
try:
    import mlx_open1b
    raise SystemExit("the blocker did not block")
except ImportError:
    pass
sys.path.insert(0, ".")
import numpy as np
import mlx.core as mx
import model
req = json.loads(sys.argv[1])
m = model.load(".")
tok = mx.array(np.array(req["tokens"], np.int32))
out = {"logits": np.array(m(tok)), "logits_bf16": np.array(model.load(".", dtype=mx.bfloat16)(tok))}
for name, cache in (("cached", True), ("uncached", False)):
    steps = list(model.generate_step(m, req["prompt"], req["n"], use_cache=cache, stop_at_eos=False))
    out[name + "_ids"] = np.array([t for t, _ in steps])
    out[name + "_logits"] = np.stack([np.array(z) for _, z in steps])
ctx, T = list(req["prompt"]), m.args.seq_len           # the window rule: the last seq_len tokens at positions 0..
out["window_logits"] = np.stack([np.array(m(mx.array([(ctx + out["cached_ids"][:i].tolist())[-T:]]))[0, -1])
                                 for i in range(req["n"])])
s1 = model.generate(m, req["prompt"], 5, temperature=0.9, seed=3)
out["sampled"] = np.array([s1, model.generate(m, req["prompt"], 5, temperature=0.9, seed=3)])
nan = float("nan")
out["planted"] = np.array([model.choose_greedy(mx.array(z, dtype=mx.float32), 4)
                           for z in ([0.0, 2.0, nan, 2.0, 9.0], [nan, -1.0, -1.0, -2.0])])
np.savez(req["out"], **out)
print(json.dumps(sorted(k for k in sys.modules if k.split(".")[0] == "mlx_open1b")))
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory, default_corpus):
    root = tmp_path_factory.mktemp("export_mlx")
    run = root / "run"
    m = ModelConfig(vocab_size=8192, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_hidden=48,
                    seq_len=16, window=8, global_every=2)
    t = TrainConfig(seed=3, microbatch_seqs=2, phases=((0, 2),), total_tokens=4000, warmup_tokens=64, peak_lr=3e-2,
                    checkpoint_every=4, eval_every=0, eval_windows=2)
    Trainer(run, RunConfig(m, t, "mlxexport"), default_corpus, log=lambda m: None).train(8)
    out = export(run, 8, "mlx", root / "mlx")
    cfg = ModelConfig(**json.loads((out / "config.json").read_text())["architecture"])
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (3, cfg.seq_len))
    prompt = [int(i) for i in Tokenizer.load(None).encode(PROMPT)]
    req = {"tokens": tokens.tolist(), "prompt": prompt, "n": N_GEN, "out": str(root / "child.npz")}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(req)], cwd=out, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.splitlines()[-1]) == []             # nothing of mlx_open1b was imported
    return run, out, cfg, tokens, prompt, dict(np.load(root / "child.npz"))


def _bound(cfg, bits):
    """Per vocabulary entry v: EPS * sqrt(d) * max|final norm gain| * |w_v| (float64)."""
    layout = ParamLayout(cfg)
    w = (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    lm, g = layout["lm_head"], layout["final_norm"]
    w_norm = np.linalg.norm(w[lm.offset:lm.offset + lm.size].reshape(lm.shape), axis=1)
    return EPS * math.sqrt(cfg.d_model) * np.abs(w[g.offset:g.offset + g.size]).max() * w_norm


def _numpy_forward(cfg, bits, tokens):
    """The same formulas as model.py, float32 numpy (independent of MLX), next-token logits (B, T, V)."""
    f32 = np.float32
    w = {t.name: (bits[t.offset:t.offset + t.size].astype(np.uint32) << 16).view(f32).reshape(t.shape)
         for t in ParamLayout(cfg)}
    B, T = tokens.shape
    H, G, D, F, eps = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_hidden, f32(cfg.norm_eps)

    def rms(x, g=None):
        y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True, dtype=f32) + eps)
        return y if g is None else y * g

    ang = np.arange(T)[:, None] * cfg.rope_theta ** (-2.0 * np.arange(D // 2) / D)[None, :]
    cos, sin = np.cos(ang).astype(f32)[None, :, None], np.sin(ang).astype(f32)[None, :, None]

    def rope(x):
        x1, x2 = x[..., :D // 2], x[..., D // 2:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    h = rms(w["wte"][tokens], w["emb_norm"])
    for l in range(cfg.n_layers):
        p = f"layers.{l}."
        a = rms(h, w[p + "attn_norm"])
        q = rope(rms((a @ w[p + "wq"].T).reshape(B, T, H, D))).transpose(0, 2, 1, 3)
        k = np.repeat(rope(rms((a @ w[p + "wk"].T).reshape(B, T, G, D))).transpose(0, 2, 1, 3), H // G, axis=1)
        v = np.repeat((a @ w[p + "wv"].T).reshape(B, T, G, D).transpose(0, 2, 1, 3), H // G, axis=1)
        i, j, win = np.arange(T)[:, None], np.arange(T)[None, :], cfg.layer_window(l)
        vis = (j <= i) & ((i - j < win) if win else True)
        s = np.where(vis, q @ k.transpose(0, 1, 3, 2) * f32(1 / math.sqrt(D)), f32(-np.inf))
        e = np.exp(s - s.max(-1, keepdims=True))
        o = ((e / e.sum(-1, keepdims=True)) @ v).transpose(0, 2, 1, 3).reshape(B, T, H * D)
        h = h + o @ w[p + "wo"].T
        gu = rms(h, w[p + "ffn_norm"]) @ w[p + "w_gate_up"].T
        g, u = gu[..., :F], gu[..., F:]
        h = h + (g / (f32(1) + np.exp(-g)) * u) @ w[p + "w_down"].T
    return rms(h, w["final_norm"]) @ w["lm_head"].T


def test_mlx_model_loads_without_this_package_and_matches_the_program(exported):
    run, out, cfg, tokens, _, child = exported
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.py", "tokenizer.json",
                                                     "weights.safetensors"]
    assert "mlx_open1b" not in (out / "model.py").read_text()
    bits = load_checkpoint(run / "ckpt-00000008")[0]["params"][0]
    z = program_logits(cfg, bits, tokens).astype(np.float64)
    zm = child["logits"].astype(np.float64)
    assert child["logits"].dtype == np.float32 and zm.shape == z.shape
    bound = _bound(cfg, bits)
    d = np.abs(zm - z)
    assert (d <= bound).all(), float((d / bound).max())
    assert np.linalg.norm(d) <= EPS * np.linalg.norm(z)
    zn = _numpy_forward(cfg, bits, tokens).astype(np.float64)
    assert np.linalg.norm(zm - zn) <= EPS_FP32 * np.linalg.norm(zn)
    zb = child["logits_bf16"].astype(np.float64)               # weights kept bf16, activations float32
    assert np.linalg.norm(zb - zm) <= EPS_FP32 * np.linalg.norm(zm)


def test_mlx_generate_is_open1b_generate_where_certain(exported):
    """Greedy tokens step by step: while both sequences agree, model.py's logits are the program's
    (Generator.logits, the same context) within the bound, and its token is the program's wherever
    the bound makes the top token certain; cached and uncached decoding agree."""
    run, _, cfg, _, prompt, child = exported
    bits = load_checkpoint(run / "ckpt-00000008")[0]["params"][0]
    bound = _bound(cfg, bits)
    g = Generator(run, 8)
    assert g.n_candidates == cfg.vocab_size
    ctx, certain = list(prompt), 0
    for i, (t, zm) in enumerate(zip(child["cached_ids"], child["cached_logits"])):
        z = g.logits(np.array(ctx, np.uint32)).astype(np.float64)
        assert (np.abs(zm - z) <= bound).all(), i
        v = int(greedy(z, g.n_candidates))
        if (z[v] - bound[v] > np.delete(z + bound, v)).all():
            assert t == v, i
            certain += 1
        elif t != v:
            break
        ctx.append(int(t))
    assert certain >= 3 and len(ctx) > cfg.seq_len, (certain, len(ctx))
    assert len(child["cached_ids"]) == N_GEN
    assert np.array_equal(child["cached_ids"], child["uncached_ids"])
    zc, zu = child["cached_logits"].astype(np.float64), child["uncached_logits"].astype(np.float64)
    assert np.linalg.norm(zc - zu) <= EPS_FP32 * np.linalg.norm(zu)
    zw = child["window_logits"].astype(np.float64)              # model.py's forward of each step's window
    assert np.linalg.norm(zc - zw) <= EPS_FP32 * np.linalg.norm(zw)
    # model.py's greedy rule on planted logits: a tie goes to the smaller id, a NaN is never chosen, only
    # the first n_candidates ids are candidates
    assert child["planted"].tolist() == [1, 1]
    s = child["sampled"]
    assert np.array_equal(s[0], s[1]) and ((0 <= s) & (s < cfg.vocab_size)).all()


def test_export_mlx_bad_input(exported, tmp_path):
    run, out, *_ = exported
    r = CliRunner()
    res = r.invoke(cli, ["export", str(run), "--step", "4", "--format", "mlx", "--out", str(tmp_path / "ok")])
    assert res.exit_code == 0 and (tmp_path / "ok" / "model.py").read_bytes() == (out / "model.py").read_bytes()
    assert json.loads((tmp_path / "ok" / "config.json").read_text())["source"]["step"] == 4
    res = r.invoke(cli, ["export", str(run), "--step", "4", "--format", "mlx", "--out", str(out)])
    assert res.exit_code == 2 and "not empty" in res.output
    res = r.invoke(cli, ["export", str(run), "--step", "6", "--format", "mlx", "--out", str(tmp_path / "a")])
    assert res.exit_code == 2 and "no checkpoint of step 6" in res.output and not (tmp_path / "a").exists()
    gone = tmp_path / "gone"
    shutil.copytree(run, gone)
    shutil.rmtree(gone / "ckpt-00000008")
    res = r.invoke(cli, ["export", str(gone), "--step", "8", "--format", "mlx", "--out", str(tmp_path / "b")])
    assert res.exit_code == 2 and "no checkpoint of step 8" in res.output and not (tmp_path / "b").exists()
    q = tmp_path / "q"                        # a quantized run: precision int8 in its run.json
    shutil.copytree(run, q)
    rj = json.loads((q / "run.json").read_text())
    rj["config"]["precision"] = "int8"
    (q / "run.json").write_text(json.dumps(rj))
    res = r.invoke(cli, ["export", str(q), "--format", "mlx", "--out", str(tmp_path / "c")])
    assert res.exit_code == 2 and "int8" in res.output and "only bf16 runs export" in res.output, res.output
    assert not (tmp_path / "c").exists() and "Traceback" not in res.output
    with pytest.raises(ExportError, match="only bf16"):
        export(q, None, "hf", tmp_path / "d")
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())     # no temporary directory left
    assert not any(p.name.startswith(".mlx.tmp") for p in out.parent.iterdir())
