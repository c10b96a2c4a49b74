"""Evaluation: the lm-eval adapter's log-likelihoods are the model program's own forward
pass; the offline task set runs; bad input fails clearly."""
import json

import numpy as np
import pytest
from click.testing import CliRunner

from mlx_open1b.cli.main import cli
from mlx_open1b.config import ModelConfig, RunConfig, TrainConfig
from mlx_open1b.evaluate import TASKS, EvalError, Open1BLM, evaluate, load_task
from mlx_open1b.export import program_logits
from mlx_open1b.model import Model
from mlx_open1b.train import Trainer


@pytest.fixture(scope="module")
def lm(tmp_path_factory, default_corpus):
    run = tmp_path_factory.mktemp("eval") / "run"
    m = ModelConfig(vocab_size=8192, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_hidden=48,
                    seq_len=32, window=8, global_every=2)
    t = TrainConfig(seed=1, microbatch_seqs=2, phases=((0, 1),), total_tokens=4000, warmup_tokens=64,
                    checkpoint_every=2, eval_every=0, eval_windows=2)
    Trainer(run, RunConfig(m, t, "evaltiny"), default_corpus, log=lambda m: None).train(4)
    return Open1BLM(run, batch_size=3)


def _ref_logprobs(lm, window):
    """log p(target) per position from the program's logits (LM-head GEMM), log-softmax in float64."""
    z = program_logits(lm.cfg.model, lm.params, window[None, :-1]).astype(np.float64)[0]
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    return z[np.arange(len(z)), window[1:]] - lse, z.argmax(1)


class Instance:                         # what lm-eval passes: the request in .args
    def __init__(self, *args):
        self.args = args


def test_loglikelihood_is_our_forward_pass(lm):
    T = lm.T
    w = np.random.default_rng(3).integers(1, lm.cfg.model.vocab_size, T + 1).astype(np.uint32)
    [(ll, greedy)] = lm.loglikelihood_tokens([(w[:1], w[1:])])
    # the whole window: minus T times the program's mean CE (Model.forward; the mean is an fp32
    # tree fold times 1/T, so equal up to fp32 rounding of that mean)
    _, ce, _, _ = Model(lm.cfg.model).forward(lm.params, w[None])
    assert abs(ll + T * ce) <= 1e-6 * abs(T * ce)
    assert abs(ll + T * float(Model(lm.cfg.model).eval_loss(lm.params, w[None])[0])) <= 1e-6 * abs(T * ce)
    # per token, against the log-softmax of the program's logits: the fused cross-entropy computes
    # the same lse with the contract's exp/log in fp32 (relative error ~1e-6 of lse ~ 9 nats)
    ref, am = _ref_logprobs(lm, w)
    part = lm.loglikelihood_tokens([(w[:10], w[10:])])[0]
    assert abs(part[0] - ref[9:].sum()) <= 1e-4 * len(ref[9:])
    assert part[1] == bool((am[9:] == w[10:]).all()) and greedy is False
    # strings: lm-eval's (context, continuation) convention, Instances or tuples, batched or not
    ctx, cont = "Compute 4 + 10.\n\nAnswer: 4 + 10 =", " 14"
    ids = np.concatenate([lm.tok.encode(ctx), lm.tok.encode(ctx + cont)[len(lm.tok.encode(ctx)):]])
    n_cont = len(lm.tok.encode(ctx + cont)) - len(lm.tok.encode(ctx))
    win = np.full(T + 1, lm.eot, np.uint32)
    win[:len(ids)] = ids
    ref, am = _ref_logprobs(lm, win)
    want = ref[len(ids) - 1 - n_cont:len(ids) - 1].sum()
    a = lm.loglikelihood([Instance(ctx, cont), (ctx + " ", "14"), ("Compute", " 4"), (ctx, " 15")])
    assert abs(a[0][0] - want) <= 1e-4 * n_cont and a[0] == a[1]
    single = Open1BLM.__new__(Open1BLM)
    single.__dict__.update(lm.__dict__, batch_size=1)
    assert single.loglikelihood([(ctx, cont), ("Compute", " 4")]) == [a[0], a[2]]


