"""scripts/gpu_bench.sh and benchmarks/gpu_bench.py: the dry run (CPU emulator, tiny shapes) goes
through the script to a table file; the table's ratios and the prediction file's freshness note."""
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_bench  # noqa: E402
import kernel_model as km  # noqa: E402

SCRIPT = ROOT / "scripts" / "gpu_bench.sh"


def run_script(tmp_path, only, timeout=600):
    env = {k: v for k, v in os.environ.items() if not k.startswith("O1B_") and k != "OUT"}
    env.update(PYTHON=sys.executable, O1B_GPU_BENCH_EMULATED="1", O1B_SKIP_INSTALL="1", O1B_BENCH_ONLY=only,
               O1B_RESULTS=str(tmp_path / "res"))
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=timeout)


def _check_table(res: pathlib.Path, labels):
    table = (res / "gpu_bench.txt").read_text()
    assert table.startswith("gpu_bench: cuda (dry run on the CPU emulator, tiny shapes)")
    rows = json.loads((res / "gpu_bench.json").read_text())["rows"]
    assert [r["label"] for r in rows] == labels
    for r in rows:
        assert r["t"] > 0
        assert any(line.startswith(r["label"]) for line in table.splitlines())
    return table, rows


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_script_dry_run_writes_the_table(tmp_path):
    p = run_script(tmp_path, "qkv fwd,add")
    assert p.returncode == 0, p.stdout + p.stderr
    table, rows = _check_table(tmp_path / "res", ["qkv fwd", "add"])
    assert rows[0]["flops"] == 2 * 128 * 128 * 128                      # tiny_dims: N = K = M = 128
    if rows[0]["peer"]:                                                 # torch on the CPU as the peer
        assert set(rows[0]["peer"]) == {"fp32", "bf16"}
    assert "gpu_bench (budget 240 s)" in p.stdout
    assert (tmp_path / "res" / "timings.tsv").read_text().count("\n") == 2


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_script_dry_run_with_the_microbatches(tmp_path):
    p = run_script(tmp_path, "attn bwd local,lm head fwd,model bf16,model int8", timeout=1200)
    assert p.returncode == 0, p.stdout + p.stderr
    _check_table(tmp_path / "res", ["attn bwd local", "lm head fwd", "model bf16", "model int8"])


def test_script_refuses_a_bad_budget(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("O1B_")}
    env.update(PYTHON=sys.executable, O1B_BENCH_BUDGET="fast", O1B_RESULTS=str(tmp_path))
    p = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 2 and "O1B_BENCH_BUDGET=fast" in p.stderr


def test_table_ratios():
    row = {"label": "qkv fwd", "op": "linear_forward", "dims": {}, "t": 0.006, "flops": 3e12 * 0.006,
           "peer": {"fp32": 0.002, "bf16": 0.0004}, "predicted": 0.004}
    lines = []
    gpu_bench.print_table({"backend": "cuda", "dry_run": False, "peer": "torch", "prediction": "p",
                           "rows": [row], "skipped": ["lm head bwd"]}, lines.append)
    cells = lines[2].split()
    assert cells[:2] == ["qkv", "fwd"]
    assert float(cells[4]) == pytest.approx(row["flops"] / row["t"] / 1e12)          # TFLOP/s
    assert float(cells[9]) == round(row["t"] / row["peer"]["fp32"], 2)               # ours / fp32
    assert float(cells[10]) == round(row["t"] / row["peer"]["bf16"], 2)              # ours / bf16
    assert float(cells[13]) == round(row["t"] / row["predicted"], 2)                 # measured / predicted
    assert lines[-1] == "not run (time budget): lm head bwd"


def test_prediction_file_freshness(tmp_path):
    f = tmp_path / "pred.json"
    assert gpu_bench.load_prediction(f, "cuda") == ({}, f"no prediction file ({f})")
    bench = {"cuda": {"qkv fwd": {"t": 0.01}}}
    f.write_text(json.dumps({"rev": "x", "sources_sha256": km.sources_digest(km.ROOT), "bench": bench}))
    pred, note = gpu_bench.load_prediction(f, "cuda")
    assert pred == bench["cuda"] and note.endswith("computed from these kernel sources")
    f.write_text(json.dumps({"rev": "x", "sources_sha256": "0" * 64, "bench": bench}))
    assert gpu_bench.load_prediction(f, "cuda")[1].endswith("(stale)")


def test_bench_shapes_are_modelled():
    """Every bench shape has a workload of kernel_model whose fixed sizes it matches (so the model
    can predict it), and the bench model is open1b's widths on 2 layers of both kinds."""
    for label, op, dims in km.BENCH:
        w = km.workload_for(op, dims)
        assert w is not None, label
        if op.startswith("attention"):
            assert dims["D"] == w.fixed["D"] and dims["H"] * w.fixed["G"] == w.fixed["H"] * dims["G"], label
        else:
            assert all(dims.get(k, v) == v for k, v in w.fixed.items() if k != "V"), label
    cfg = km.bench_model_config()
    assert cfg.n_layers == 2 and not cfg.is_global(0) and cfg.is_global(1)
