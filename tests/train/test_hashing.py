"""Canonical Merkle hashes (DESIGN §7, CONTRACT "Hashes, ledger and checkpoints")."""
import hashlib
import json
import time

import numpy as np
import pytest

from mlx_open1b import hashing as H
from mlx_open1b.hashing import CHUNK, HashError

from helpers import SPECIAL_F32, rand_bf16, rand_f32


# An independent implementation written from the contract text alone (no code shared with
# mlx_open1b.hashing): the library must agree with it.
def _ref_root(data: bytes) -> bytes:
    level = [hashlib.sha256(b"\x00" + data[i:i + CHUNK]).digest() for i in range(0, max(len(data), 1), CHUNK)]
    while len(level) > 1:
        nxt = [hashlib.sha256(b"\x01" + level[i] + level[i + 1]).digest() for i in range(0, len(level) - 1, 2)]
        level = nxt + ([level[-1]] if len(level) % 2 else [])
    return level[0]


def _ref_tensor(name: str, dtype: str, shape, data: bytes) -> bytes:
    header = ('{"dtype":"%s","name":%s,"shape":[%s]}' % (dtype, json.dumps(name), ",".join(map(str, shape)))).encode()
    return hashlib.sha256(b"\x02" + header + _ref_root(data)).digest()


def _ref_collection(kind: str, named: dict) -> str:
    digests = [named[n] for n in sorted(named)]
    root = _ref_root_of_digests(digests) if digests else bytes(32)
    header = ('{"count":%d,"kind":%s}' % (len(digests), json.dumps(kind))).encode()
    return hashlib.sha256(b"\x03" + header + root).hexdigest()


def _ref_root_of_digests(level):
    while len(level) > 1:
        nxt = [hashlib.sha256(b"\x01" + level[i] + level[i + 1]).digest() for i in range(0, len(level) - 1, 2)]
        level = nxt + ([level[-1]] if len(level) % 2 else [])
    return level[0]