def test_rolling_and_generation(lm):
    T = lm.T
    text = " ".join(load_task("text")[0]["text"] for _ in range(3))        # longer than one window
    ids = lm.tok.encode(text)
    assert len(ids) > T
    full = np.concatenate([[lm.eot], ids]).astype(np.uint32)
    want = 0.0
    for s in range(0, len(ids), T):
        piece = full[s:s + T + 1]
        win = np.full(T + 1, lm.eot, np.uint32)
        win[:len(piece)] = piece
        want += _ref_logprobs(lm, win)[0][:len(piece) - 1].sum()
    [got] = lm.loglikelihood_rolling([Instance(text)])
    assert abs(got - want) <= 1e-4 * len(ids)
    # greedy generation follows the argmax of the program's logits
    ctx = "The capital of France is"
    [out] = lm.generate_until([(ctx, {"until": ["\n\n"], "max_gen_toks": 3})])
    seq = list(lm.tok.encode(ctx))
    for _ in range(3):
        win = np.full(T + 1, lm.eot, np.uint32)
        win[:len(seq)] = seq
        nxt = int(_ref_logprobs(lm, win)[1][len(seq) - 1])
        if nxt == lm.eot:
            break
        seq.append(nxt)
    expect = lm.tok.decode(seq[len(lm.tok.encode(ctx)):])
    assert out == expect.split("\n\n")[0]


def test_generation_follows_the_greedy_rule_of_generate(lm, monkeypatch):
    """generate_until and is_greedy choose as `open1b generate` does (mlx_open1b.generate.greedy): on
    real logits the same tokens as Generator; on planted logits a tie goes to the smaller id and a
    NaN is never chosen (plain argmax would pick the NaN); every logit NaN: EvalError, exit 3."""
    from mlx_open1b.generate import Generator
    ctx = "Compute 4 + 10.\n\nAnswer:"
    want = Generator(lm.run_dir, lm.step).generate(lm.tok.encode(ctx), 4)
    [out] = lm.generate_until([(ctx, {"until": [], "max_gen_toks": 4})])
    assert out == lm.tok.decode(want)
    V, eot = lm.cfg.model.vocab_size, lm.eot
    a, b, c = sorted({lm.tok.encode(" yes")[0], lm.tok.encode(" no")[0], lm.tok.encode(" maybe")[0]})
    assert eot not in (a, b, c)
    planted = np.full(V, -1.0, np.float32)
    planted[[b, c]] = 5.0                       # a tie: b, the smaller id, wins
    planted[a] = np.nan                          # larger than everything for np.argmax
    monkeypatch.setattr(lm, "_logits", lambda windows, want: (np.zeros((len(windows), lm.T)),
                                                               np.broadcast_to(planted, (len(windows), lm.T, V))))
    [out] = lm.generate_until([(ctx, {"until": [], "max_gen_toks": 2})])
    assert out == lm.tok.decode([b, b])
    assert [g for _, g in lm.loglikelihood_tokens([([eot], [b]), ([eot], [c]), ([eot], [a])])] == [True, False, False]
    planted[:] = np.nan
    with pytest.raises(EvalError, match="every logit is NaN") as e:
        lm.generate_until([(ctx, {"max_gen_toks": 2})])
    assert e.value.exit_code == 3


def test_offline_tasks_and_cli(lm, tmp_path):
    res = evaluate(lm, list(TASKS), limit=2)
    for name, kind in TASKS.items():
        m = res[name]
        assert m["n"] == 2
        if kind == "multiple_choice":
            assert 0 <= m["acc"] <= 1 and 0 <= m["acc_norm"] <= 1 and m["chance"] == 0.25
        else:
            assert m["token_perplexity"] > 1 and m["bits_per_byte"] > 0
    r = CliRunner()
    run = str(lm.run_dir)
    res = r.invoke(cli, ["eval", run, "--step", "4", "--tasks", "arith,text", "--limit", "2",
                         "--json", str(tmp_path / "e.json")])
    assert res.exit_code == 0 and "arith" in res.output, res.output
    assert json.loads((tmp_path / "e.json").read_text())["results"]["arith"]["n"] == 2
    res = r.invoke(cli, ["eval", run, "--tasks", "nope"])
    assert res.exit_code == 2 and "unknown task 'nope'" in res.output
    res = r.invoke(cli, ["eval", run, "--step", "3"])
    assert res.exit_code == 2 and "no checkpoint of step 3" in res.output
    with pytest.raises(EvalError, match="empty continuation"):
        lm.loglikelihood_tokens([([1, 2], [])])



def test_metal_backend_on_device_arrays_gives_the_same_answers(lm):
    """Open1BLM on the metal backend keeps the checkpoint in mx.arrays; every log-likelihood and
    greedy flag equals cpu_ref's exactly (same bits)."""
    pytest.importorskip("mlx.core")
    from mlx_open1b import arrays
    other = Open1BLM(lm.run_dir, lm.step, "metal", batch_size=3)
    assert arrays.kind(other.params) == "mlx"
    reqs = [("Compute 4 + 10.\n\nAnswer: 4 + 10 =", " 14"), ("Compute", " 4"), ("def f(x):", " return x")]
    assert other.loglikelihood(reqs) == lm.loglikelihood(reqs)
