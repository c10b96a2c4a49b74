"""`open1b generate`: the same tokens from a checkpoint, a prompt and a seed on cpu_ref, metal
(emulated here) and cuda (emulated here); the choice rule (ties, NaN, top-k, the Philox draws);
clear errors and exit codes for bad prompts and missing checkpoints."""
import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from fake_cupy import fake_gpu  # noqa: F401 (a fixture)
from mlx_open1b import arrays
from mlx_open1b.cli.main import cli
from mlx_open1b.config import ModelConfig, RunConfig, TrainConfig
from mlx_open1b.generate import GenerateError, Generator, Sampling, choose
from mlx_open1b.spec import arith
from mlx_open1b.spec.mathfn import exp
from mlx_open1b.train import Trainer


@pytest.fixture(scope="module")
def run(tmp_path_factory, default_corpus):
    run = tmp_path_factory.mktemp("gen") / "run"
    m = ModelConfig(vocab_size=8192, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_hidden=48,
                    seq_len=16, window=8, global_every=2)
    t = TrainConfig(seed=1, microbatch_seqs=2, phases=((0, 1),), total_tokens=4000, warmup_tokens=64,
                    checkpoint_every=2, eval_every=0, eval_windows=2)
    Trainer(run, RunConfig(m, t, "gentiny"), default_corpus, log=lambda m: None).train(2)
    Trainer(run.with_name("run8"), RunConfig(m, t, "gentiny", precision="int8"), default_corpus,
            log=lambda m: None).train(2)
    return run


PROMPT = "Compute 4 + 10.\n\nAnswer:"
NEAR_FULL = "Compute 4 + 10 and 3.\n\nAnswer:"                      # 12 of the window's 16 tokens
LONG = "The quick brown fox jumps over the lazy dog; " * 3          # longer than seq_len: cut on the left


def test_same_tokens_on_every_backend(run):
    """Greedy and sampled tokens, and the logits bit for bit, on every backend; in bf16 the KV cache's
    logits are the full forward's, also past seq_len (where the window slides and recomputes)."""
    got = {}
    for backend in ("cpu_ref", "metal", "cuda"):
        g, full = Generator(run, backend=backend), Generator(run, backend=backend, kv_cache=False)
        assert g.kv_cache and not full.kv_cache
        ids = list(g.encode(NEAR_FULL))
        logits, decoded = [], 0
        while len(ids) < g.T + 2:
            cached = g._kv is not None and len(g._kv[0]) == len(ids) - 1 and len(ids) <= g.T
            z = g.logits(np.array(ids, np.uint32))
            decoded += cached
            assert np.array_equal(z.view(np.uint32), full.logits(np.array(ids, np.uint32)).view(np.uint32)), \
                (backend, len(ids))
            logits.append(z.view(np.uint32))
            ids.append(int(np.argmax(z)))
        assert decoded == g.T - len(g.encode(NEAR_FULL))           # the cache served every position up to seq_len
        long_ids = g.encode(LONG)
        assert len(long_ids) > g.T
        got[backend] = (np.stack(logits), g.generate(g.encode(PROMPT), 4),
                        g.generate(long_ids, 3, Sampling(temperature=0.8, top_k=50, seed=3)))
    ref = got["cpu_ref"]
    for backend in ("metal", "cuda"):
        assert np.array_equal(got[backend][0], ref[0]), backend         # the logits, bit for bit
        assert got[backend][1:] == ref[1:], backend
    assert len(ref[1]) == 4 and len(ref[2]) == 3


def test_kv_cache_on_device_arrays(run, fake_gpu):
    """The CUDA backend as on a GPU (cupy arrays; here the stand-in, kernels on the emulator): the
    KV cache keeps device arrays and gives the logits of cpu_ref's full forward."""
    g, ref = Generator(run, backend="cuda"), Generator(run, kv_cache=False)
    assert arrays.kind(g.params) == arrays.CUPY
    ids = list(g.encode(NEAR_FULL))
    for _ in range(3):
        z = g.logits(np.array(ids, np.uint32))
        assert np.array_equal(z.view(np.uint32), ref.logits(np.array(ids, np.uint32)).view(np.uint32))
        ids.append(int(np.argmax(z)))
    assert arrays.kind(g._kv[1][0][0]) == arrays.CUPY and len(g._kv[0]) == len(ids) - 1     # two decoded


def test_quantized_runs_recompute(run):
    run8 = run.with_name("run8")
    g = Generator(run8)
    assert not g.kv_cache
    with pytest.raises(GenerateError, match="int8"):
        Generator(run8, kv_cache=True)
    ids = g.encode(PROMPT)
    want = g.generate(ids, 2, Sampling(temperature=0.5, seed=1))
    assert Generator(run8, backend="metal").generate(ids, 2, Sampling(temperature=0.5, seed=1)) == want


def test_greedy_is_the_argmax_of_the_program_logits(run):
    g = Generator(run)
    ids = list(g.encode(PROMPT))
    out = g.generate(ids, 3)
    for t in out:                                     # each token: the argmax of its window's logits
        z = g.logits(np.array(ids, np.uint32))
        assert t == int(np.argmax(z[:g.n_candidates]))
        ids.append(t)
    chunks = []                                       # streamed: the text arrives as the tokens come
    assert g.generate(g.encode(PROMPT), 3, on_text=chunks.append) == out
    assert "".join(chunks) == g.tok.decode(out) and len(chunks) >= 2
    other = g.generate(g.encode(PROMPT), 3, Sampling(temperature=1.0, seed=9))
    assert g.generate(g.encode(PROMPT), 3, Sampling(temperature=1.0, seed=9)) == other
    assert g.generate(g.encode(PROMPT), 3, Sampling(temperature=1.0, top_k=1, seed=9)) == out


