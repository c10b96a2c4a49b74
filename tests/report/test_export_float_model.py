"""`open1b export --float-model`: a quantized run exports only when asked, as its master weights bit for
bit, with config.json and README.md saying that the float model does not compute the run's quantized
GEMMs; without the flag it is refused naming the flag, and nothing is written."""
import dataclasses
import json

import numpy as np
from click.testing import CliRunner

from mlx_open1b.checkpoint import load_checkpoint
from mlx_open1b.cli.main import cli
from mlx_open1b.export import flat_params, load_export

from data_helpers import make_corpus
from runs import micro_cfg


def test_float_model_exports_a_quantized_run_saying_so(tmp_path):
    make_corpus(tmp_path / "corpus", {"web": (1.0, 20, 20)})
    from mlx_open1b.train import Trainer
    cfg = dataclasses.replace(micro_cfg(checkpoint_every=2, eval_every=0), precision="int8")
    Trainer(tmp_path / "run", cfg, tmp_path / "corpus", log=lambda m: None).train(2)
    r = CliRunner()
    res = r.invoke(cli, ["export", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "refused")])
    assert res.exit_code == 2 and "int8" in res.output and "--float-model" in res.output, res.output
    assert "Traceback" not in res.output and not (tmp_path / "refused").exists()
    ck = load_checkpoint(tmp_path / "run" / "ckpt-00000002")[0]["params"][0]
    for fmt in ("mlx", "hf"):
        out = tmp_path / fmt
        res = r.invoke(cli, ["export", str(tmp_path / "run"), "--format", fmt, "--out", str(out), "--float-model"])
        assert res.exit_code == 0, res.output
        mcfg, tensors, conf = load_export(out)
        assert f"note: {conf['source']['float_model']}" in res.output
        assert np.array_equal(flat_params(mcfg, tensors), ck)             # the master weights, bit for bit
        src = conf["source"]
        assert src["precision"] == "int8" and src["step"] == 2
        assert "int8 run" in src["float_model"] and "does not compute" in src["float_model"]
        assert src["float_model"] in (out / "README.md").read_text()


def test_float_model_changes_nothing_for_a_bf16_run(tmp_path):
    make_corpus(tmp_path / "corpus", {"web": (1.0, 20, 20)})
    from mlx_open1b.train import Trainer
    Trainer(tmp_path / "run", micro_cfg(checkpoint_every=2, eval_every=0), tmp_path / "corpus",
            log=lambda m: None).train(2)
    r = CliRunner()
    for name, flag in (("plain", []), ("flagged", ["--float-model"])):
        res = r.invoke(cli, ["export", str(tmp_path / "run"), "--format", "mlx", "--out", str(tmp_path / name), *flag])
        assert res.exit_code == 0, res.output
    for f in ("weights.safetensors", "config.json", "README.md", "model.py"):
        assert (tmp_path / "plain" / f).read_bytes() == (tmp_path / "flagged" / f).read_bytes(), f
    assert "float_model" not in json.loads((tmp_path / "plain" / "config.json").read_text())["source"]
