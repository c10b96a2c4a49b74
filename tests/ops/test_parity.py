"""The parity harness (mlx_open1b.parity, `open1b parity run|export|compare`): zero mismatches
between cpu_ref and the numpy spec (and metal / cuda wherever their ops modules are in the tree),
a planted one-bit difference is caught with the right op, output, index and values, bundles
compare identical on one machine and a modified one is reported at the right case, contract
versions that differ are refused (exit 2), and whole-run parity: a micro run through a clip, a
skip, checkpoints and a resume gives cpu_ref's ledger byte for byte on metal and cuda (longer runs
and the tiny preset: slow)."""
from __future__ import annotations

import importlib
import importlib.util
import json
import pathlib

import numpy as np
import pytest
from click.testing import CliRunner

import mlx_open1b.cpu_ref as cpu_ref
from mlx_open1b import parity as P
from mlx_open1b.cli.main import cli
from mlx_open1b.parity import spec_backend
from mlx_open1b.parity.bundle import canonical

SPEC_CASES = 24          # per op: 46 ops x 24 = 1104 cases cpu_ref vs spec (about 15 s)
GPU_CASES = 24           # per op for metal / cuda (emulated here) vs cpu_ref: 1104 cases each


def _gpu_backends() -> list:
    """metal and cuda, when their ops module exists in the tree (checked at import time). If one
    exists but does not import or run, the tests fail rather than skip: that is a bug."""
    out = []
    for name in ("metal", "cuda"):
        if importlib.util.find_spec(f"mlx_open1b.{name}.ops") is not None:
            out.append(name)
    return out


GPU = _gpu_backends()
MISSING = [n for n in ("metal", "cuda") if n not in GPU]


# ----------------------------------------------------------------------------- coverage
def test_every_cpu_ref_op_has_a_case_generator():
    runtime = {"available", "contract_version", "get_num_threads", "set_num_threads", "settings", "simd_level", "simd_name",
               "gemm_i8_has_vnni", "to_device", "to_host", "weights_held"}
    api = {n for n in dir(cpu_ref) if not n.startswith("_") and callable(getattr(cpu_ref, n))
           and not isinstance(getattr(cpu_ref, n), type) and getattr(cpu_ref, n).__class__.__name__ != "module"}
    missing = sorted(api - runtime - set(P.OPS))
    assert not missing, f"ops of the cpu_ref API without a parity case generator: {missing}"
    for op in P.OPS:
        assert P.backends.resolve(spec_backend, op) is not None, op
        if op in P.backends.VARIANTS:   # the int4/int6 paths: cpu_ref has them once its base function takes qmax
            base, kw = P.backends.VARIANTS[op]
            assert base in api, op
            has = P.backends.accepts(getattr(cpu_ref, base), kw)
            assert (P.backends.resolve(cpu_ref, op) is not None) == has, op
        else:
            assert P.backends.resolve(cpu_ref, op) is not None, op


def test_cases_are_deterministic_and_cover_specials_and_odd_shapes():
    a, b = P.make_case("attention_forward", 5, seed=7), P.make_case("attention_forward", 5, seed=7)
    assert a.seed == b.seed and a.input_hash() == b.input_hash()
    assert P.make_case("attention_forward", 5, seed=8).input_hash() != a.input_hash()
    # special values appear across cases of an elementwise op
    bits = np.concatenate([P.make_case("exp", i).args[0].reshape(-1) for i in range(8)]).view(np.uint32)
    exp_field, mant = bits & 0x7F800000, bits & 0x7FFFFF
    assert ((exp_field == 0) & (mant != 0)).any(), "no subnormals"
    assert ((exp_field == 0x7F800000) & (mant != 0)).any(), "no NaNs"
    assert ((exp_field == 0x7F800000) & (mant == 0)).any(), "no infinities"
    assert (bits == 0x80000000).any() and (bits == 0).any(), "no signed zeros"
    assert (bits == 0x7F7FFFFF).any() or (bits == 0xFF7FFFFF).any(), "no largest normals"
    # vocabularies that cross the 1024-entry chunk, sequences that are no multiple of the 64-key block
    Vs = {P.make_case("xent_forward", i).args[1].shape[0] for i in range(40)}
    assert Vs & {1023, 1025, 2049, 2500}
    Ts = {P.make_case("attention_forward", i).args[0].shape[1] for i in range(40)}
    assert Ts & {65, 130} and Ts & {1, 7, 33}