def test_choose_rule():
    z = np.array([0.5, 2.0, 2.0, -1.0, np.nan, 1.5, 0.0, 1.9], np.float32)
    assert choose(z, 8, Sampling(), 0) == 1                           # greedy: the tie goes to the smaller id
    assert choose(z, 1, Sampling(), 0) == 0                           # candidates: the first n ids only
    nan_first = np.array([np.nan, 1.0, 1.0], np.float32)
    assert choose(nan_first, 3, Sampling(), 0) == 1                   # NaN is never chosen
    assert all(choose(nan_first, 3, Sampling(1.0, 0, 5), i) in (1, 2) for i in range(50))
    with pytest.raises(GenerateError) as e:
        choose(np.full(3, np.nan, np.float32), 3, Sampling(), 0)
    assert e.value.exit_code == 3 and "NaN" in str(e.value)
    inf = np.array([1.0, np.inf, 3.0, np.inf], np.float32)
    assert {choose(inf, 4, Sampling(1.0, 0, 5), i) for i in range(40)} == {1, 3}
    # top-k 2 keeps the two largest (the tie at 2.0: ids 1 and 2), whatever the draw
    assert {choose(z, 8, Sampling(5.0, 2, 1), i) for i in range(60)} == {1, 2}
    # golden values pinning the rule across machines (Philox draws of seed 11, CONTRACT.md §5)
    assert [choose(z, 8, Sampling(0.7, 0, 11), i) for i in range(12)] == [7, 2, 5, 2, 6, 0, 1, 0, 5, 2, 7, 2]
    assert [choose(z, 8, Sampling(1.3, 3, 11), i) for i in range(12)] == [7, 2, 7, 2, 7, 7, 1, 7, 7, 2, 7, 2]
    # the running sums: numpy's accumulate (what choose runs) is the rule's sequential add, bit for bit
    w = exp(np.random.default_rng(5).uniform(-80, 0, 3000).astype(np.float32))
    w[0] = 1.0
    acc, loop = np.float32(0), np.empty_like(w)
    for j in range(w.size):
        acc = loop[j] = arith.add(acc, w[j])
    assert np.array_equal(np.add.accumulate(w, dtype=np.float32).view(np.uint32), loop.view(np.uint32))
    # the draws follow softmax(z / t): two equal logits, each about half of 1000 draws (sd ~16)
    picks = [choose(np.zeros(2, np.float32), 2, Sampling(1.0, 0, 4), i) for i in range(1000)]
    assert abs(sum(picks) - 500) < 80


def test_cli_streams_and_prints_ids(run):
    res = CliRunner().invoke(cli, ["generate", str(run), "--prompt", PROMPT, "--max-tokens", "3",
                                                   "--ids", "--backend", "cpu_ref"])
    assert res.exit_code == 0, res.output + res.stderr
    g = Generator(run)
    want = g.generate(g.encode(PROMPT), 3)
    assert res.stderr.strip().splitlines()[-1] == "ids: " + ",".join(map(str, want))
    assert res.stdout == g.tok.decode(want) + "\n"


def test_bad_input_errors(run, tmp_path):
    r = CliRunner()
    base = ["generate", str(run), "--backend", "cpu_ref"]
    res = r.invoke(cli, base + ["--prompt", "hi", "--step", "7"])
    assert res.exit_code == 2 and "no checkpoint of step 7" in res.output and "Traceback" not in res.output
    res = r.invoke(cli, base + ["--prompt-ids", "5,9000,3"])
    assert res.exit_code == 2 and "token 1 is id 9000" in res.output and "[0, 8192)" in res.output
    res = r.invoke(cli, base)
    assert res.exit_code == 2 and "--prompt" in res.output
    res = r.invoke(cli, ["generate", str(tmp_path), "--prompt", "hi", "--backend", "cpu_ref"])
    assert res.exit_code == 2 and str(tmp_path) in res.output
    other = tmp_path / "tokenizer.json"              # a valid tokenizer file that is not the run's
    from mlx_open1b.data.tokenizer import default_tokenizer_path
    other.write_text(default_tokenizer_path().read_text() + "\n")
    res = r.invoke(cli, base + ["--prompt", "hi", "--tokenizer", str(other)])
    assert res.exit_code == 2 and str(other) in res.output and "trained with tokenizer" in res.output, res.output
    g = Generator(run)
    g.V = 100                                         # a model vocabulary smaller than the tokenizer's
    with pytest.raises(GenerateError, match=r"prompt: token 0 is id \d+ \('"):
        g.encode("zebra")
    assert len(Generator(run).encode("héllo 日本 🙂")) > 0     # byte-level: every character has tokens

    real = g.tok

    class Dropping:                                   # a tokenizer that cannot represent a character
        path = "dropping.json"
        encode = staticmethod(lambda text: real.encode(text.replace("é", "")))
        decode = staticmethod(real.decode)
    g.tok, g.V = Dropping(), 8192
    with pytest.raises(GenerateError, match=r"does not encode it as written \(character 1, 'é'"):
        g.encode("héllo")
    # a checkpoint that does not match the ledger: the run's own files are broken (exit 1)
    broken = tmp_path / "broken"
    shutil.copytree(run, broken)
    meta = broken / "ckpt-00000002" / "meta.json"
    d = json.loads(meta.read_text())
    d["params_hash"] = "0" * 64
    meta.write_text(json.dumps(d))
    res = r.invoke(cli, ["generate", str(broken), "--prompt", "hi", "--backend", "cpu_ref"])
    assert res.exit_code == 1 and "ckpt-00000002" in res.output, res.output
