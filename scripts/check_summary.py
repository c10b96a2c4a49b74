"""The closing table of scripts/device_check.sh and scripts/mac_check.sh: each stage's verdict from
the reports it left in RES (rc/<stage> holds its exit status), then the time of every stage and of
one microbatch. Exit 0 only when every stage that ran passed.

  python scripts/check_summary.py --who NAME --backend cuda|metal --seconds N RES
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys


def read(path: pathlib.Path, default=None):
    try:
        return json.loads(path.read_text()) if path.suffix in (".json",) else path.read_text()
    except (OSError, ValueError):
        return default


def last_line(path: pathlib.Path, prefix: str = "") -> str:
    """The last line of a report that starts with `prefix` (else its last line)."""
    text = read(path, "") or ""
    lines = [x.strip() for x in text.strip().splitlines() if x.strip()]
    marked = [x for x in lines if prefix and x.startswith(prefix)]
    return (marked or lines or ["(no output)"])[-1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--who", required=True)
    ap.add_argument("--backend", required=True)
    ap.add_argument("--seconds", type=int, default=0)
    ap.add_argument("res")
    a = ap.parse_args()
    res, b = pathlib.Path(a.res), a.backend

    def code(name):
        c = (read(res / "rc" / name) or "").strip()
        return None if c == "" else c

    rows = [("device", "ok", (read(res / "device.txt") or "-").strip())]

    c = code("selftest")
    if c is not None:
        args = (read(res / "selftest-args.txt") or f"selftest --backend {b}").strip().split(" --bundle")[0]
        rows.append((args, "SKIP" if c == "skip" else "PASS" if c == "0" else "FAIL",
                     ("" if c == "skip" else f"exit {c}; ") + last_line(res / "selftest.txt", "summary:")))

    p = read(res / "parity.json")
    if code("parity") is not None:
        if p is None:
            rows.append((f"parity {b} vs cpu_ref", "FAIL", f"exit {code('parity')}, no report"))
        else:
            bad = [o for o, r in p["ops"].items() if r["mismatches"]]
            rows.append((f"parity {b} vs cpu_ref ({len(p['ops'])} ops)", "PASS" if code("parity") == "0" else "FAIL",
                         f"{p['total_cases']} cases, {p['total_mismatches']} mismatching"
                         + (" in " + ", ".join(bad) if bad else "")))

    ra, rb = read(res / "bundle-cpu_ref.json"), read(res / f"bundle-{b}.json")
    la = (ra or {}).get("training", {}).get("ledger", [])
    if code("export") is not None:
        lb = (rb or {}).get("training", {}).get("ledger", [])
        ok = code("export") == "0" and bool(la) and la == lb
        rows.append((f"ledger, tiny preset, {len(la)} steps, {b} vs cpu_ref", "PASS" if ok else "FAIL",
                     f"{sum(x == y for x, y in zip(la, lb))}/{len(la)} records identical"
                     + (f"; run hash {ra['training']['run_hash'][:16]}…" if ra and rb else f"; exit {code('export')}")))
    if code("compare") is not None:
        rows.append(("bundle compare (op hashes + ledger)", "PASS" if code("compare") == "0" else "FAIL",
                     last_line(res / "compare.txt")))

    c = code("dist")
    if c == "skip":
        rows.append(("distributed (torchrun)", "SKIP", "torch.distributed is not importable"))
    elif c is not None:
        led = res / "run-dist" / "ledger.jsonl"
        dl = [json.loads(x) for x in led.read_text().splitlines()] if led.exists() else []
        pg = re.search(r"workers \((\w+)\)", read(res / "dist.txt", "") or "")
        ok = c == "0" and bool(la) and dl == la
        rows.append((f"distributed, 1 worker ({pg.group(1) if pg else '?'}), {b} backend", "PASS" if ok else "FAIL",
                     f"exit {c}; {sum(x == y for x, y in zip(dl, la))}/{len(la)} records identical to cpu_ref's"))

    mb = read(res / "microbatch.json")
    if code("microbatch") is not None:
        detail = (f"gradient on {mb['kind']} arrays, bit-identical to cpu_ref: {mb['same']}" if mb
                  else f"exit {code('microbatch')}, no report")
        rows.append(("model program on device arrays", "PASS" if code("microbatch") == "0" else "FAIL", detail))

    w = max(len(r[0]) for r in rows)
    print(f"{a.who} ({a.seconds} s)")
    for name, verdict, detail in rows:
        print(f"  {name:<{w}}  {verdict:<4}  {detail}")
    timings = [ln.split("\t") for ln in (read(res / "timings.tsv") or "").splitlines() if "\t" in ln]
    if timings or mb:
        print("time")
        for name, secs in timings:
            print(f"  {int(secs):>6} s  {name}")
        if mb:
            ms = mb["ms"]
            print(f"  one microbatch ({mb['model']} model, int8, {mb['windows']} windows): {b} {ms['device']:.1f} ms "
                  f"on device arrays, {ms['numpy_io']:.1f} ms numpy in/out; cpu_ref {ms['cpu_ref']:.1f} ms "
                  f"(cpu_ref / {b}: {ms['cpu_ref'] / ms['device']:.2f}x)")
    ok = all(v in ("ok", "PASS", "SKIP") for _, v, _ in rows)
    print("RESULT:", f"PASS, {b} is bit-identical to cpu_ref" if ok else "FAIL")
    print("reports:", res)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