# ----------------------------------------------------------------------------- zero mismatches
def test_cpu_ref_matches_spec_on_every_op():
    report = P.run(["cpu_ref", "spec"], cases=SPEC_CASES, seed=0)
    assert report.total_cases == len(P.OPS) * SPEC_CASES
    assert report.ok, P.format_table(report)


@pytest.mark.parametrize("name", GPU)
def test_gpu_backend_matches_cpu_ref_on_every_op(name):
    ok, why = P.backends.load(name).available()
    assert ok, why
    report = P.run(["cpu_ref", name], cases=GPU_CASES, seed=1)
    assert report.total_cases == len(P.OPS) * GPU_CASES
    assert report.ok, P.format_table(report)
    own = [op for op, names in report.missing.items() if name in names]
    if own:                 # every op it has is bit-identical; the ones it lacks are listed
        pytest.xfail(f"{name} has no {', '.join(own)} yet (not compared)")
    # ops cpu_ref lacks (the int4 / int6 paths until its qlinear functions take qmax) are compared
    # with the spec in test_gpu_backend_int4_path_matches_spec


INT4_OPS = ["qlinear4_forward", "qlinear4_backward"]
INT6_OPS = ["qlinear6_forward", "qlinear6_backward"]


@pytest.mark.parametrize("name", GPU)
def test_gpu_backend_int4_path_matches_spec(name):
    """The simulated int4 and int6 paths (qlinear_* with qmax=7 / 31) of metal / cuda against the
    numpy spec."""
    report = P.run(["spec", name], ops=INT4_OPS + INT6_OPS, cases=12, seed=1)
    assert report.complete and report.total_cases == 48, P.format_table(report)


def test_int4_ops_on_backends_with_and_without_qmax():
    """qlinear4_* run as the backend's qlinear_* with qmax=7 where that function takes qmax (read from
    its signature); a backend whose functions do not is reported missing (and nothing runs when it is
    the reference); one that ignores qmax is caught."""
    class OldAPI:           # the qlinear functions without qmax (cpu_ref before the int4 path)
        def qlinear_forward(self, x, w):
            return spec_backend.qlinear_forward(x, w)

        def qlinear_backward(self, dy, x, w, need_dx=True, need_dw=True):
            return spec_backend.qlinear_backward(dy, x, w, need_dx, need_dw)

    class IgnoresQmax:      # takes qmax but always computes int8
        def qlinear_forward(self, x, w, qmax=127):
            return spec_backend.qlinear_forward(x, w)

    class Own:              # a function of the op's own name is used as it is
        def qlinear4_forward(self, x, w):
            return spec_backend.qlinear_forward(x, w, qmax=7)

    old = OldAPI()
    assert P.backends.resolve(old, "qlinear4_forward") is None and P.backends.resolve(old, "qlinear_forward")
    fn = P.backends.resolve(spec_backend, "qlinear4_backward")
    assert fn.func is spec_backend.qlinear_backward and fn.keywords == {"qmax": 7}
    fn = P.backends.resolve(spec_backend, "qlinear6_forward")
    assert fn.func is spec_backend.qlinear_forward and fn.keywords == {"qmax": 31}
    assert P.backends.resolve(old, "qlinear6_backward") is None
    for ref in ("old", "spec"):
        bks = [("old", old), ("spec", spec_backend)]
        report = P.run(bks if ref == "old" else bks[::-1], ops=INT4_OPS + ["qlinear_forward"], cases=2)
        assert report.ok and not report.complete
        assert report.missing == {"qlinear4_forward": ["old"], "qlinear4_backward": ["old"]}
        assert report.ops["qlinear4_forward"].cases == 2 and report.ops["qlinear4_forward"].seconds == {}
        assert report.ops["qlinear_forward"].missing == []
        assert "missing: old has no qlinear4_forward, qlinear4_backward" in P.format_table(report)
    report = P.run([("spec", spec_backend), ("bad", IgnoresQmax()), ("own", Own())], ops=["qlinear4_forward"],
                   cases=4)
    r = report.ops["qlinear4_forward"]
    assert r.mismatches >= 1 and r.first["backend"] == "bad" and r.missing == []


