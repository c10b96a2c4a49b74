"""Evaluation through lm-eval-harness itself: `lm_eval.simple_evaluate` on the adapter and
tasks built from the shipped offline files gives exactly the adapter's own log-likelihoods,
rolling log-likelihoods and generations, and the same accuracies and bits per byte as our
evaluate(). Fully offline (the `json` dataset builder on the shipped jsonl files).

Skipped unless lm-eval (>= 0.4) is installed: it is the optional extra `mlx-open1b[eval]`, not in the
test extra, so CI does not install it. Checked with lm-eval 0.4.13 in a venv made with
`python -m venv --system-site-packages` (torch pinned to the installed 2.13.0).
"""
import os

import pytest

# no network for the datasets / hub libraries lm-eval uses (read when they are first imported)
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (optional: pip install "
                              "'mlx-open1b[eval]'); the adapter's own tests are tests/report/test_evaluate.py")

import numpy as np  # noqa: E402
from lm_eval.api.model import LM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from mlx_open1b.evaluate import Open1BLM, evaluate, load_task, lm_eval_task, write_lm_eval_tasks  # noqa: E402


from test_evaluate import lm  # noqa: E402,F401  (the same small trained run and adapter)


def test_simple_evaluate_gives_the_adapters_numbers(lm, tmp_path):
    assert isinstance(lm, LM)
    assert lm_eval.api.registry.get_model("open1b") is Open1BLM
    names = ["arith", "facts", "code", "text"]
    res = lm_eval.simple_evaluate(model=lm, tasks=[lm_eval_task(n, tmp_path / "hf") for n in names],
                                  bootstrap_iters=0, log_samples=True)
    ours = evaluate(lm, names)
    for name in names:
        items, samples = load_task(name), sorted(res["samples"][f"open1b_{name}"], key=lambda s: s["doc_id"])
        assert len(samples) == len(items)
        r = res["results"][f"open1b_{name}"]
        if name == "text":
            direct = lm.loglikelihood_rolling([(it["text"],) for it in items])
            assert [s["arguments"][0][0] for s in samples] == [it["text"] for it in items]
            assert [s["filtered_resps"][0] for s in samples] == direct          # exactly our numbers
            assert abs(r["bits_per_byte,none"] - ours["text"]["bits_per_byte"]) <= 1e-12
            continue
        for s, it in zip(samples, items):
            reqs = [(it["context"], c) for c in it["choices"]]
            assert [tuple(a) for a in s["arguments"]] == reqs                # no target delimiter added
            assert [tuple(x) for x in s["filtered_resps"]] == lm.loglikelihood(reqs)
        assert r["acc,none"] == ours[name]["acc"] and r["acc_norm,none"] == ours[name]["acc_norm"]


def test_yaml_tasks_model_by_name_and_generation(lm, tmp_path):
    write_lm_eval_tasks(tmp_path / "tasks", ["arith"], cache_dir=tmp_path / "hf")
    gen = dict(lm_eval_task("arith", tmp_path / "hf"), task="open1b_arith_gen", output_type="generate_until",
               doc_to_target="{{choices[answer]}}", generation_kwargs={"until": ["\n"], "max_gen_toks": 3},
               metric_list=[{"metric": "exact_match"}])
    for k in ("doc_to_choice", "target_delimiter"):
        gen.pop(k)
    tm = TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False)
    assert "open1b_arith" in tm.all_tasks
    res = lm_eval.simple_evaluate(model="open1b", model_args=f"run_dir={lm.run_dir},step={lm.step},batch_size=2",
                                  tasks=["open1b_arith", gen], task_manager=tm, limit=3, bootstrap_iters=0,
                                  log_samples=True)
    items = load_task("arith")[:3]
    mc = sorted(res["samples"]["open1b_arith"], key=lambda s: s["doc_id"])
    for s, it in zip(mc, items):
        assert [x[0] for x in s["filtered_resps"]] == [ll for ll, _ in
                                                         lm.loglikelihood([(it["context"], c) for c in it["choices"]])]
    out = sorted(res["samples"]["open1b_arith_gen"], key=lambda s: s["doc_id"])
    direct = lm.generate_until([(it["context"], {"until": ["\n"], "max_gen_toks": 3}) for it in items])
    assert [s["resps"][0][0] for s in out] == direct
    assert np.isfinite(res["results"]["open1b_arith_gen"]["exact_match,none"])