def test_matches_an_independent_implementation_of_the_contract():
    rng = np.random.default_rng(1)
    cases = [
        ("wte", rand_bf16(rng, (3, 5)), "bf16"),
        ("x", rand_f32(rng, (5 * CHUNK // 4 + 3,)), "f32"),          # 6 leaves: 2 full levels + odd promotion
        ("tokens", rng.integers(-2**31, 2**31, (2, CHUNK // 4 + 1), dtype=np.int32), "i32"),  # 3 leaves
        ("u", rng.integers(0, 2**32, (4, 4, 2), dtype=np.uint32), "u32"),
        ("adam_t", np.array([-3, 2**40], np.int64), "i64"),
        ("counter", np.array([2**64 - 1], np.uint64), "u64"),
        ("empty", np.zeros((0, 7), np.float32), "f32"),
        ("scalar", np.float32(2.5), "f32"),
        ("naïve", SPECIAL_F32, "f32"),                                # non-ASCII name: \\u escape
    ]
    for name, a, dt in cases:
        a = np.asarray(a)
        want = _ref_tensor(name, dt, a.shape, a.astype(a.dtype.newbyteorder("<")).tobytes())
        assert H.tensor_hash(name, a, dt) == want.hex(), name
        assert H.tensor_hash(name, a) == want.hex(), name        # dtype name inferred
    named = {n: _ref_tensor(n, dt, np.shape(a), np.asarray(a).tobytes()) for n, a, dt in cases}
    assert H.collection_hash("params", cases) == _ref_collection("params", named)


def test_golden_values_pin_cross_machine_behaviour():
    # Computed by this code (2025, x86-64 little-endian) and checked against the independent
    # implementation above. They pin the canonical bytes and the tree: any machine, byte order or
    # future change that alters them breaks every recorded ledger, so they must never change
    # without a new ledger format.
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert H.tensor_hash("w", a) == "37d26dabfaa9686de834a0ecbcf7f0c610bf592189511a2f09e811824a638ea7"
    b = np.array([0x3F80, 0x7FC0, 0x8000], np.uint16)
    assert H.collection_hash("params", [("w", a, "f32"), ("g", b, "bf16")]) == \
        "97299d7608f50b50679f189fc2b965d908039dcab1e5d8714410831e3b79ece8"


def test_name_dtype_shape_and_data_all_change_the_hash():
    a = np.arange(12, dtype=np.int32).reshape(3, 4)
    base = H.tensor_hash("a", a)
    variants = {
        "name": H.tensor_hash("b", a),
        "dtype (same bytes, u32)": H.tensor_hash("a", a.view(np.uint32)),
        "dtype (same bytes, f32)": H.tensor_hash("a", a.view(np.float32)),
        "shape (4,3)": H.tensor_hash("a", a.reshape(4, 3)),
        "shape (12,)": H.tensor_hash("a", a.reshape(12)),
        "shape (1,3,4)": H.tensor_hash("a", a.reshape(1, 3, 4)),
    }
    flipped = a.copy()
    flipped.view(np.uint8)[-1] ^= 0x80
    variants["one bit"] = H.tensor_hash("a", flipped)
    assert base not in variants.values()
    assert len(set(variants.values())) == len(variants)
    # a bit flip in any chunk of a multi-chunk tensor changes the hash
    big = np.zeros(3 * CHUNK // 4, np.float32)
    h0 = H.tensor_hash("big", big)
    for byte in (0, CHUNK - 1, CHUNK, 3 * CHUNK - 1):
        f = big.copy()
        f.view(np.uint8)[byte] ^= 1
        assert H.tensor_hash("big", f) != h0


def test_layout_does_not_matter_only_values():
    rng = np.random.default_rng(2)
    a = rand_f32(rng, (64, 48))
    h = H.tensor_hash("a", a)
    assert H.tensor_hash("a", np.asfortranarray(a)) == h               # copied to row-major
    assert H.tensor_hash("a", a.astype(">f4")) == h                     # big-endian storage
    strided = np.zeros((64, 96), np.float32)
    strided[:, ::2] = a
    assert H.tensor_hash("a", strided[:, ::2]) == h                     # a non-contiguous view
    buf = np.zeros(10_000, np.uint16)                                   # a view into a flat buffer
    buf[100:100 + 6] = [1, 2, 3, 4, 5, 6]
    assert H.tensor_hash("p", buf[100:106].reshape(2, 3)) == H.tensor_hash("p", np.arange(1, 7, dtype=np.uint16).reshape(2, 3))


def test_chunk_aligned_pieces_combine_to_the_whole():
    rng = np.random.default_rng(3)
    a = rand_f32(rng, (5 * CHUNK // 4 + 1000,))          # 5.004 MiB: 6 leaves
    whole = H.data_root(a)
    raw = H.byte_view(a)
    # two workers: chunks [0, 2) and [2, 6)
    split = 2 * CHUNK
    left = H.leaf_hashes(raw[:split], offset=0)
    right = H.leaf_hashes(raw[split:], offset=split)
    assert len(left) == 2 and len(right) == 4
    assert H.combine_chunks([left, right]) == whole
    # three uneven workers, and the tensor hash from gathered leaves
    parts = [H.leaf_hashes(raw[:CHUNK]), H.leaf_hashes(raw[CHUNK:4 * CHUNK], offset=CHUNK),
             H.leaf_hashes(raw[4 * CHUNK:], offset=4 * CHUNK)]
    assert H.combine_chunks(parts) == whole
    leaves = [d for p in parts for d in p]
    assert H.tensor_hash_from_leaves("a", "f32", a.shape, leaves) == H.tensor_hash("a", a)
    # a worker holding rows of a 2-D tensor: rows aligned to chunks hash as the tensor's own leaves
    m = rand_f32(rng, (4, CHUNK // 4))                     # one row = one chunk
    assert H.combine_chunks([H.leaf_hashes(m[:1]), H.leaf_hashes(m[1:], offset=CHUNK)]) == H.data_root(m)
    with pytest.raises(HashError, match="multiple of CHUNK"):
        H.leaf_hashes(raw[100:], offset=100)
    with pytest.raises(HashError, match="leaves given"):
        H.tensor_hash_from_leaves("a", "f32", a.shape, leaves[:-1])


def test_merkle_tree_shape():
    d = [hashlib.sha256(bytes([i])).digest() for i in range(5)]
    node = lambda l, r: hashlib.sha256(b"\x01" + l + r).digest()
    assert H.merkle_root(d[:1]) == d[0]
    assert H.merkle_root(d[:2]) == node(d[0], d[1])
    assert H.merkle_root(d[:3]) == node(node(d[0], d[1]), d[2])                 # odd node promoted
    assert H.merkle_root(d) == node(node(node(d[0], d[1]), node(d[2], d[3])), d[4])
    with pytest.raises(HashError):
        H.merkle_root([])
    with pytest.raises(HashError):
        H.merkle_root([b"short"])


def test_collections_order_free_unique_names_and_distributed():
    rng = np.random.default_rng(4)
    items = [(f"t{i}", rand_f32(rng, (i + 1, 3)), "f32") for i in range(7)]
    h = H.collection_hash("params", items)
    assert H.collection_hash("params", items[::-1]) == h
    assert H.collection_hash("grads", items) != h
    assert H.collection_hash("params", items[:-1]) != h
    # tensor hashes computed anywhere combine to the same collection hash
    hashes = {n: H.tensor_hash(n, a, dt) for n, a, dt in items}
    assert H.collection_hash_from_tensor_hashes("params", hashes) == h
    with pytest.raises(HashError, match="twice"):
        H.collection_hash("params", items + items[:1])
    assert H.collection_hash("empty", []) == _ref_collection("empty", {})


def test_thread_count_does_not_change_results():
    rng = np.random.default_rng(5)
    items = [("a", rand_f32(rng, (3 * CHUNK // 4 + 5,)), "f32"), ("b", rand_bf16(rng, (17, 3)), "bf16")]
    results = []
    for t in (1, 2, 5):
        H.set_hash_threads(t)
        results.append((H.collection_hash("x", items), H.tensor_hash("a", items[0][1])))
    H.set_hash_threads(min(__import__("os").cpu_count() or 1, 8))
    assert results[0] == results[1] == results[2]


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_hashing_works_in_a_forked_child():
    import os
    a = np.zeros(5 * CHUNK // 4, np.float32)
    h = H.tensor_hash("a", a)                 # the parent's thread pool now exists
    pid = os.fork()
    if pid == 0:                              # the child must not wait on the parent's threads
        os._exit(0 if H.tensor_hash("a", a) == h else 1)
    assert os.waitpid(pid, 0)[1] == 0


def test_bad_inputs_are_named():
    with pytest.raises(HashError, match="'w'.*bf16"):
        H.tensor_hash("w", np.zeros(3, np.float32), "bf16")
    with pytest.raises(HashError, match="unknown dtype name"):
        H.tensor_hash("w", np.zeros(3, np.float32), "f16")
    with pytest.raises(HashError, match="float64"):
        H.tensor_hash("w", np.zeros(3))
    with pytest.raises(HashError, match="str"):
        H.tensor_hash(3, np.zeros(3, np.float32))


def test_hashing_throughput():
    """Reports MB/s (not a benchmark gate: the assertion only catches an accidental copy-heavy
    or byte-by-byte path)."""
    a = np.frombuffer(np.random.default_rng(0).bytes(64 << 20), np.float32)
    H.tensor_hash("warm", a[:1 << 18])
    t = time.perf_counter()
    H.tensor_hash("a", a)
    dt = time.perf_counter() - t
    mbs = a.nbytes / dt / 1e6
    print(f"\ntensor_hash: {mbs:.0f} MB/s over 64 MiB")
    assert mbs > 200