@pytest.mark.parametrize("bits,qmax", [(4, 7), (6, 31)], ids=["int4", "int6"])
def test_int4_cases_are_valid_and_cover_specials(bits, qmax):
    from mlx_open1b import opargs
    from mlx_open1b.spec import quant as sq
    sw, clip, sx, q = [], 0, [], []
    for i in range(24):
        dy, x, w = P.make_case(f"qlinear{bits}_backward", i).args
        opargs.qlinear_backward(dy, x, w)
        x2, w2 = P.make_case(f"qlinear{bits}_forward", i).args
        opargs.qlinear_forward(x2, w2)
        for xx, ww in ((x, w), (x2, w2)):
            qw, s, c = sq.quant_weight_rows(ww, with_clip=True, qmax=qmax)
            sw.append(s)
            clip += int((c == 1).sum())
            q.append(qw.reshape(-1))
            sx.append(np.float32(sq.quant_tensor(xx, qmax)[1]))
    sw, sx, q = np.concatenate(sw), np.array(sx), np.concatenate(q)
    assert np.isnan(sw).any() and (sw == 0).any() and clip > 0 and q.min() == -qmax and q.max() == qmax
    pos = sw[np.isfinite(sw) & (sw > 0)]
    assert (np.frexp(pos)[0] == 0.5).any(), f"no int{bits} tie rows (power-of-two step)"
    assert np.isnan(sx).any() and (sx == 0).any()
    px = sx[np.isfinite(sx) & (sx > 0)]
    assert (np.frexp(px)[0] == 0.5).any(), f"no int{bits} tie tensors (power-of-two scale)"


def test_backend_without_an_op_is_reported_missing_not_a_mismatch():
    class Partial:          # spec without the int8 GEMM
        def __getattr__(self, op):
            if op == "gemm_i8":
                raise AttributeError(op)
            return getattr(spec_backend, op)
    report = P.run([("cpu_ref", cpu_ref), ("partial", Partial())], ops=["gemm_i8", "quant_tensor"], cases=3)
    assert report.ok and not report.complete
    assert report.missing == {"gemm_i8": ["partial"]} and report.total_mismatches == 0
    assert report.ops["gemm_i8"].cases == 3 and report.ops["quant_tensor"].missing == []
    table = P.format_table(report)
    assert "MISSING on partial" in table and "missing: partial has no gemm_i8" in table and "PASS" in table
    assert report.to_json()["missing"] == {"gemm_i8": ["partial"]}


def test_int8_cases_are_valid_and_cover_specials():
    from mlx_open1b import opargs
    big = []
    for i in range(24):
        a, b = P.make_case("gemm_i8", i).args
        opargs.gemm_i8(a, b)                      # valid: int8 in [-127, 127], P <= 2^17
        big.append(a.shape[1])
        f = P.make_case("hadamard_rows", i).args[0]
        assert f.shape[0] % 128 == 0
        dy, x, w = P.make_case("qlinear_backward", i).args
        opargs.qlinear_backward(dy, x, w)
        x, w = P.make_case("qlinear_forward", i).args
        opargs.qlinear_forward(x, w)
    assert max(big) == opargs.Q_MAX_P
    s = [np.float32(cpu_ref.quant_tensor(*P.make_case("quant_tensor", i).args)[1]) for i in range(24)]
    assert any(np.isnan(v) for v in s) and any(v == 0 for v in s) and any(np.isfinite(v) and v > 0 for v in s)
    sw = np.concatenate([cpu_ref.quant_weight_rows(*P.make_case("quant_weight_rows", i).args)[1] for i in range(24)])
    assert np.isnan(sw).any() and (sw == 0).any()
    assert (np.frexp(sw[np.isfinite(sw) & (sw > 0)])[0] == 0.5).any(), "no tie rows (power-of-two step)"


# ----------------------------------------------------------------------------- planted difference
def _flip_last_bit(fn, output: int, flat_index: int):
    def planted(*a, **k):
        res = fn(*a, **k)
        tup = res if isinstance(res, tuple) else (res,)
        arr = np.array(tup[output], copy=True)
        arr.reshape(-1).view(np.uint32 if arr.dtype.itemsize == 4 else np.uint16)[flat_index] ^= 1
        tup = tup[:output] + (arr,) + tup[output + 1:]
        return tup if isinstance(res, tuple) else tup[0]
    return planted


