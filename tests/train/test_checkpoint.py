"""Checkpoints: safetensors + meta.json, bit-exact round trip, corruption located, atomic saves
that survive crashes (an exception mid-save, and a process killed with SIGKILL mid-write)."""
import json
import os
import pathlib
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from mlx_open1b import checkpoint as C
from mlx_open1b import hashing as H
from mlx_open1b.checkpoint import CheckpointError, latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from mlx_open1b.config import preset
from mlx_open1b.contract import CONTRACT_VERSION

from helpers import SPECIAL_BF16, SPECIAL_F32, rand_bf16, rand_f32


def _state(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    nan_payload = np.array([0x7FA00001, 0xFFC12345, 0x00000001], np.uint32).view(np.float32)
    return {
        "params/wte": (rand_bf16(rng, (33, 16)), "bf16"),
        "params/norm": (SPECIAL_BF16.copy(), "bf16"),
        "opt/m/wte": (np.concatenate([rand_f32(rng, (33 * 16 - 19,)), SPECIAL_F32, nan_payload]).reshape(33, 16), "f32"),
        "opt/v/wte": (rand_f32(rng, (33, 16)) ** 2, "f32"),
        "extra/tokens": (rng.integers(-5, 8192, (3, 9), dtype=np.int32), "i32"),
        "extra/gnmr": (rng.integers(0, 2**32, (5,), dtype=np.uint32), "u32"),
        "extra/adam_t": (np.array([7, -2**40], np.int64), "i64"),
        "extra/draws": (np.array([2**64 - 1], np.uint64), "u64"),
        "extra/empty": (np.zeros((0, 4), np.float32), "f32"),
        "extra/scalar": (np.float32(3.5), "f32"),
    }


COLLECTIONS = {"params": {"wte": "params/wte", "norm": "params/norm"},
               "opt_state": ["opt/m/wte", "opt/v/wte"]}


def _meta(step: int) -> dict:
    return {"step": step, "consumed_tokens": np.int64(4096 * step), "stream": {"windows": 8 * step, "current": None},
            "schedule": {"lr": 1e-3 / 3, "skip_left": np.int32(2)}, "config": preset("tiny").to_json(),
            "tokenizer_sha256": "ab" * 32, "run_hash_at": None}


def _save(run, step, seed=0):
    return save_checkpoint(run, step, _state(seed), _meta(step), collections=COLLECTIONS)


def _bits(a):
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]) if a.size else a


def test_round_trip_is_bit_exact(tmp_path):
    st = _state()
    p = _save(tmp_path, 7)
    assert p == tmp_path / "ckpt-00000007" and sorted(x.name for x in p.iterdir()) == ["meta.json", "state.safetensors"]
    got, meta = load_checkpoint(p, tokenizer_sha256="ab" * 32)
    assert sorted(got) == sorted(st)
    for name, (a, dn) in st.items():
        b, dn2 = got[name]
        assert dn2 == dn and b.shape == np.shape(a), name
        assert np.array_equal(_bits(b), _bits(a)), name          # NaN payloads, -0, subnormals kept
    assert meta["step"] == 7 and meta["consumed_tokens"] == 7 * 4096 and meta["contract_version"] == CONTRACT_VERSION
    assert meta["config"] == json.loads(preset("tiny").dumps())
    assert meta["schedule"]["lr"] == 1e-3 / 3
    for name, (a, dn) in st.items():
        assert meta["tensors"][name]["hash"] == H.tensor_hash(name, a, dn)
    ch = C.collection_hashes(meta)
    assert ch["params"] == H.collection_hash("params", [("wte", *st["params/wte"]), ("norm", *st["params/norm"])])
    assert ch["opt_state"] == H.collection_hash("opt_state", [(n, *st[n]) for n in COLLECTIONS["opt_state"]])
    assert meta["files"]["state.safetensors"]["sha256"] == C.hashing.hashlib.sha256((p / "state.safetensors").read_bytes()).hexdigest()


