"""The chained JSONL ledger: append, verify, tampering located by line and step, torn lines,
truncation for resume."""
import hashlib
import json

import numpy as np
import pytest

from mlx_open1b.config import preset
from mlx_open1b.contract import CONTRACT_VERSION
from mlx_open1b.ledger import Ledger, LedgerError, canonical_dumps, genesis_hash, record_hash, run_hash, verify_chain

G = genesis_hash(preset("tiny"), "f" * 64, "e" * 64, CONTRACT_VERSION)


def _record(step: int) -> dict:
    h = lambda s: hashlib.sha256(f"{s}/{step}".encode()).hexdigest()
    return {
        "step": step, "windows": [4 * step, 4 * step + 4], "lr": 3e-3 * step / 7, "loss": np.float32(9.1 - step / 3),
        "ce": 9.0 - step / 3, "zloss": np.float32(1e-4) * step, "grad_norm": np.float64(0.1 + step),
        "clipped": step % 2 == 0, "skipped": np.bool_(step == 4), "spike": None, "eval": {"mix": 7.25} if step % 3 == 0 else None,
        "tokens": np.int64(512 * step), "hashes": {"batch": h("b"), "params": h("p"), "opt_state": h("o"), "grads": h("g")},
    }


def _write(path, n: int = 6, first: int = 1) -> list[str]:
    led = Ledger(path, G)
    return [led.append(_record(s)) for s in range(first, first + n)]


def _lines(path) -> list[str]:
    return path.read_text().splitlines(keepends=True)


def test_append_verify_and_reopen(tmp_path):
    p = tmp_path / "ledger.jsonl"
    hashes = _write(p, 4)
    assert verify_chain(p, G) == hashes[-1] == run_hash(p)
    recs = Ledger(p, G).records()
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert recs[0]["prev"] == G and all(recs[i]["prev"] == recs[i - 1]["hash"] for i in range(1, 4))
    assert all(record_hash(r) == r["hash"] for r in recs)
    # floats round-trip exactly, numpy scalars become JSON numbers/booleans
    r2 = _record(2)
    assert recs[1]["loss"] == float(r2["loss"]) and recs[1]["lr"] == r2["lr"] and recs[1]["skipped"] is False
    # each line is the canonical JSON of its record
    assert all(l == canonical_dumps(r) + "\n" for l, r in zip(_lines(p), recs))
    # reopening continues the chain; an identical history gives a byte-identical file
    led = Ledger(p, G)
    led.append(_record(5))
    led.append(_record(6))
    q = tmp_path / "again.jsonl"
    _write(q, 6)
    assert p.read_bytes() == q.read_bytes()
    assert verify_chain(p, G) == verify_chain(q, G)
    e = tmp_path / "empty.jsonl"
    e.write_text("")
    assert verify_chain(e, G) == G                    # no records: the chain ends at the genesis
    with pytest.raises(LedgerError, match="no records"):
        run_hash(e)
    with pytest.raises(LedgerError, match="no ledger"):
        verify_chain(tmp_path / "missing.jsonl", G)


def test_genesis_commits_to_every_input():
    cfg = preset("tiny")
    base = genesis_hash(cfg, "a" * 64, "b" * 64, 1)
    assert genesis_hash(cfg.to_json(), "a" * 64, "b" * 64, 1) == base
    assert genesis_hash(json.loads(cfg.dumps()), "a" * 64, "b" * 64, 1) == base     # tuples vs lists
    others = [genesis_hash(preset("small"), "a" * 64, "b" * 64, 1), genesis_hash(cfg, "c" * 64, "b" * 64, 1),
              genesis_hash(cfg, "a" * 64, "c" * 64, 1), genesis_hash(cfg, "a" * 64, "b" * 64, 2)]
    assert len({base, *others}) == 5


def test_edited_field_is_reported_at_its_line_and_step(tmp_path):
    p = tmp_path / "ledger.jsonl"
    _write(p, 6)
    lines = _lines(p)
    rec = json.loads(lines[2])                       # line 3, step 3
    rec["loss"] = rec["loss"] + 1e-9
    lines[2] = json.dumps(rec, sort_keys=True, separators=(",", ":")) + "\n"
    p.write_text("".join(lines))
    with pytest.raises(LedgerError, match=r"line 3 \(step 3\): record edited") as e:
        verify_chain(p, G)
    assert (e.value.line, e.value.step) == (3, 3)
    with pytest.raises(LedgerError, match=r"line 3 \(step 3\)"):
        Ledger(p, G)                                  # never appends to a broken ledger


def test_edit_with_recomputed_hash_breaks_the_next_link(tmp_path):
    p = tmp_path / "ledger.jsonl"
    _write(p, 6)
    lines = _lines(p)
    rec = json.loads(lines[3])                        # line 4, step 4
    rec["hashes"]["params"] = "0" * 64
    rec["hash"] = record_hash(rec)
    lines[3] = canonical_dumps(rec) + "\n"
    p.write_text("".join(lines))
    with pytest.raises(LedgerError, match=r"line 5 \(step 5\): broken chain.*line 4 \(step 4\)") as e:
        verify_chain(p, G)
    assert (e.value.line, e.value.step) == (5, 5)