def test_planted_one_bit_difference_is_reported(monkeypatch):
    op = "rmsnorm_forward"
    case = P.make_case(op, 0)
    ref_y, ref_r = cpu_ref.rmsnorm_forward(*case.args)
    N, C = ref_y.shape
    flat = (N * C) // 2
    monkeypatch.setattr(spec_backend, op, _flip_last_bit(spec_backend.rmsnorm_forward, 0, flat))
    report = P.run(["cpu_ref", "spec"], ops=[op, "exp"], cases=3)
    assert not report.ok
    r = report.ops[op]
    assert r.cases == 3 and r.mismatches == 3 and report.ops["exp"].mismatches == 0
    m = r.first
    assert (m["op"], m["case"], m["output"], m["backend"], m["kind"]) == (op, 0, "y", "spec", "value")
    assert m["seed"] == f"0x{case.seed:016x}"
    idx = tuple(int(i) for i in np.unravel_index(flat, (N, C)))
    assert tuple(m["index"]) == idx and m["count"] == 1
    want = int(ref_y.view(np.uint32)[idx])
    assert m["ref_hex"] == f"0x{want:08x}" and m["hex"] == f"0x{want ^ 1:08x}"
    assert m["ref_value"] == float(ref_y[idx])
    assert m["value"] == float(np.uint32(want ^ 1).view(np.float32))
    table = P.format_table(report)
    assert "FAIL" in table and f"y[{idx[0]}, {idx[1]}]" in table and m["hex"] in table
    # the CLI exits 1 and prints the same first mismatch
    res = CliRunner().invoke(cli, ["parity", "run", "--backends", "cpu_ref,spec", "--ops", op, "--cases", "2"])
    assert res.exit_code == 1, res.output
    assert m["hex"] in res.output and m["ref_hex"] in res.output and "FAIL" in res.output