def test_safetensors_layout(tmp_path):
    p = _save(tmp_path, 1)
    raw = (p / "state.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert (8 + n) % 8 == 0
    header = json.loads(raw[8:8 + n])
    assert header.pop("__metadata__") == {"format": C.FORMAT, "step": "1"}
    st = _state()
    pos = 0
    for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"]):
        a, dn = st[name]
        assert e["dtype"] == {"bf16": "BF16", "f32": "F32", "i32": "I32", "u32": "U32", "i64": "I64", "u64": "U64"}[dn]
        assert e["shape"] == list(np.shape(a)) and e["data_offsets"] == [pos, pos + np.asarray(a).nbytes]
        assert (8 + n + pos) % np.asarray(a).itemsize == 0, f"{name} is not aligned"
        assert raw[8 + n + pos: 8 + n + pos + np.asarray(a).nbytes] == np.ascontiguousarray(a).astype(np.asarray(a).dtype.newbyteorder("<")).tobytes()
        pos = e["data_offsets"][1]
    assert 8 + n + pos == len(raw)


def test_cross_check_with_the_safetensors_package(tmp_path):
    import safetensors as st_mod            # in the test extra: a missing package fails, never skips
    import safetensors.numpy as st_np
    p = _save(tmp_path, 1)
    ours = _state()
    theirs = dict(st_mod.deserialize((p / "state.safetensors").read_bytes()))
    assert sorted(theirs) == sorted(ours)
    for name, (a, dn) in ours.items():
        t = theirs[name]
        assert t["dtype"].upper() == C.ST_DTYPE[dn] and list(t["shape"]) == list(np.shape(a))
        assert bytes(t["data"]) == np.ascontiguousarray(a).tobytes(), name
    # a file written by the package reads back through our parser (numpy has no bf16 type, so
    # the package's numpy writer covers the other dtypes)
    plain = {n: np.ascontiguousarray(a) for n, (a, dn) in ours.items() if dn != "bf16"}
    got, meta = C.parse_safetensors(bytearray(st_np.save(plain, metadata={"k": "v"})))
    assert meta == {"k": "v"} and sorted(got) == sorted(plain)
    for name, a in plain.items():
        assert got[name][1] == ours[name][1] and np.array_equal(_bits(got[name][0]), _bits(a)), name


def _flip(path: pathlib.Path, offset: int, bit: int = 0):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ (1 << bit)]))


def _data_start(path) -> tuple[int, dict]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return 8 + n, json.loads(raw[8:8 + n])


