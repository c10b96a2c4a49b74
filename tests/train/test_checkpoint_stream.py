"""A checkpoint written as a stream of pieces (StreamedCheckpoint: how a distributed run's writer
takes each owner's range in turn) is the same directory, byte for byte, as save_checkpoint of the
whole tensors; pieces cut anywhere (inside a Merkle chunk, one element, whole tensors); atomic: an
error or an abandoned stream leaves the previous checkpoint valid and nothing else."""
import numpy as np
import pytest

from mlx_open1b import checkpoint as C
from mlx_open1b import fsutil
from mlx_open1b.checkpoint import (CheckpointError, StreamedCheckpoint, list_checkpoints, load_checkpoint,
                                   save_checkpoint)
from mlx_open1b.hashing import CHUNK

from helpers import rand_bf16, rand_f32


def _tensors(seed=0):
    rng = np.random.default_rng(seed)
    return {"params": (rand_bf16(rng, (CHUNK + 4099,)), "bf16"),          # two chunks and a tail
            "m": (rand_f32(rng, (3 * CHUNK // 4 + 77,)), "f32"),              # 3 chunks and a tail
            "v": (rand_f32(rng, (CHUNK // 4,)), "f32"),                       # exactly one chunk
            "counts": (rng.integers(-9, 9, (3, 5), dtype=np.int64), "i64"),
            "empty": (np.zeros((0, 3), np.float32), "f32")}


META = {"step": 5, "consumed": 123, "stream": {"pos": [1, 2]}, "note": "x"}


def tree(d):
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _stream(run, tensors, cuts, step=5, meta=META):
    specs = {n: (dn, a.shape) for n, (a, dn) in tensors.items()}
    with StreamedCheckpoint(run, step, specs, meta) as w:
        for name in w.order:
            flat = tensors[name][0].reshape(-1)
            for a, b in cuts(flat.size):
                w.write(name, flat[a:b])
        return w.finish()


def _random_cuts(rng):
    def cuts(n):
        at = sorted({0, n, *rng.integers(0, n + 1, 6).tolist()}) if n else [0, 0]
        return list(zip(at, at[1:]))
    return cuts


@pytest.mark.parametrize("how", ["whole", "random", "odd"])
def test_same_bytes_as_save_checkpoint(tmp_path, how):
    t = _tensors()
    one = save_checkpoint(tmp_path / "one", 5, t, META)
    rng = np.random.default_rng(3)
    cuts = {"whole": lambda n: [(0, n)], "random": _random_cuts(rng),
            "odd": lambda n: [(a, min(n, a + 40_001)) for a in range(0, n, 40_001)] or [(0, 0)]}[how]
    two = _stream(tmp_path / "two", t, cuts)
    assert two == C.checkpoint_dir(tmp_path / "two", 5)
    assert tree(one) == tree(two)
    got, _ = load_checkpoint(two)
    for n, (a, dn) in t.items():
        assert got[n][1] == dn and got[n][0].tobytes() == a.tobytes()


def test_misuse_is_refused_and_leaves_nothing(tmp_path):
    t = _tensors()
    run = tmp_path / "run"
    save_checkpoint(run, 4, t, {**META, "step": 4})
    specs = {n: (dn, a.shape) for n, (a, dn) in t.items()}
    with pytest.raises(CheckpointError, match="piece of tensor 'v' out of order: expected counts"):
        with StreamedCheckpoint(run, 5, specs, META) as w:
            assert w.order == ["counts", "empty", "m", "v", "params"]      # by element size, then name
            w.write("v", t["v"][0])
    with pytest.raises(CheckpointError, match="piece of tensor 'v' out of order: expected m"):
        with StreamedCheckpoint(run, 5, specs, META) as w:
            w.write("counts", t["counts"][0])          # "empty" has no bytes: m is next
            w.write("v", t["v"][0])
    with pytest.raises(CheckpointError, match="tensor 'm' is given 4 bytes more than its shape holds"):
        with StreamedCheckpoint(run, 5, specs, META) as w:
            w.write("counts", t["counts"][0])
            w.write("m", np.concatenate([t["m"][0], np.zeros(1, np.float32)]))
    with pytest.raises(CheckpointError, match=r"incomplete: tensor 'm' lacks 8 bytes"):
        with StreamedCheckpoint(run, 5, specs, META) as w:
            w.write("counts", t["counts"][0])
            w.write("m", t["m"][0][:-2])
            w.finish()
    with pytest.raises(CheckpointError, match="reserved"):
        StreamedCheckpoint(run, 5, specs, {**META, "files": {}})
    with StreamedCheckpoint(run, 5, specs, META) as w:        # abandoned: a lost worker
        w.write("counts", t["counts"][0])
        w.write("m", t["m"][0][:10])
    assert [s for s, _ in list_checkpoints(run)] == [4]
    assert sorted(p.name for p in run.iterdir()) == ["ckpt-00000004"]
    load_checkpoint(run / "ckpt-00000004")


def test_full_disk_mid_stream(tmp_path, monkeypatch):
    """The third write fails (ENOSPC): WriteError naming the checkpoint and its file; the previous
    checkpoint is intact and no temporary directory stays."""
    import errno
    t = _tensors()
    run = tmp_path / "run"
    save_checkpoint(run, 4, t, {**META, "step": 4})
    real, calls = fsutil.write_all, []

    def write_all(f, data):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(f, data)
    monkeypatch.setattr(fsutil, "write_all", write_all)
    with pytest.raises(fsutil.WriteError, match=r"cannot write checkpoint .*ckpt-00000005 .*No space left on device"):
        _stream(run, t, lambda n: [(0, n // 2), (n // 2, n)])
    assert sorted(p.name for p in run.iterdir()) == ["ckpt-00000004"]
    load_checkpoint(run / "ckpt-00000004")


def test_replacing_a_checkpoint_of_the_same_step(tmp_path):
    t, u = _tensors(0), _tensors(1)
    run = tmp_path / "run"
    save_checkpoint(run, 5, t, META)
    _stream(run, u, lambda n: [(0, n)])
    save_checkpoint(tmp_path / "ref", 5, u, META)
    assert tree(run) == tree(tmp_path / "ref")


def test_tensor_streams_digests_straddling_pieces():
    """Consecutive tensors hashed from one flat stream cut anywhere (pieces straddle tensors and
    chunks) give each tensor's own digest (leaves counted from its first byte)."""
    from mlx_open1b import hashing
    from mlx_open1b.checkpoint import TensorStreams
    rng = np.random.default_rng(9)
    shapes = [("a", (CHUNK // 4 + 3,)), ("b", (0,)), ("c", (5, 7)), ("d", (2 * CHUNK // 4 - 1,)), ("e", (1,))]
    arrs = [(n, rand_f32(rng, s)) for n, s in shapes]
    flat = np.concatenate([a.reshape(-1) for _, a in arrs]).view(np.uint8)
    want = hashing.tensor_digests([(n, a, "f32") for n, a in arrs])
    for trial in range(4):
        h = TensorStreams([(n, "f32", a.shape) for n, a in arrs])
        at = sorted({0, flat.size, *rng.integers(0, flat.size, 5 + trial).tolist()})
        for lo, hi in zip(at, at[1:]):
            h.update(memoryview(flat[lo:hi]))
        assert h.complete and h.digests == want
    with pytest.raises(ValueError, match="bytes after the last tensor"):
        h.update(memoryview(b"xx"))


def test_meta_known_at_the_end(tmp_path):
    t = _tensors()
    one = save_checkpoint(tmp_path / "one", 5, t, {**META, "params_hash": "p"})
    specs = {n: (dn, a.shape) for n, (a, dn) in t.items()}
    with StreamedCheckpoint(tmp_path / "two", 5, specs, META) as w:
        for name in w.order:
            w.write(name, t[name][0])
        two = w.finish({"params_hash": "p"})
    assert tree(one) == tree(two)


def _read_all_pieces(path, rng=None):
    from mlx_open1b.checkpoint import StreamedCheckpointReader
    out = {}
    with StreamedCheckpointReader(path) as r:
        for name, dn, shape in r.order:
            n = int(np.prod(shape))
            cuts = sorted({0, n, *(rng.integers(0, n + 1, 4).tolist() if rng is not None and n else [])})
            out[name] = np.concatenate([r.read(name, b - a) for a, b in zip(cuts, cuts[1:])] or [r.read(name, 0)])
        meta = r.finish()
    return out, meta


def test_reader_streams_what_load_checkpoint_loads(tmp_path):
    t = _tensors()
    path = save_checkpoint(tmp_path / "run", 5, t, META)
    want, wmeta = load_checkpoint(path)
    got, meta = _read_all_pieces(path, np.random.default_rng(2))
    assert meta == wmeta and sorted(got) == sorted(want)
    for n in want:
        assert got[n].tobytes() == want[n][0].tobytes() and got[n].dtype == want[n][0].dtype, n


def test_reader_finds_a_flipped_bit_and_misuse(tmp_path):
    from mlx_open1b.checkpoint import StreamedCheckpointReader
    t = _tensors()
    path = save_checkpoint(tmp_path / "run", 5, t, META)
    sp = path / C.STATE_FILE
    data = bytearray(sp.read_bytes())
    data[-3] ^= 0x10                       # the last tensor in the file: params (bf16, after the f32s)
    sp.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"corrupt: tensor 'params' differs from the recorded hash; file SHA-256"):
        _read_all_pieces(path)
    data[-3] ^= 0x10
    sp.write_bytes(bytes(data))
    with StreamedCheckpointReader(path) as r:
        with pytest.raises(CheckpointError, match="read of tensor 'v' out of order: expected counts"):
            r.read("v", 1)
        r.read("counts", 15)
        with pytest.raises(CheckpointError, match="tensor 'm' has 786509 elements left, 786510 asked"):
            r.read("m", 786510)
        with pytest.raises(CheckpointError, match="read incomplete: tensor 'm'"):
            r.finish()
    sp.write_bytes(bytes(data[:-1]))
    with pytest.raises(CheckpointError, match="truncated"):
        StreamedCheckpointReader(path)