def test_backend_that_raises_is_a_mismatch(monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("kernel exploded")
    monkeypatch.setattr(spec_backend, "swiglu_forward", boom)
    report = P.run(["cpu_ref", "spec"], ops=["swiglu_forward"], cases=2)
    r = report.ops["swiglu_forward"]
    assert r.mismatches == r.errors == 2 and "kernel exploded" in r.first["detail"]


def test_parity_run_cli_passes_and_rejects_bad_arguments():
    r = CliRunner()
    res = r.invoke(cli, ["parity", "run", "--backends", "cpu_ref,spec", "--ops", "exp,linear_forward", "--cases", "3"])
    assert res.exit_code == 0, res.output
    assert "PASS" in res.output and "linear_forward" in res.output
    res = r.invoke(cli, ["parity", "run", "--backends", "cpu_ref,nosuch", "--cases", "1"])
    assert res.exit_code == 2 and "unknown backend 'nosuch'" in res.output
    res = r.invoke(cli, ["parity", "run", "--backends", "cpu_ref,spec", "--ops", "nosuch_op"])
    assert res.exit_code == 2 and "unknown op(s) nosuch_op" in res.output
    res = r.invoke(cli, ["parity", "run", "--backends", "cpu_ref", "--cases", "1"])
    assert res.exit_code == 2 and "at least two backends" in res.output
    res = r.invoke(cli, ["parity", "run", "--cases", "0"])
    assert res.exit_code == 2
    for name in MISSING:        # a GPU backend not in the tree yet: unavailable, with the reason
        res = r.invoke(cli, ["parity", "run", "--backends", f"cpu_ref,{name}", "--cases", "1"])
        assert res.exit_code == 2 and f"backend '{name}' cannot run here" in res.output


# ----------------------------------------------------------------------------- bundles
@pytest.fixture(scope="module")
def bundles(tmp_path_factory, default_corpus):
    """Two bundles exported on this machine (cpu_ref, 3 cases per op, 2 training steps)."""
    d = tmp_path_factory.mktemp("bundles")
    r = CliRunner()
    for name in ("a.json", "b.json"):
        res = r.invoke(cli, ["parity", "export", str(d / name), "--cases", "3", "--steps", "2",
                             "--data", str(default_corpus)])
        assert res.exit_code == 0, res.output
        assert "contract v1" in res.output and "ledger of 2 steps" in res.output
    return d


def test_export_compare_identical(bundles):
    b = json.loads((bundles / "a.json").read_text())
    assert b["format"] == "open1b-parity-bundle/1" and b["contract_version"] == cpu_ref.contract_version()
    assert set(b["ops"]) == set(P.OPS) and all(len(v) == 3 for v in b["ops"].values())
    assert len(b["training"]["ledger"]) == 2 and b["machine"]["libraries"]["numpy"] == np.__version__
    res = CliRunner().invoke(cli, ["parity", "compare", str(bundles / "a.json"), str(bundles / "b.json")])
    assert res.exit_code == 0, res.output
    assert "result: IDENTICAL" in res.output and "ledger: 2 records compared" in res.output
    assert f"{len(P.OPS) * 3} identical" in res.output


def _edit(src: pathlib.Path, dst: pathlib.Path, fn, rehash: bool = True) -> None:
    b = json.loads(src.read_text())
    fn(b)
    if rehash:
        b.pop("bundle_sha256")
        import hashlib
        b["bundle_sha256"] = hashlib.sha256(canonical(b)).hexdigest()
    dst.write_text(json.dumps(b))


def test_modified_bundle_reported_at_the_right_case(bundles, tmp_path):
    def edit(b):
        out = b["ops"]["swiglu_backward"][2]["outputs"]
        out["dh"] = "0" * 64
    _edit(bundles / "a.json", tmp_path / "m.json", edit)
    res = CliRunner().invoke(cli, ["parity", "compare", str(bundles / "a.json"), str(tmp_path / "m.json")])
    assert res.exit_code == 1, res.output
    assert "first difference: swiglu_backward case 2" in res.output and "output 'dh'" in res.output
    assert "swiglu_backward: 1" in res.output and "result: DIFFERENT" in res.output
    # edited without re-hashing: the same case, and a warning that the file was edited
    _edit(bundles / "a.json", tmp_path / "m2.json", edit, rehash=False)
    res = CliRunner().invoke(cli, ["parity", "compare", str(bundles / "a.json"), str(tmp_path / "m2.json")])
    assert res.exit_code == 1 and "edited after export" in res.output
    assert "first difference: swiglu_backward case 2" in res.output


def test_modified_ledger_reported_at_the_right_record(bundles, tmp_path):
    def edit(b):
        b["training"]["ledger"][1]["hashes"]["params"] = "f" * 64
    _edit(bundles / "a.json", tmp_path / "l.json", edit)
    res = CliRunner().invoke(cli, ["parity", "compare", str(bundles / "a.json"), str(tmp_path / "l.json")])
    assert res.exit_code == 1, res.output
    assert "ledger record 1 (step 1): hashes.params" in res.output


def test_compare_refuses_other_contract_versions(bundles, tmp_path):
    _edit(bundles / "a.json", tmp_path / "v2.json", lambda b: b.update(contract_version=2))
    res = CliRunner().invoke(cli, ["parity", "compare", str(bundles / "a.json"), str(tmp_path / "v2.json")])
    assert res.exit_code == 2, res.output
    assert "different arithmetic contracts" in res.output and "A v1, B v2" in res.output
    (tmp_path / "junk.json").write_text("{\"hello\": 1}")
    res = CliRunner().invoke(cli, ["parity", "compare", str(bundles / "a.json"), str(tmp_path / "junk.json")])
    assert res.exit_code == 2 and "not a parity bundle" in res.output


def test_export_bad_backend(tmp_path):
    res = CliRunner().invoke(cli, ["parity", "export", str(tmp_path / "x.json"), "--backend", "nosuch"])
    assert res.exit_code == 2 and "unknown backend 'nosuch'" in res.output
    res = CliRunner().invoke(cli, ["parity", "export", str(tmp_path / "x.json"), "--backend", "spec"])
    assert res.exit_code == 2 and "cannot train" in res.output
    assert not (tmp_path / "x.json").exists()


# ----------------------------------------------------------------------------- whole-run parity
def _micro_run(steps: int, phases, checkpoint_every: int, spike_threshold: float):
    """A run of the micro model (tile-crossing GEMMs, a vocabulary over the 1024-entry xent chunk,
    72-token sequences over the 64-key attention block in the global layer) that clips, spikes and
    skips within a few steps."""
    from mlx_open1b.config import ModelConfig, RunConfig, TrainConfig
    model = ModelConfig(vocab_size=4000, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                        ffn_hidden=48, seq_len=72, window=8, global_every=2)
    t = TrainConfig(seed=7, microbatch_seqs=1, phases=phases, total_tokens=20000, peak_lr=1e-2, warmup_tokens=64,
                    checkpoint_every=checkpoint_every, eval_every=0, eval_windows=2, clip_norm=2.0,
                    spike_threshold=spike_threshold, spike_skip=1)
    return RunConfig(model, t, "micro"), steps


# CI: 5 steps of M = 7 (3 set bits: the fold's leftover association shows); step 1 clips and
# spikes, step 2 is skipped after a resume from ckpt-2 (which carries the skip), ckpt-4 is
# written by the resumed run. ~6 s a backend on the CPU emulators.
WHOLE_RUN = {"ci": (_micro_run(5, ((0, 7),), 2, 2.05), (2,)),
             # longer: M = 3 then 7, two resumes
             "long": (_micro_run(12, ((0, 3), (800, 7)), 3, 2.7), (4, 8))}


@pytest.fixture(scope="module")
def micro_corpus(tmp_path_factory):
    from data_helpers import MICRO_MIX, make_corpus
    d = tmp_path_factory.mktemp("whole_run") / "corpus"
    make_corpus(d, MICRO_MIX)
    return d


def _train(run, backend, variant, corpus, resumes=()):
    from mlx_open1b.train import Trainer
    (cfg, steps), _ = WHOLE_RUN[variant]
    quiet = dict(log=lambda m: None, backend=backend)
    tr = Trainer(run, cfg, corpus, **quiet)
    for stop in resumes:
        tr.train(stop)
        tr = Trainer(run, resume=True, **quiet)
    tr.train(steps)
    return (run / "ledger.jsonl").read_bytes()


@pytest.fixture(scope="module")
def reference_ledgers(tmp_path_factory, micro_corpus):
    """cpu_ref's ledger of each variant, uninterrupted."""
    d = tmp_path_factory.mktemp("whole_run_ref")
    return {v: _train(d / v, "cpu_ref", v, micro_corpus) for v in WHOLE_RUN}


def _check_whole_run(name, variant, reference_ledgers, micro_corpus, tmp_path):
    want = reference_ledgers[variant]
    recs = [json.loads(x) for x in want.splitlines()]
    assert any(r["clipped"] for r in recs) and any(r["skipped"] for r in recs), "retune the variant"
    assert any(not (r["clipped"] or r["skipped"]) for r in recs)
    assert {r["microbatches"] for r in recs} >= {7}
    _, resumes = WHOLE_RUN[variant]
    got = _train(tmp_path / name, name, variant, micro_corpus, resumes)
    for k, (a, b) in enumerate(zip(want.splitlines(), got.splitlines())):
        assert a == b, f"ledger record {k} differs between cpu_ref and {name}"
    assert got == want


@pytest.mark.parametrize("name", ["metal", "cuda"])
def test_whole_run_parity(name, reference_ledgers, micro_corpus, tmp_path):
    _check_whole_run(name, "ci", reference_ledgers, micro_corpus, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["metal", "cuda"])
def test_whole_run_parity_long(name, reference_ledgers, micro_corpus, tmp_path):
    _check_whole_run(name, "long", reference_ledgers, micro_corpus, tmp_path)


@pytest.fixture(scope="module")
def tiny_preset_ledger(default_corpus):
    return P.bundle.train_ledger("cpu_ref", 2, default_corpus)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["metal", "cuda"])
def test_whole_run_parity_tiny_preset(name, tiny_preset_ledger, default_corpus):
    """The tiny preset (d_model 128, 4 layers, 128-token sequences) for 2 steps."""
    want = tiny_preset_ledger
    got = P.bundle.train_ledger(name, 2, default_corpus)
    assert got["ledger"] == want["ledger"] and got["run_hash"] == want["run_hash"]


def test_get_backend_errors():
    from mlx_open1b.train import TrainError, get_backend
    with pytest.raises(TrainError, match="unknown backend 'nosuch'"):
        get_backend("nosuch")
    for name in MISSING:
        with pytest.raises(TrainError, match=f"backend '{name}' is not available here"):
            get_backend(name)
    for name in GPU:
        assert get_backend(name) is importlib.import_module(f"mlx_open1b.{name}.ops")