def test_flipped_bit_in_a_tensor_is_caught_and_named(tmp_path):
    p = _save(tmp_path, 3)
    sp = p / "state.safetensors"
    base, header = _data_start(sp)
    b, e = header["opt/v/wte"]["data_offsets"]
    _flip(sp, base + (b + e) // 2, 5)
    with pytest.raises(CheckpointError, match=r"state\.safetensors: corrupt: tensor 'opt/v/wte' differs.*SHA-256"):
        load_checkpoint(p)
    with pytest.raises(CheckpointError, match="'opt/v/wte'"):
        load_checkpoint(p, verify_tensors=False)          # the file hash still catches it and locates it


def test_flipped_bit_in_header_or_meta(tmp_path):
    p = _save(tmp_path, 3)
    sp = p / "state.safetensors"
    raw = sp.read_bytes()
    i = raw.index(b'"shape":[33,16]') + len('"shape":[3')
    _flip(sp, i, 0)                                        # [33,16] -> [32,16]: the header lies
    with pytest.raises(CheckpointError, match="state.safetensors"):
        load_checkpoint(p)
    sp.write_bytes(raw)
    load_checkpoint(p)
    mp = p / "meta.json"
    text = mp.read_text()
    mp.write_text(text.replace('"consumed_tokens": 12288', '"consumed_tokens": 12289'))
    with pytest.raises(CheckpointError, match=r"meta\.json: contents do not match its meta_hash"):
        load_checkpoint(p)
    mp.write_text(text[: len(text) // 2])
    with pytest.raises(CheckpointError, match=r"meta\.json: not valid JSON"):
        load_checkpoint(p)


def test_missing_truncated_and_foreign_checkpoints(tmp_path):
    p = _save(tmp_path, 5)
    sp, mp = p / "state.safetensors", p / "meta.json"
    raw, text = sp.read_bytes(), mp.read_text()
    sp.write_bytes(raw[:-100])
    with pytest.raises(CheckpointError, match=r"state\.safetensors: truncated: \d+ bytes, meta.json records"):
        load_checkpoint(p)
    sp.unlink()
    with pytest.raises(CheckpointError, match="state.safetensors is missing"):
        load_checkpoint(p)
    sp.write_bytes(raw)
    mp.unlink()
    with pytest.raises(CheckpointError, match="meta.json is missing"):
        load_checkpoint(p)
    with pytest.raises(CheckpointError, match="no checkpoint directory"):
        load_checkpoint(tmp_path / "ckpt-00000099")
    # another contract version (meta consistent with itself) and another tokenizer
    meta = json.loads(text)
    meta["contract_version"] = CONTRACT_VERSION + 1
    meta["meta_hash"] = C._meta_hash(meta)
    mp.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=f"contract version {CONTRACT_VERSION + 1}, this build implements version {CONTRACT_VERSION}"):
        load_checkpoint(p)
    mp.write_text(text)
    with pytest.raises(CheckpointError, match="tokenizer abababababab"):
        load_checkpoint(p, tokenizer_sha256="cd" * 32)
    # a checkpoint directory renamed to another step
    os.rename(p, tmp_path / "ckpt-00000006")
    with pytest.raises(CheckpointError, match="does not match the directory name"):
        load_checkpoint(tmp_path / "ckpt-00000006")


def test_save_rejects_bad_input(tmp_path):
    with pytest.raises(CheckpointError, match="reserved"):
        save_checkpoint(tmp_path, 1, _state(), {"tensors": 1})
    with pytest.raises(CheckpointError, match="differs from the checkpoint step"):
        save_checkpoint(tmp_path, 1, _state(), _meta(2))
    with pytest.raises(CheckpointError, match="tensor 'w'.*bf16"):
        save_checkpoint(tmp_path, 1, {"w": (np.zeros(3, np.float32), "bf16")}, {})
    with pytest.raises(CheckpointError, match=r"meta: meta\.x: a value of type set"):
        save_checkpoint(tmp_path, 1, _state(), {"x": {1, 2}})
    with pytest.raises(CheckpointError, match="no tensor named 'nope'"):
        save_checkpoint(tmp_path, 1, _state(), {}, collections={"params": ["nope"]})
    assert list_checkpoints(tmp_path) == [] and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("stage", ["after_state_file", "before_rename"])
def test_exception_mid_save_leaves_previous_checkpoint(tmp_path, monkeypatch, stage):
    _save(tmp_path, 10)
    if stage == "after_state_file":
        real = C.write_safetensors

        def boom(*a, **k):
            real(*a, **k)
            raise OSError("simulated crash after the safetensors file")
        monkeypatch.setattr(C, "write_safetensors", boom)
    else:
        def boom(src, dst):
            raise OSError("simulated crash before the rename")
        monkeypatch.setattr(C, "_rename", boom)
    with pytest.raises(OSError, match="simulated"):
        _save(tmp_path, 20, seed=1)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [10]
    assert not (tmp_path / "ckpt-00000020").exists()
    assert load_checkpoint(latest_checkpoint(tmp_path)[1])[1]["step"] == 10
    assert sorted(x.name for x in tmp_path.iterdir()) == ["ckpt-00000010"]      # temp dir cleaned


def test_replacing_a_checkpoint_of_the_same_step(tmp_path, monkeypatch):
    _save(tmp_path, 4, seed=0)
    _save(tmp_path, 4, seed=1)
    got, _ = load_checkpoint(tmp_path / "ckpt-00000004")
    assert np.array_equal(got["params/wte"][0], _state(1)["params/wte"][0])
    # a crash between moving the old one aside and renaming the new one in: the old comes back
    real = C._rename
    monkeypatch.setattr(C, "_rename", lambda s, d: (_ for _ in ()).throw(OSError("crash"))
                        if ".tmp-" in str(s) else real(s, d))
    with pytest.raises(OSError):
        _save(tmp_path, 4, seed=2)
    got, _ = load_checkpoint(tmp_path / "ckpt-00000004")
    assert np.array_equal(got["params/wte"][0], _state(1)["params/wte"][0])
    # a process killed in the same window leaves it aside; the next save (or recover) restores it
    monkeypatch.undo()
    os.rename(tmp_path / "ckpt-00000004", tmp_path / ".ckpt-00000004.old-x1")
    assert C.recover_checkpoints(tmp_path) == ["restored ckpt-00000004"]
    load_checkpoint(tmp_path / "ckpt-00000004")


_CHILD = r"""
import sys, numpy as np
from mlx_open1b.checkpoint import save_checkpoint
run = sys.argv[1]
save_checkpoint(run, 1, {"w": (np.arange(10, dtype=np.float32), "f32")}, {"n": 1})
print("saved 1", flush=True)
big = {f"m{i}": (np.full(12 << 20, i + 0.5, np.float32), "f32") for i in range(8)}   # 8 x 48 MiB
save_checkpoint(run, 2, big, {"n": 2})
print("saved 2", flush=True)
"""


@pytest.mark.parametrize("kill_at", ["temp dir created", "state file half written"])
def test_sigkill_mid_write_leaves_previous_checkpoint(tmp_path, kill_at):
    run = tmp_path / "run"
    total = 8 * (48 << 20)
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "saved 1"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            tmps = [d for d in run.iterdir() if d.name.startswith(".ckpt-00000002.tmp-")] if run.exists() else []
            f = tmps[0] / "state.safetensors" if tmps else None
            size = f.stat().st_size if f is not None and f.exists() else -1
            if tmps and (kill_at == "temp dir created" or size > total // 2):
                break
            assert proc.poll() is None, "the child finished before it could be killed"
            time.sleep(0.0005)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    # no partial checkpoint under a final name; the previous one loads; the leftover is a temp dir
    assert not (run / "ckpt-00000002").exists()
    assert [s for s, _ in list_checkpoints(run)] == [1]
    assert latest_checkpoint(run, verify=True)[0] == 1
    got, meta = load_checkpoint(run / "ckpt-00000001")
    assert np.array_equal(got["w"][0], np.arange(10, dtype=np.float32)) and meta["n"] == 1
    assert any(d.name.startswith(".ckpt-00000002.tmp-") for d in run.iterdir())
    # the next save cleans the leftovers
    save_checkpoint(run, 2, {"w": (np.arange(3, dtype=np.float32), "f32")}, {"n": 2})
    assert sorted(d.name for d in run.iterdir()) == ["ckpt-00000001", "ckpt-00000002"]
    load_checkpoint(run / "ckpt-00000002")


def test_list_latest_and_keep_last(tmp_path):
    assert list_checkpoints(tmp_path / "none") == [] and latest_checkpoint(tmp_path) is None
    for s in (5, 10, 15, 20, 100_000_000):
        save_checkpoint(tmp_path, s, {"w": (np.full(4, s, np.float32), "f32")}, {})
    (tmp_path / "ckpt-junk").mkdir()
    (tmp_path / "ckpt-00000025").write_text("a file, not a checkpoint")
    steps = [s for s, _ in list_checkpoints(tmp_path)]
    assert steps == [5, 10, 15, 20, 100_000_000]
    assert latest_checkpoint(tmp_path)[0] == 100_000_000
    assert latest_checkpoint(tmp_path, at_or_before=19)[0] == 15
    assert latest_checkpoint(tmp_path, at_or_before=20)[0] == 20
    assert latest_checkpoint(tmp_path, at_or_before=4) is None
    # a corrupt newest checkpoint is skipped (with a warning) only when asked to verify
    _flip(tmp_path / "ckpt-100000000" / "state.safetensors", os.path.getsize(tmp_path / "ckpt-100000000" / "state.safetensors") - 1)
    with pytest.warns(RuntimeWarning, match="ckpt-100000000"):
        assert latest_checkpoint(tmp_path, verify=True)[0] == 20
    # keep_last(1) keeps the newest (corrupt) one and also the newest valid one (20)
    deleted = C.keep_last(tmp_path, 1)
    assert [p.name for p in deleted] == ["ckpt-00000005", "ckpt-00000010", "ckpt-00000015"]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [20, 100_000_000]
    assert C.keep_last(tmp_path, 1) == [] and C.keep_last(tmp_path, 2) == []
    save_checkpoint(tmp_path, 30, {"w": (np.full(4, 30, np.float32), "f32")}, {})
    assert [p.name for p in C.keep_last(tmp_path, 2)] == ["ckpt-00000020"]   # 30 is valid and kept
    assert not [d for d in tmp_path.iterdir() if d.name.startswith(".ckpt-")]
    load_checkpoint(tmp_path / "ckpt-00000030")
    with pytest.raises(CheckpointError):
        C.keep_last(tmp_path, 0)
