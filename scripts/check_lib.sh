# Shared by scripts/device_check.sh and scripts/mac_check.sh (sourced, not run): stages and their
# timings, failure, the preflight, the install, the corpus, `open1b selftest`, return codes for the
# summary. Written for bash 3.2 (macOS's /bin/bash): no associative arrays, no mapfile, and an
# empty array is expanded as ${a[@]+"${a[@]}"} under set -u.
#
# The caller sets WHO (its name), STEPS and EMULATED, runs from the checkout's top folder, sources
# this file and calls `setup NAME "$@"` (the interpreter PY, the shared settings, the report folder RES).

setup() {   # setup NAME "$@": the settings both checks share (the caller set WHO, STEPS, EMULATED), their
            # arguments, and the report folder $RES (O1B_RESULTS, $OUT, or /tmp/open1b-NAME.XXXXXX)
    local name=$1 arg
    shift
    PY=${PYTHON:-python3}
    CASES=${O1B_CASES:-25}
    EXPORT_CASES=${O1B_EXPORT_CASES:-4}
    SELFTEST=${O1B_SELFTEST:-full}
    [ "$EMULATED" = 1 ] && SELFTEST=${O1B_SELFTEST:-quick}
    case $SELFTEST in full|quick|skip) ;; *) echo "$WHO: O1B_SELFTEST=$SELFTEST (expected full, quick or skip)" >&2; exit 2 ;; esac
    PREFLIGHT_ONLY=0
    for arg in "$@"; do
        case $arg in
            --preflight-only) PREFLIGHT_ONLY=1 ;;
            -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
            *) echo "$WHO: unknown argument $arg (see --help)" >&2; exit 2 ;;
        esac
    done
    RES=${O1B_RESULTS:-${OUT:-}}
    [ -n "$RES" ] || RES=$(mktemp -d "/tmp/open1b-$name.XXXXXX")
    mkdir -p "$RES"
    : >"$RES/timings.tsv"
    rm -rf "$RES/rc" "$RES/FAILED"
    T0=$SECONDS
    OPS=()
    if [ -n "${O1B_OPS:-}" ]; then OPS=(--ops "$O1B_OPS"); fi
}

stage() {   # stage TITLE: print it; the time of the stage before goes to $RES/timings.tsv
    _stage_end
    _STAGE=$*
    _STAGE_T=$SECONDS
    echo
    echo "== [$((SECONDS - T0))s] $*"
}

_stage_end() {
    if [ -n "${_STAGE:-}" ]; then
        printf '%s\t%s\n' "$_STAGE" "$((SECONDS - _STAGE_T))" >>"$RES/timings.tsv"
    fi
    _STAGE=
}

die() {     # die MESSAGE [EXIT]: the message on stderr and in $RES/FAILED
    echo >&2
    echo "$WHO: FAILED: $1" >&2
    echo "$WHO: FAILED: $1" >"$RES/FAILED"
    exit "${2:-1}"
}

rc() {      # rc NAME CODE: a stage's exit status, for the summary
    mkdir -p "$RES/rc"
    echo "$2" >"$RES/rc/$1"
}

check_python() {
    command -v "$PY" >/dev/null 2>&1 || die "PYTHON=$PY: not found (set PYTHON=/path/to/python3, 3.10 or later)" 3
    "$PY" -c 'import sys' >/dev/null 2>&1 || die "PYTHON=$PY does not run a Python program" 3
}

find_carried() {   # O1B_DATA and O1B_WHEELS default to what the folder .device/ carries (O1B_DATA set
                   # but empty: no corpus, prepare one here)
    local d
    if [ -z "${O1B_DATA+set}" ]; then
        for d in .device/data .device/data.tar.xz .device/data.tar.gz .device/data.tar; do
            if [ -e "$d" ]; then
                O1B_DATA="$PWD/$d"
                echo "O1B_DATA=$O1B_DATA (found in .device/)"
                break
            fi
        done
    fi
    if [ -z "${O1B_WHEELS:-}" ] && [ -d .device/wheels ]; then
        O1B_WHEELS="$PWD/.device/wheels"
        echo "O1B_WHEELS=$O1B_WHEELS (found in .device/)"
    fi
}

