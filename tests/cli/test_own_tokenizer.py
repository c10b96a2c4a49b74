"""Your data end to end: `data tokenizer train` on a generated corpus (parquet and jsonl.zst) is
deterministic, `data prepare --tokenizer` records its hash, `train --data --tokenizer` runs, and a
tokenizer that does not match the corpus is refused with both hashes, exit code 2, nothing written."""
import hashlib
import json
import pathlib
import random

import pytest
from click.testing import CliRunner

from mlx_open1b.cli.main import cli
from mlx_open1b.data.tokenizer import DEFAULT_TOKENIZER_SHA256, Tokenizer, default_tokenizer_path


def write_parquet(path, texts):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": pa.array(texts, pa.string())}), path)


def write_jsonl(path, records):
    import pyarrow as pa
    with pa.CompressedOutputStream(str(path), "zstd") as out:
        out.write("".join(json.dumps(r) + "\n" for r in records).encode())

VOCAB = 400


def _corpus(root: pathlib.Path) -> None:
    rng = random.Random(0)
    words = "the a river stone garden model token city light water book mountain step loss".split()
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(30, 90))) + f" {k}." for k in range(120)]
    (root / "docs").mkdir()
    write_parquet(root / "docs" / "a.parquet", docs[:60])
    write_jsonl(root / "docs" / "b.jsonl.zst", [{"text": t} for t in docs[60:]])


def _ok(r, args):
    res = r.invoke(cli, args)
    assert res.exit_code == 0, f"{args}\n{res.output}"
    return res


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("own")
    _corpus(root)
    r = CliRunner()
    src = ["--source", f"mine={root}/docs/*"]
    outs = []
    for name in ("tok1.json", "tok2.json"):
        res = _ok(r, ["data", "tokenizer", "train", *src, "--vocab", str(VOCAB), "--out", str(root / name)])
        outs.append((root / name).read_bytes())
    return root, outs, res.output


def test_tokenizer_train_is_deterministic(trained):
    root, (a, b), output = trained
    assert a == b                                    # same corpus -> same bytes
    sha = hashlib.sha256(a).hexdigest()
    assert sha in output and sha != DEFAULT_TOKENIZER_SHA256
    tok = Tokenizer.load(root / "tok1.json")
    assert tok.eot_id == 0 and 257 < tok.vocab_size <= VOCAB
    text = "the river 17. garden stone"
    assert tok.decode(tok.encode(text)) == text


def test_prepare_and_train_with_own_tokenizer(trained, tmp_path):
    root, (a, _), _ = trained
    tokf, data = root / "tok1.json", tmp_path / "data"
    tok = Tokenizer.load(tokf)
    r = CliRunner()
    _ok(r, ["data", "prepare", "--source", f"mine={root}/docs/*", "--tokenizer", str(tokf),
            "--heldout-tokens", "300", "--out", str(data)])
    m = json.loads((data / "manifest.json").read_text())
    assert m["tokenizer_sha256"] == hashlib.sha256(a).hexdigest() and m["vocab_size"] == tok.vocab_size
    # the packaged tokenizer does not match this corpus: both hashes named, exit 2, no run directory
    run = tmp_path / "run"
    small = ["--preset", "tiny", "--set", "model.n_layers=1", "--set", f"model.vocab_size={tok.vocab_size}"]
    res = r.invoke(cli, ["train", *small, "--data", str(data), "--tokenizer", str(default_tokenizer_path()),
                         "--out", str(run), "--steps", "2"])
    assert res.exit_code == 2, res.output
    assert DEFAULT_TOKENIZER_SHA256 in res.output and tok.sha256 in res.output and "Traceback" not in res.output
    assert not run.exists()
    _ok(r, ["train", *small, "--data", str(data), "--tokenizer", str(tokf), "--out", str(run), "--steps", "2"])
    info = json.loads((run / "run.json").read_text())
    assert info["tokenizer_sha256"] == tok.sha256
    assert len((run / "ledger.jsonl").read_text().splitlines()) >= 2
    # the export ships the run's own tokenizer; another one is refused, both hashes named, nothing written
    bad = r.invoke(cli, ["export", str(run), "--format", "hf", "--tokenizer", str(default_tokenizer_path()),
                         "--out", str(tmp_path / "bad")])
    assert bad.exit_code == 2, bad.output
    assert DEFAULT_TOKENIZER_SHA256 in bad.output and tok.sha256 in bad.output and "Traceback" not in bad.output
    assert not (tmp_path / "bad").exists()
    _ok(r, ["export", str(run), "--format", "hf", "--tokenizer", str(tokf), "--out", str(tmp_path / "hf")])
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == a
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert conf["eos_token_id"] == tok.eot_id and conf["vocab_size"] == tok.vocab_size
    # without --tokenizer the weights export, and the command says the tokenizer is not shipped
    res = _ok(r, ["export", str(run), "--format", "hf", "--out", str(tmp_path / "bare")])
    assert "no tokenizer.json" in res.output and "--tokenizer" in res.output
    assert not (tmp_path / "bare" / "tokenizer.json").exists()


