"""`open1b export --format hf` loads in Hugging Face `transformers` (AutoModelForCausalLM with
trust_remote_code, the shipped modeling_open1b.py) without mlx-open1b's code, and its logits are
the model program's within an argued bound; greedy generation follows the program's argmax.
Runs where `transformers` is installed (the `hf` extra)."""
import json
import math

import numpy as np
import pytest

from mlx_open1b.export import export, program_logits
from mlx_open1b.model import ParamLayout


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# The bound of test_export.py, same argument: the model program rounds every GEMM input to bf16
# (<= 2^-9 relative each, about 11 on the path to the final norm's output hn); this float32 forward
# does not, so hn is off by <= EPS relative to first order, and each logit z_v = hn . w_v by
# <= EPS * |hn| * |w_v| (Cauchy-Schwarz), |hn| <= sqrt(d) * max|final norm gain|. The fp32
# reassociation between two fp32 forwards is ~2^-24 per op, invisible at this scale.
EPS = 11 * 2.0 ** -9
# Against mlx_open1b's own float32 PyTorch forward (TorchModel), the same formulas with no bf16 rounding:
# only fp32 reassociation differs, <= 2^-24 relative per op on a path of at most 64 roundings in
# sequence (norms, projections, RoPE, softmax, sums over <= 48 terms): 2^-18. Measured on the micro
# model: 2^-25 (Frobenius, relative); a RoPE angle off by 1e-3 relative gives 2^-16.4.
EPS_FP32 = 2.0 ** -18


@pytest.fixture(scope="module")
def exported(micro_export_run, tmp_path_factory):
    return micro_export_run, export(micro_export_run, 4, "hf", tmp_path_factory.mktemp("export_hf") / "hf")


def _load(out):
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32)
    return m.eval()


def test_hf_export_ships_model_code(exported):
    _, out = exported
    conf = json.loads((out / "config.json").read_text())
    assert conf["auto_map"]["AutoModelForCausalLM"] == "modeling_open1b.Open1BForCausalLM"
    assert (out / "modeling_open1b.py").is_file() and (out / "configuration_open1b.py").is_file()
    src = (out / "modeling_open1b.py").read_text() + (out / "configuration_open1b.py").read_text()
    assert "mlx_open1b" not in src                     # self-contained: loads without this package


def test_hf_logits_match_the_program(exported):
    run, out = exported
    from mlx_open1b.checkpoint import load_checkpoint
    m = _load(out)
    cfg_json = json.loads((out / "config.json").read_text())
    from mlx_open1b.config import ModelConfig
    cfg = ModelConfig(**cfg_json["architecture"])
    bits = load_checkpoint(run / "ckpt-00000004")[0]["params"][0]
    # the loaded float32 weights are the bf16 bits widened exactly
    w = (bits.astype(np.uint32) << 16).view(np.float32)
    layout = ParamLayout(cfg)
    lm = layout["lm_head"]
    assert np.array_equal(m.lm_head.weight.detach().numpy().reshape(-1), w[lm.offset:lm.offset + lm.size])
    tok = np.random.default_rng(0).integers(0, cfg.vocab_size, (3, cfg.seq_len))
    z = program_logits(cfg, bits, tok).astype(np.float64)
    with torch.no_grad():
        zh = m(torch.from_numpy(tok)).logits.numpy().astype(np.float64)
    w64 = w.astype(np.float64)
    w_norm = np.linalg.norm(w64[lm.offset:lm.offset + lm.size].reshape(lm.shape), axis=1)
    g = layout["final_norm"]
    bound = EPS * math.sqrt(cfg.d_model) * np.abs(w64[g.offset:g.offset + g.size]).max() * w_norm
    d = np.abs(zh - z)
    assert (d <= bound).all(), float((d / bound).max())
    assert np.linalg.norm(d) <= EPS * np.linalg.norm(z)
    from mlx_open1b.export import torch_model
    zt = torch_model(out).logits(tok).numpy().astype(np.float64)
    assert np.linalg.norm(zh - zt) <= EPS_FP32 * np.linalg.norm(zt)
    # greedy generation: the first new token is the program's argmax wherever the bound makes it certain
    # (z[v] - bound[v] above z[u] + bound[u] for every other u)
    checked = 0
    for r in range(tok.shape[0]):
        for t in range(1, cfg.seq_len):
            row = z[r, t]
            v = int(row.argmax())
            if not (row[v] - bound[v] > np.delete(row + bound, v)).all():
                continue
            with torch.no_grad():
                gen = m.generate(torch.from_numpy(tok[r:r + 1, :t + 1]), max_new_tokens=1, do_sample=False)
            assert int(gen[0, -1]) == v, (r, t)
            checked += 1
    assert checked >= 3, checked
    with torch.no_grad():
        gen = m.generate(torch.from_numpy(tok[:1, :4]), max_new_tokens=8, do_sample=False)
        # a left-padded batch (attention_mask) gives each row the logits it has alone
        ids = torch.from_numpy(tok[:2, :10]).clone()
        mask = torch.ones_like(ids)
        ids[1, :3], mask[1, :3] = 0, 0
        zb = m(ids, attention_mask=mask).logits.numpy().astype(np.float64)
        alone = m(ids[1:, 3:]).logits.numpy().astype(np.float64)
    assert gen.shape == (1, 12)
    assert np.linalg.norm(zb[1, 3:] - alone[0]) <= EPS_FP32 * np.linalg.norm(alone)


def test_hf_kv_cache_generates_as_the_full_recompute(exported):
    """generate() with the key/value cache runs each new token alone and gives the tokens and logits
    of the full recompute (use_cache=False) within the float32 bound: the prompt of 12 tokens passes
    the local layers' window (8), the generation passes seq_len (16); a left-padded row rides along."""
    _, out = exported
    m = _load(out)
    V = m.config.vocab_size
    ids = torch.from_numpy(np.random.default_rng(1).integers(0, V, (2, 12)))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    lengths, forward = [], m.model.forward

    def counting(input_ids, *a, **k):
        lengths.append(input_ids.shape[1])
        return forward(input_ids, *a, **k)

    m.model.forward = counting
    got = {}
    for use_cache in (True, False):
        lengths.clear()
        with torch.no_grad():
            g = m.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, use_cache=use_cache,
                           output_logits=True, return_dict_in_generate=True)
        got[use_cache] = (g.sequences[:, 12:].numpy(), np.stack([z.numpy() for z in g.logits]).astype(np.float64))
        assert lengths == ([12] + [1] * 9 if use_cache else list(range(12, 22))), lengths
    (tc, zc), (tu, zu) = got[True], got[False]
    assert zc.shape == zu.shape == (10, 2, V)
    assert np.linalg.norm(zc - zu) <= EPS_FP32 * np.linalg.norm(zu)
    # each token is the same wherever the bound makes it certain (every logit within EPS_FP32 * |z|_F)
    certain = 0
    for r in range(2):
        for i in range(10):
            z = zu[i, r]
            top2 = np.sort(z)[-2:]
            if top2[1] - top2[0] <= 2 * EPS_FP32 * np.linalg.norm(zu[i]):
                break
            assert tc[r, i] == tu[r, i], (r, i)
            certain += 1
    assert certain >= 10, certain