def test_deleted_and_reordered_lines(tmp_path):
    p = tmp_path / "ledger.jsonl"
    _write(p, 6)
    lines = _lines(p)
    p.write_text("".join(lines[:2] + lines[3:]))      # delete line 3 (step 3)
    with pytest.raises(LedgerError, match=r"line 3 \(step 4\): broken chain.*line 2 \(step 2\)"):
        verify_chain(p, G)
    p.write_text("".join(lines[:3] + [lines[4], lines[3]] + lines[5:]))   # swap steps 4 and 5
    with pytest.raises(LedgerError, match=r"line 4 \(step 5\): broken chain") as e:
        verify_chain(p, G)
    assert (e.value.line, e.value.step) == (4, 5)
    p.write_text("".join(lines[1:]))                  # first line deleted
    with pytest.raises(LedgerError, match=r"line 1 \(step 2\).*genesis"):
        verify_chain(p, G)
    p.write_text("".join(lines))
    with pytest.raises(LedgerError, match=r"line 1 \(step 1\).*genesis"):
        verify_chain(p, "0" * 64)                     # another run's genesis


def test_reformatted_or_garbage_lines_are_errors(tmp_path):
    p = tmp_path / "ledger.jsonl"
    _write(p, 4)
    lines = _lines(p)
    spaced = json.dumps(json.loads(lines[1]), sort_keys=True) + "\n"           # same values, spaces
    p.write_text("".join(lines[:1] + [spaced] + lines[2:]))
    with pytest.raises(LedgerError, match=r"line 2 \(step 2\): .*not the canonical JSON"):
        verify_chain(p, G)
    p.write_text("".join(lines[:2] + ["{garbage\n"] + lines[2:]))
    with pytest.raises(LedgerError, match=r"line 3 \(step None\): not a JSON record"):
        verify_chain(p, G)
    with pytest.raises(LedgerError, match=r"line 3"):
        Ledger(p, G)                                  # a complete bad line is never "repaired"


@pytest.mark.parametrize("tail", ["half", "nul"])
def test_torn_last_line(tmp_path, tail):
    p = tmp_path / "ledger.jsonl"
    hashes = _write(p, 3)
    good = p.read_bytes()
    nxt = (canonical_dumps({**json.loads(_lines(p)[-1]), "step": 4}) + "\n").encode()
    p.write_bytes(good + (nxt[: len(nxt) // 2] if tail == "half" else b"\0" * 4096))
    with pytest.raises(LedgerError, match=r"line 4 .*incomplete last line") as e:
        verify_chain(p, G)
    assert e.value.line == 4
    assert run_hash(p) == hashes[-1]
    with pytest.warns(RuntimeWarning, match="incomplete last line"):
        led = Ledger(p, G)
    assert p.read_bytes() == good and len(led) == 3
    led.append(_record(4))
    q = tmp_path / "clean.jsonl"
    _write(q, 4)
    assert p.read_bytes() == q.read_bytes()


def test_truncate_after_for_resume(tmp_path):
    p, q = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    full = _write(q, 8)
    led = Ledger(p, G)
    for s in range(1, 7):
        led.append(_record(s))
    assert led.truncate_after(3) == 3
    assert [r["step"] for r in led.records()] == [1, 2, 3] and verify_chain(p, G) == full[2]
    assert [r["step"] for r in Ledger(p, G).records()] == [1, 2, 3]
    for s in range(4, 9):                             # the resumed run writes the same records
        led.append(_record(s))
    assert p.read_bytes() == q.read_bytes() and verify_chain(p, G) == full[-1]
    assert led.truncate_after(100) == 0
    assert led.truncate_after(0) == 8 and p.read_bytes() == b"" and led.last_hash == G
    assert not list(tmp_path.glob(".a.jsonl.*"))      # no temp files left


def test_append_rejects_bad_records(tmp_path):
    led = Ledger(tmp_path / "l.jsonl", G)
    led.append(_record(1))
    with pytest.raises(LedgerError, match="step 1 does not follow"):
        led.append(_record(1))
    with pytest.raises(LedgerError, match="integer \"step\""):
        led.append({"loss": 1.0})
    with pytest.raises(LedgerError, match="'prev'"):
        led.append({**_record(2), "prev": G})
    with pytest.raises(LedgerError, match=r"record\.x: a value of type object"):
        led.append({**_record(2), "x": object()})
    with pytest.raises(LedgerError, match="genesis"):
        Ledger(tmp_path / "m.jsonl", "not-a-hash")
    assert len(Ledger(tmp_path / "l.jsonl", G)) == 1


def test_non_finite_values_round_trip(tmp_path):
    p = tmp_path / "l.jsonl"
    led = Ledger(p, G)
    led.append({**_record(1), "grad_norm": float("inf"), "loss": float("nan"), "lr": -0.0})
    rec = Ledger(p, G).records()[0]
    assert rec["grad_norm"] == float("inf") and rec["loss"] != rec["loss"]
    assert str(rec["lr"]) == "-0.0"
    assert verify_chain(p, G) == rec["hash"]
