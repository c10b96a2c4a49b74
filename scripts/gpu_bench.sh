#!/usr/bin/env bash
# First run on a GPU box, offline, under 5 minutes: benchmarks/gpu_bench.py times each hot kernel of
# the cuda backend at open1b width (one sequence of 4096 tokens) and one open1b-width microbatch
# (2 layers, one sequence, bf16 and int8), next to torch.matmul in fp32 and bf16 (cuBLAS) and torch's
# attention, with the speed model's PREDICTION beside each (benchmarks/kernel_model_prediction.json,
# computed without a GPU by benchmarks/kernel_model.py --bench-json). The table goes to
# gpu_bench.txt (and gpu_bench.json) in the results folder.
#
# Usage: scripts/gpu_bench.sh [--help]
#
# Environment (all optional):
#   PYTHON=python3            interpreter to use
#   O1B_RESULTS=DIR           where the table goes (default: $OUT if set, else a temporary directory)
#   O1B_BENCH_BUDGET=240      seconds for the benchmark itself (a slow shape is timed once)
#   O1B_BENCH_ONLY=a,b        only these shapes (labels as in the table, e.g. "qkv fwd,model bf16")
#   O1B_GPU_BENCH_EMULATED=1  dry run without a GPU: the CPU emulator at tiny shapes (testing this script)
#   O1B_SKIP_INSTALL=1        use the package as installed (no pip)
set -uo pipefail
cd "$(dirname "$0")/.."
WHO=gpu_bench
STEPS=0
EMULATED=${O1B_GPU_BENCH_EMULATED:-0}
. scripts/check_lib.sh
setup gpu-bench "$@"
BUDGET=${O1B_BENCH_BUDGET:-240}
case $BUDGET in ''|*[!0-9]*) die "O1B_BENCH_BUDGET=$BUDGET: expected whole seconds" 2 ;; esac

stage "python, the package, CuPy and torch"
check_python
if ! "$PY" -c "import mlx_open1b" >/dev/null 2>&1; then
    : >"$RES/missing.txt"
    install_package
fi
if [ "$EMULATED" = 1 ]; then
    echo "O1B_GPU_BENCH_EMULATED=1: no GPU required; the cuda backend runs on its CPU emulator at tiny shapes"
else
    "$PY" - <<'PYEOF' || die "this benchmark needs CuPy, torch and a CUDA GPU (see above)" 3
import sys
try:
    import cupy, torch
except Exception as e:
    sys.exit(f"cannot import CuPy and torch ({type(e).__name__}: {e})")
if not torch.cuda.is_available():
    sys.exit("torch sees no CUDA device")
from mlx_open1b.cuda import runtime
ok, why = runtime.cuda_status()
if not ok:
    sys.exit(why)
print(why, "| torch", torch.__version__, "|", torch.cuda.get_device_name(0))
PYEOF
fi

stage "gpu_bench (budget ${BUDGET} s)"
ARGS=(--backend cuda --out "$RES" --budget "$BUDGET")
[ "$EMULATED" = 1 ] && ARGS+=(--dry-run)
[ -n "${O1B_BENCH_ONLY:-}" ] && ARGS+=(--only "$O1B_BENCH_ONLY")
timeout "$((BUDGET + 120))" "$PY" benchmarks/gpu_bench.py "${ARGS[@]}"
code=$?
_stage_end
[ "$code" = 0 ] || die "benchmarks/gpu_bench.py failed (exit $code)" 1
echo
echo "table: $RES/gpu_bench.txt (seconds per stage: $RES/timings.tsv)"