def test_train_takes_the_vocabulary_from_the_tokenizer(trained, tmp_path):
    """`train --tokenizer F` and `config show --tokenizer F` set model.vocab_size to F's when neither a
    config file nor a --set gives it; one given that differs stops the command, naming both values,
    exit 2, before anything is written."""
    root, _, _ = trained
    tokf, data = root / "tok1.json", tmp_path / "data"
    V = Tokenizer.load(tokf).vocab_size
    r = CliRunner()
    _ok(r, ["data", "prepare", "--source", f"mine={root}/docs/*", "--tokenizer", str(tokf),
            "--heldout-tokens", "300", "--out", str(data)])
    small = ["--preset", "tiny", "--set", "model.n_layers=1", "--data", str(data), "--tokenizer", str(tokf)]
    _ok(r, ["train", *small, "--out", str(tmp_path / "run"), "--steps", "1"])
    assert json.loads((tmp_path / "run" / "run.json").read_text())["config"]["model"]["vocab_size"] == V != 8192
    res = r.invoke(cli, ["train", *small, "--set", "model.vocab_size=8192", "--out", str(tmp_path / "run2")])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert f"model.vocab_size: --set model.vocab_size=8192 gives 8192, but the tokenizer {tokf} has {V}" in res.output
    assert not (tmp_path / "run2").exists()
    _ok(r, ["train", *small, "--set", f"model.vocab_size={V}", "--out", str(tmp_path / "run3"), "--steps", "1"])
    # config show: the tokenizer's vocabulary, or a file's that differs named
    shown = _ok(r, ["config", "show", "--preset", "tiny", "--tokenizer", str(tokf)]).output
    assert f"\nvocab_size = {V}" in shown
    (tmp_path / "run.toml").write_text(shown.replace(f"\nvocab_size = {V}", "\nvocab_size = 512"))
    res = r.invoke(cli, ["config", "show", "--config", str(tmp_path / "run.toml"), "--tokenizer", str(tokf)])
    assert res.exit_code == 2 and f"model.vocab_size: {tmp_path / 'run.toml'} gives 512" in res.output, res.output


def test_own_tokenizer_without_data_is_refused_before_the_default_corpus(trained, tmp_path, monkeypatch):
    """Without --data the run would train on the default corpus (the shipped tokenizer's): a user's
    tokenizer is refused naming both hashes and --data, exit 2, before that corpus is prepared."""
    root, _, _ = trained
    tok = Tokenizer.load(root / "tok1.json")
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(cli, ["train", "--preset", "tiny", "--tokenizer", str(root / "tok1.json"), "--out",
                                   "runs/x", "--steps", "1"])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert tok.sha256 in res.output and DEFAULT_TOKENIZER_SHA256 in res.output and "--data" in res.output
    assert list(tmp_path.iterdir()) == []                # neither runs/data-default nor runs/x


def test_tokenizer_train_refuses_to_replace_other_content(trained, tmp_path):
    root, _, _ = trained
    f = tmp_path / "t.json"
    f.write_bytes(default_tokenizer_path().read_bytes())
    res = CliRunner().invoke(cli, ["data", "tokenizer", "train", "--source", f"mine={root}/docs/*", "--vocab",
                                   str(VOCAB), "--out", str(f)])
    assert res.exit_code == 2 and "--force" in res.output and "Traceback" not in res.output
    assert f.read_bytes() == default_tokenizer_path().read_bytes()


@pytest.mark.slow
def test_tokenizer_train_default_reproduces_the_shipped_tokenizer(tmp_path):
    # golden: the shipped tokenizer's pinned SHA-256 (tools/train_tokenizer.py made it); ~16 s
    out = tmp_path / "tok.json"
    _ok(CliRunner(), ["data", "tokenizer", "train", "--default", "--vocab", "8192", "--out", str(out)])
    assert hashlib.sha256(out.read_bytes()).hexdigest() == DEFAULT_TOKENIZER_SHA256