preflight() {      # preflight BACKEND EMULATED(0|1): everything needed, before any long work
    local args
    args=(--who "$WHO" --backend "$1" --missing-out "$RES/missing.txt" --howto-out "$RES/howto.txt")
    [ "$2" = 1 ] && args+=(--emulated)
    [ -n "${O1B_DATA:-}" ] && args+=(--data "$O1B_DATA")
    [ -n "${O1B_WHEELS:-}" ] && args+=(--wheels "$O1B_WHEELS")
    [ "${O1B_SKIP_INSTALL:-0}" = 1 ] && args+=(--skip-install)
    "$PY" scripts/preflight.py "${args[@]}" >"$RES/preflight.txt" 2>&1
    local code=$?
    cat "$RES/preflight.txt"
    [ "$code" = 0 ] || die "cannot start: see what is missing and how to provide it above (also in $RES/preflight.txt)" 3
}

install_package() {   # what the preflight found missing, then pip install -e . --no-deps (builds the C reference)
    PIPLOG="$RES/pip.log"
    : >"$PIPLOG"
    "$PY" -m pip --version >/dev/null 2>&1 || die "pip is not available for $PY" 3
    local specs line src
    specs=()
    src=()
    while IFS= read -r line; do
        [ -n "$line" ] && specs+=("$line")
    done <"$RES/missing.txt"
    if [ ${#specs[@]} -gt 0 ]; then
        # --no-deps: the preflight checked every package the project imports, and what these
        # bring along (huggingface_hub with tokenizers, ...) is never imported by it
        echo "installing what is missing: ${specs[*]}"
        [ -n "${O1B_WHEELS:-}" ] && src=(--no-index --find-links "$O1B_WHEELS")
        if ! "$PY" -m pip install --no-deps --retries 1 --timeout 15 ${src[@]+"${src[@]}"} "${specs[@]}" \
                >>"$PIPLOG" 2>&1; then
            tail -n 15 "$PIPLOG" >&2
            cat "$RES/howto.txt" >&2
            die "cannot install ${specs[*]} (no network? see above how to bring them here); log: $PIPLOG" 3
        fi
    fi
    if [ "${O1B_SKIP_INSTALL:-0}" = 1 ]; then
        echo "O1B_SKIP_INSTALL=1: using the installed package"
    elif ! "$PY" -m pip install --no-deps --no-build-isolation -e . >>"$PIPLOG" 2>&1; then
        tail -n 25 "$PIPLOG" >&2
        die "pip install --no-deps --no-build-isolation -e . failed (it needs setuptools and a C compiler); log: $PIPLOG" 3
    fi
}

corpus() {         # sets DATA: O1B_DATA (a corpus directory, or a tar archive of one), else prepared here
    if [ -n "${O1B_DATA:-}" ] && [ -d "$O1B_DATA" ]; then
        DATA=$O1B_DATA
    elif [ -n "${O1B_DATA:-}" ]; then
        stage "unpacking the corpus $O1B_DATA"
        DATA="$RES/data"
        rm -rf "$DATA"
        mkdir -p "$DATA"
        tar -xf "$O1B_DATA" -C "$DATA" || die "cannot unpack O1B_DATA=$O1B_DATA into $DATA" 3
    else
        stage "preparing the embedded default corpus"
        DATA="$RES/data-default"
        "$PY" -m mlx_open1b.cli.main data prepare --default --out "$DATA" >"$RES/prepare.log" 2>&1 || {
            tail -n 15 "$RES/prepare.log" >&2; die "preparing the default corpus failed; log: $RES/prepare.log" 3; }
    fi
    "$PY" - "$DATA" <<'EOF' || die "$DATA is not a usable prepared corpus (see above)" 3
import sys
from mlx_open1b.data.format import DataError, Manifest
from mlx_open1b.data.stream import manifest_fingerprint
try:
    m = Manifest.load(sys.argv[1])
except (DataError, OSError, ValueError) as e:
    sys.exit(f"corpus {sys.argv[1]}: {e}")
print(f"corpus {sys.argv[1]}: sources {', '.join(s.name for s in m.sources)}, "
      f"fingerprint {manifest_fingerprint(m)[:16]}…")
EOF
}

selftest() {       # selftest BACKEND MODE(full|quick|skip): `open1b selftest --backend BACKEND [--full]`
    if [ "$2" = skip ]; then
        echo "O1B_SELFTEST=skip: stage skipped" | tee "$RES/selftest.txt"
        rc selftest skip
        return 0
    fi
    if ! "$PY" -m mlx_open1b.cli.main selftest --help >"$RES/selftest-help.txt" 2>&1; then
        echo "open1b selftest is not in this version of the package: stage skipped" | tee "$RES/selftest.txt"
        rc selftest skip
        return 0
    fi
    local args
    args=(--backend "$1")
    [ "$2" = full ] && args+=(--full)
    grep -q -- "--data" "$RES/selftest-help.txt" && [ "$2" = full ] && args+=(--data "$DATA")
    grep -q -- "--bundle" "$RES/selftest-help.txt" && args+=(--bundle "$RES/selftest-$1.json")
    echo "selftest ${args[*]}" >"$RES/selftest-args.txt"
    "$PY" -m mlx_open1b.cli.main selftest "${args[@]}" 2>&1 | tee "$RES/selftest.txt"
    rc selftest "${PIPESTATUS[0]}"
}

installed_check() {   # installed_check BACKEND(metal|cuda) EMULATED(0|1): the installed package works, and
                      # the backend runs on its device (not its CPU emulator) unless EMULATED is 1
    "$PY" - "$1" "$2" <<'EOF' || die "the installed package does not work (see above)" 3
import importlib
import sys
import mlx_open1b, mlx_open1b.cpu_ref as c
from mlx_open1b.contract import CONTRACT_VERSION
assert c.contract_version() == CONTRACT_VERSION, (c.contract_version(), CONTRACT_VERSION)
name, emulated = sys.argv[1], sys.argv[2]
ops = importlib.import_module(f"mlx_open1b.{name}.ops")
runtime = importlib.import_module(f"mlx_open1b.{name}.runtime")
ok, why = ops.available()
print(f"open1b {mlx_open1b.__version__}, contract v{CONTRACT_VERSION}, cpu_ref SIMD {c.simd_name()}, {c.get_num_threads()} threads")
print(f"{name} backend: {why}")
assert ok, why
real = runtime.real_metal() if name == "metal" else runtime.real_cuda()
if emulated != "1" and not real:
    raise SystemExit(f"the {name} backend would run on its CPU emulator, not the GPU: {why}")
EOF
    OPEN1B=("$PY" -m mlx_open1b.cli.main)
}

parity_stage() {      # parity_stage BACKEND: every op (or O1B_OPS) on cpu_ref and BACKEND, $CASES cases each
    stage "parity: $1 vs cpu_ref, ${O1B_OPS:-every op}, $CASES cases each"
    "${OPEN1B[@]}" parity run --backends "cpu_ref,$1" --cases "$CASES" ${OPS[@]+"${OPS[@]}"} --json "$RES/parity.json" \
        | tee "$RES/parity.txt"
    rc parity "${PIPESTATUS[0]}"
    [ "$(cat "$RES/rc/parity")" -le 1 ] || die "parity run could not run (exit $(cat "$RES/rc/parity"))" 3
}

ledgers_stage() {     # ledgers_stage BACKEND: the tiny preset, $STEPS steps on cpu_ref and on BACKEND
                      # (parity export of each), then the two bundles compared
    local b rc_export=0
    for b in cpu_ref "$1"; do
        stage "tiny preset, $STEPS steps on $b (parity export: $EXPORT_CASES cases per op + the run's ledger)"
        "${OPEN1B[@]}" parity export "$RES/bundle-$b.json" --backend "$b" --cases "$EXPORT_CASES" --steps "$STEPS" \
            --data "$DATA" ${OPS[@]+"${OPS[@]}"} || rc_export=$?
    done
    rc export "$rc_export"
    [ "$rc_export" = 0 ] || die "parity export failed (exit $rc_export)"
    stage "compare the bundles"
    "${OPEN1B[@]}" parity compare "$RES/bundle-cpu_ref.json" "$RES/bundle-$1.json" | tee "$RES/compare.txt"
    rc compare "${PIPESTATUS[0]}"
}

summary() {        # summary BACKEND: the table of every stage's verdict and timing; its exit status
    _stage_end
    echo
    echo "== [$((SECONDS - T0))s] summary"
    "$PY" scripts/check_summary.py --who "$WHO" --backend "$1" --seconds "$((SECONDS - T0))" "$RES" \
        | tee "$RES/summary.txt"
    return "${PIPESTATUS[0]}"
}
