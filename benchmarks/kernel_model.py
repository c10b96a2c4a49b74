"""A model of the GPU kernels' speed, computed from the kernels as written (no GPU needed).

Every figure this prints is a PREDICTION: it comes from the kernel sources, the SASS nvcc emits for
them and counts taken on the CPU emulators, combined with published peak rates; no GPU ran anything.
scripts/gpu_bench.sh measures the same kernels on a real GPU next to cuBLAS.

(a) SASS (CUDA): each cuda/*.cu is compiled for sm_90 with nvcc (`-cubin --resource-usage`, the
    backend's options) and disassembled with cuobjdump (PyPI: nvidia-cuda-cuobjdump and
    nvidia-cuda-nvdisasm; found on PATH or with --cuda-bin). Per kernel: registers, spill bytes,
    static shared memory, and its innermost loops (a loop is a backward branch; innermost: it
    contains no other backward branch). Along each loop's fast path — from its head to its back
    edge, taking every forward branch whose target is inside the loop (a slow path is branched
    around) and not entering calls — the issued instructions are counted by class: FFMA, FMUL,
    FADD, IMMA/HMMA (with their multiply-adds per thread), loads, all. Multiply-adds on the path:
    FFMA + min(FMUL, FADD) + the MMA instructions' per-thread share; the figure of merit is issued
    instructions per multiply-add.
(b) Counts (both backends): the emulators' opt-in counters (metal/emu/counters.py) give per launch
    the global bytes loaded and stored (issued, and distinct bytes), load/store accesses and the
    fp32 operations. Each hot op is run at small shapes whose sizes are multiples of every tile;
    there each count is a polynomial in the op's dimensions of a known degree (a loop over one
    dimension multiplies by it: degree 1; causal attention's key loop inside the query loop:
    degree 2 in T). The SCALING RULE: each count is interpolated exactly (tensor-product Lagrange,
    rational arithmetic) on a grid of (degree + 1) sizes per dimension, CHECKED at one more shape
    that must come out exactly as predicted, and evaluated at the open1b shape. A microbatch is
    one Model.loss_and_grad: its op calls are recorded at a micro config whose every dimension
    has a distinct size, each size is mapped to the open1b size it stands for (e.g. 40 -> d_model
    = 2048), and the ops' fitted counts are summed; launches and host syncs per op come from the
    same recording (a host sync: a device-to-host read inside an op).
(c) Roofline per kernel: time = max(issue, memory, tensor) with
    issue  = fp32 operations x (issued instructions per fp32 operation on the kernel's hot loop, from
             its SASS) / the issue rate, memory = max(distinct bytes / DRAM bandwidth, issued bytes /
             L2 bandwidth), tensor = MMA multiply-adds / tensor-core rate; per microbatch the kernels'
             times plus a launch cost per launch and a sync cost per host sync. MFU = the
             microbatch's model FLOPs (2 x the multiply-adds of its GEMMs and attention products)
             / time / the bf16 dense peak. Metal has no SASS here: its issue time counts only what
             the emulator sees (fp32 operations + global loads and stores), a lower bound.

    python benchmarks/kernel_model.py                  # working tree, all parts
    python benchmarks/kernel_model.py --rev 3622d88    # the kernels (and launch code) of a revision
    python benchmarks/kernel_model.py --part sass      # only (a); --part counts / --part all
    python benchmarks/kernel_model.py --json out.json  # also write every number
"""
from __future__ import annotations

import argparse
import dataclasses
import fractions
import functools
import itertools
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
LABEL = "PREDICTION"


# ================================================================== hardware figures (assumptions)
@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    issue_rate: float        # thread-instructions per second (all SMs / cores)
    fp32_fma_flops: float    # fp32 FLOP/s with fused multiply-adds (2 per FMA)
    fp32_unfused_flops: float
    bf16_peak: float         # the MFU denominator
    int8_mma_macs: float     # int8 tensor-core multiply-adds per second (0: none usable)
    dram_bw: float           # bytes/s
    l2_bw: float | None      # bytes/s for issued (re-read) traffic; None: not modelled
    launch_s: float          # host cost of one kernel launch
    sync_s: float            # one blocking device-to-host read
    source: str


H100 = Hardware(
    "H100 SXM", issue_rate=33.5e12, fp32_fma_flops=67e12, fp32_unfused_flops=33.5e12, bf16_peak=989e12,
    int8_mma_macs=1979e12 / 2, dram_bw=3.35e12, l2_bw=5.5e12, launch_s=5e-6, sync_s=20e-6,
    source="NVIDIA H100 datasheet (SXM: 67 TFLOP/s fp32 FMA, 989 TFLOP/s bf16 dense, 1,979 TOPS int8 "
           "dense, 3.35 TB/s); issue rate = 132 SMs x 128 lanes x 1.98 GHz (one instruction per lane "
           "per clock); L2 ~5.5 TB/s as measured by Chips and Cheese (2023); 5 us per CuPy launch "
           "and 20 us per blocking read are assumptions")
M3 = Hardware(
    "M3 (10-core GPU)", issue_rate=10 * 128 * 1.38e9, fp32_fma_flops=10 * 128 * 2 * 1.38e9,
    fp32_unfused_flops=10 * 128 * 1.38e9, bf16_peak=10 * 128 * 2 * 1.38e9, int8_mma_macs=0.0,
    dram_bw=100e9, l2_bw=400e9, launch_s=10e-6, sync_s=100e-6,
    source="Apple M3 tech specs (100 GB/s unified memory); fp32 = 10 cores x 128 ALUs x 2 x 1.38 GHz "
           "= 3.53 TFLOP/s (the clock as published for the M3 family's GPU); no bf16 matrix units "
           "used, so the MFU denominator is the fp32 FMA peak; bandwidth for issued (re-read) bytes "
           "400 GB/s, calibrated so that a naive fp32 GEMM (8 bytes loaded per multiply-add) runs at "
           "the ~100 GFLOP/s measured publicly on an M3 (DESIGN.md 11); 10 us per dispatch and "
           "100 us per blocking read are assumptions")

GOALS = {"gemm_instr_per_madd_fused": 1.3, "mfu_bf16": 0.04, "mfu_int8": 0.08, "metal_gemm_frac_fma": 0.40}


# ================================================================== (a) SASS
@dataclasses.dataclass
class Instr:
    addr: int
    pred: str
    op: str          # full opcode with modifiers, e.g. "FMUL.FTZ"
    args: str

    @property
    def base(self) -> str:
        return self.op.split(".")[0]

    def target(self) -> int | None:
        """The branch target of a BRA, else None."""
        if self.base != "BRA":
            return None
        m = re.search(r"0x([0-9a-f]+)", self.args)
        return int(m.group(1), 16) if m else None


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
_FUNCTION = re.compile(r"Function\s*:\s*(\S+)")


def parse_sass(text: str) -> dict[str, list[Instr]]:
    """cuobjdump -sass output -> {kernel: instructions in address order}."""
    out: dict[str, list[Instr]] = {}
    cur = None
    for line in text.splitlines():
        m = _FUNCTION.search(line)
        if m:
            cur = out.setdefault(m.group(1), [])
            continue
        m = _SASS_LINE.search(line)
        if m and cur is not None:
            cur.append(Instr(int(m.group(1), 16), (m.group(2) or "").strip(), m.group(3), m.group(4).strip()))
    return out


_RES_FUNC = re.compile(r"Function properties for (\S+)")
_RES_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_RES_USED = re.compile(r"Used (\d+) registers")
_RES_SMEM = re.compile(r"(\d+) bytes smem")


def parse_resources(text: str) -> dict[str, dict]:
    """nvcc --resource-usage (ptxas -v) output -> {kernel: registers, stack, spill bytes, smem}."""
    out: dict[str, dict] = {}
    cur = None
    for line in text.splitlines():
        m = _RES_FUNC.search(line)
        if m:
            cur = out.setdefault(m.group(1), {"registers": 0, "stack": 0, "spill_stores": 0,
                                              "spill_loads": 0, "smem": 0})
            continue
        if cur is None:
            continue
        m = _RES_STACK.search(line)
        if m:
            cur["stack"], cur["spill_stores"], cur["spill_loads"] = (int(g) for g in m.groups())
        m = _RES_USED.search(line)
        if m:
            cur["registers"] = int(m.group(1))
            sm = _RES_SMEM.search(line)
            cur["smem"] = int(sm.group(1)) if sm else 0
    return out


def _mma_macs(op: str) -> int:
    """Multiply-adds per thread of one tensor-core instruction (0 for anything else)."""
    parts = op.split(".")
    if parts[0] in ("IMMA", "HMMA") and len(parts) > 1:
        m = re.fullmatch(r"(\d{2})(\d)(\d{1,2})", parts[1])      # e.g. 16832 -> m16 n8 k32
        if m:
            return int(m.group(1)) * int(m.group(2)) * int(m.group(3)) // 32
    if parts[0] in ("HGMMA", "IGMMA") and len(parts) > 1:
        m = re.fullmatch(r"(\d+)x(\d+)x(\d+)", parts[1])         # a warpgroup (128 threads)
        if m:
            return int(m.group(1)) * int(m.group(2)) * int(m.group(3)) // 128
    return 0


@dataclasses.dataclass
class LoopStats:
    head: int
    tail: int
    static: int           # instructions between head and back edge
    issued: int           # on the fast path
    ffma: int
    fmul: int
    fadd: int
    mma: int              # tensor-core instructions
    mma_macs: int         # their multiply-adds per thread
    loads: int            # global / shared loads
    calls: int

    @property
    def madds(self) -> int:
        return self.ffma + min(self.fmul, self.fadd) + self.mma_macs

    @property
    def fp_ops(self) -> int:
        return self.ffma + self.fmul + self.fadd

    @property
    def per_madd(self) -> float | None:
        return self.issued / self.madds if self.madds else None

    @property
    def kind(self) -> str:
        if self.mma:
            return "mma"
        if self.ffma and self.ffma >= min(self.fmul, self.fadd):
            return "fused"
        if self.madds:
            return "unfused"
        return "other"


def loops(instrs: list[Instr]) -> list[tuple[int, int]]:
    """(index of head, index of back edge) of each backward branch."""
    at = {ins.addr: i for i, ins in enumerate(instrs)}
    out = []
    for i, ins in enumerate(instrs):
        t = ins.target()
        if t is not None and t <= ins.addr and t in at:
            out.append((at[t], i))
    return out


def innermost(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return [(h, t) for h, t in spans
            if not any((h2, t2) != (h, t) and h <= h2 and t2 <= t for h2, t2 in spans)]


def fast_path(instrs: list[Instr], head: int, tail: int) -> list[Instr]:
    """The instructions issued on one trip around the loop head..tail: forward branches inside the
    loop are taken (slow paths are branched around), calls are not entered."""
    at = {ins.addr: i for i, ins in enumerate(instrs)}
    path, i, guard = [], head, 0
    while head <= i <= tail and guard < 100000:
        ins = instrs[i]
        path.append(ins)
        guard += 1
        if i == tail:
            break
        t = ins.target()
        if t is not None and t > ins.addr and t in at and at[t] <= tail:
            i = at[t]
            continue
        if t is not None and ins.base == "BRA" and not ins.pred and (t not in at or at[t] > tail):
            break                                   # an unconditional exit: the trip ends here
        i += 1
    return path


def loop_stats(instrs: list[Instr], head: int, tail: int) -> LoopStats:
    path = fast_path(instrs, head, tail)
    bases = [ins.base for ins in path]
    mmas = [ins for ins in path if _mma_macs(ins.op)]
    return LoopStats(
        instrs[head].addr, instrs[tail].addr, tail - head + 1, len(path),
        bases.count("FFMA"), bases.count("FMUL"), bases.count("FADD"), len(mmas),
        sum(_mma_macs(ins.op) for ins in mmas),
        sum(b in ("LDG", "LDS", "LD", "LDSM", "LDGSTS") for b in bases), bases.count("CALL"))


def hot_loops(instrs: list[Instr]) -> list[LoopStats]:
    """The innermost loops that do arithmetic, most multiply-adds (then fp32 ops) first."""
    stats = [loop_stats(instrs, h, t) for h, t in innermost(loops(instrs))]
    stats = [s for s in stats if s.madds or s.fp_ops]
    return sorted(stats, key=lambda s: (-s.madds, -s.fp_ops, s.head))


def find_tool(name: str, extra: str | None) -> str | None:
    for d in ([extra] if extra else []) + os.environ.get("PATH", "").split(os.pathsep):
        p = pathlib.Path(d) / name
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    return None


def sass_report(cuda_dir: pathlib.Path, cuda_bin: str | None, defines: dict | None = None) -> dict:
    """{file: {kernel: {resources..., loops: [LoopStats...]}}} or {"skipped": why}. defines: {file:
    ((name, value), ...)} written before that file's source, as the backend's runtime.load does
    (attention.cu is built per head dim: ATTN_D)."""
    nvcc = find_tool("nvcc", cuda_bin)
    cuobjdump = find_tool("cuobjdump", cuda_bin)
    if not nvcc or not cuobjdump:
        return {"skipped": "nvcc or cuobjdump not found (pip install nvidia-cuda-cuobjdump "
                           "nvidia-cuda-nvdisasm; --cuda-bin DIR)"}
    from mlx_open1b.cuda import runtime
    env = dict(os.environ, PATH=os.pathsep.join([str(pathlib.Path(cuobjdump).parent), os.environ.get("PATH", "")]))
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="o1b-sass-") as tmp:
        for cu in sorted(cuda_dir.glob("*.cu")):
            src = pathlib.Path(tmp) / cu.name
            src.write_text("".join(f"#define {n} {v}\n" for n, v in (defines or {}).get(cu.name, ()))
                           + runtime.read_source(cu.name, cuda_dir))
            cubin = src.with_suffix(".cubin")
            # the backend's NVRTC options, and CuPy's -ftz=true
            proc = subprocess.run([nvcc, *runtime.OPTIONS, "-ftz=true", "-arch=sm_90", "-cubin",
                                   "--resource-usage", "-o", str(cubin), str(src)],
                                  capture_output=True, text=True, env=env)
            if proc.returncode:
                out[cu.name] = {"error": proc.stderr.strip()[-2000:]}
                continue
            res = parse_resources(proc.stdout + proc.stderr)
            dis = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, env=env)
            if dis.returncode:
                out[cu.name] = {"error": dis.stderr.strip()[-2000:]}
                continue
            kernels = parse_sass(dis.stdout)
            out[cu.name] = {k: dict(res.get(k, {}), loops=hot_loops(v), instructions=len(v))
                            for k, v in kernels.items() if not k.startswith("_Z")}
    return out


def issue_factor(sass: dict, kernel: str) -> tuple[float | None, str]:
    """Issued instructions per fp32 operation (an FFMA counted once) on the kernel's hottest loop,
    and which loop: the fused one where there is one (tiles whose operands allow it are assumed
    to be the common case), else the first."""
    for f in sass.values():
        if isinstance(f, dict) and kernel in f:
            ls = f[kernel]["loops"]
            if not ls:
                return None, "no arithmetic loop"
            pick = next((s for s in ls if s.kind == "fused"), ls[0])
            ops = pick.fp_ops
            return (pick.issued / ops if ops else None), f"{pick.kind} loop @0x{pick.head:x}"
    return None, "not compiled"


# ================================================================== (b) counts on the emulators
def _prod(xs):
    p = 1
    for x in xs:
        p *= x
    return p


def interpolate(grid: dict[str, list[int]], values: dict[tuple, int], at: dict[str, int]) -> fractions.Fraction:
    """Tensor-product Lagrange interpolation: the polynomial of degree len(grid[d]) - 1 in each
    dimension d through `values` (keyed by the grid points in the order of `grid`), at `at`."""
    dims = list(grid)
    total = fractions.Fraction(0)
    for point in itertools.product(*(range(len(grid[d])) for d in dims)):
        w = fractions.Fraction(1)
        for d, k in zip(dims, point):
            xs = grid[d]
            for m, xm in enumerate(xs):
                if m != k:
                    w *= fractions.Fraction(at[d] - xm, xs[k] - xm)
        total += w * values[tuple(grid[d][k] for d, k in zip(dims, point))]
    return total


QUANTITIES = ("launches", "groups", "threads", "read", "written", "read_unique", "written_unique", "loads", "stores",
              "add", "sub", "mul", "div", "sqrt", "fma")
# Counts that depend on the data, not only on the shapes: distinct bytes of a gather (which rows the
# tokens pick) and fp32 operations (the contract's data-dependent paths: exp's special cases, an
# online softmax rescaling when a new maximum appears). Their check allows DATA_TOLERANCE.
DATA_DEPENDENT = ("read_unique", "written_unique", "add", "sub", "mul", "div", "sqrt", "fma")
DATA_TOLERANCE = 0.05


def summarize(launches) -> dict[str, dict[str, int]]:
    """Per kernel name: the sums of every quantity over its launches."""
    out: dict[str, dict[str, int]] = {}
    for ln in launches:
        s = out.setdefault(ln.kernel, dict.fromkeys(QUANTITIES, 0))
        s["launches"] += 1
        s["groups"] += ln.groups
        s["threads"] += _prod(ln.grid) * (_prod(ln.block) if ln.backend == "cuda" else 1)
        s["read"] += sum(ln.read)
        s["written"] += sum(ln.written)
        s["read_unique"] += sum(ln.read_unique)
        s["written_unique"] += sum(ln.written_unique)
        s["loads"] += ln.loads
        s["stores"] += ln.stores
        for k, v in ln.ops.items():
            s[k] += v
    return out


# ---------------------------------------------------------------- the hot ops and their shapes
def _bf16(rng, *shape):
    """bf16 bits of values in [1, 2) x random sign: no product is tiny or overflows."""
    return (rng.integers(0x3F80, 0x4000, shape) | (rng.integers(0, 2, shape) << 15)).astype("uint16")


def _periodic(rows: int, cols: int):
    """bf16 bits that repeat every 128 columns (one Hadamard block) and are the same in every row:
    the quantizers' scales and rounding paths are then the same at every size (random operands
    make their data-dependent operation counts noisy, and the extrapolation multiplies the noise)."""
    import numpy as np
    row = _bf16(np.random.default_rng(5), 128)
    return np.ascontiguousarray(np.tile(row, (rows, -(-cols // 128)))[:, :cols])


def _f32(rng, *shape):
    import numpy as np
    return rng.uniform(-1.0, 1.0, shape).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Workload:
    """An op run at sizes given by `dims`. `grid`: the sizes each dimension is sampled at for the
    interpolation (degree = len - 1); `check`: one more point that must come out as predicted;
    `fixed`: sizes held at their open1b value (tile constants: head dim); `args(ops, rng, dims)`
    builds the call; `macs(dims)`: the op's multiply-adds of its GEMMs/attention products (the MFU
    numerator's share, and the work of a kernel whose arithmetic the emulator cannot count)."""
    op: str
    grid: dict
    check: dict
    args: object
    macs: object
    fixed: dict = dataclasses.field(default_factory=dict)


def _pairs(T: int, W: int) -> int:
    """Visible (query, key) pairs of one head: causal, and i - j < W when W > 0."""
    if W <= 0 or W >= T:
        return T * (T + 1) // 2
    return W * (W + 1) // 2 + (T - W) * W


def _attn_args(i8=False, backward=False):
    def build(ops, rng, d):
        import numpy as np
        B, T, W, H, G, D = d["B"], d["T"], d["W"], d["H"], d["G"], d["D"]
        # every position the same row: all scores of a query equal, so the online softmax and the
        # int8 P.V take the same path at every length (random rows make the data-dependent
        # operation counts noisy, and the extrapolation to T = 4096 multiplies the noise)
        q, k, v = (np.ascontiguousarray(np.broadcast_to(_bf16(rng, 1, 1, R, D), (B, T, R, D)))
                   for R in (H, G, G))
        scale = 1.0 / math.sqrt(D)
        if not backward:
            return (q, k, v, W, scale)
        o, lse = ops.attention_forward(q, k, v, W, scale)
        return (_f32(rng, B, T, H, D), q, k, v, np.asarray(ops.to_host(o)), np.asarray(ops.to_host(lse)), W, scale)
    return build


@functools.lru_cache(maxsize=None)
def workloads() -> dict[str, list[Workload]]:
    """op name -> its workloads (attention: one for global and one for windowed layers). Token ids
    are 0, 1, 2, ...: which rows a gather touches is then a function of the shape."""
    import numpy as np
    lin = dict(grid={"N": [128, 256], "M": [128, 256], "K": [128, 256]}, check={"N": 384, "M": 128, "K": 256})
    gemm_fwd = lambda d: d["N"] * d["M"] * d["K"]
    gemm_bwd = lambda d: 2 * d["N"] * d["M"] * d["K"]
    att_g = dict(grid={"B": [1, 2], "T": [128, 256, 384]}, check={"B": 1, "T": 512},
                 fixed={"W": 0, "H": 4, "G": 1, "D": 128})
    att_w = dict(grid={"T": [384, 512], "W": [64, 128, 192]}, check={"T": 640, "W": 128},
                 fixed={"B": 1, "H": 4, "G": 1, "D": 128})
    att_macs = lambda d: 2 * d["B"] * d["H"] * _pairs(d["T"], d["W"]) * d["D"]
    rows = dict(grid={"R": [128, 256], "C": [128, 256]}, check={"R": 384, "C": 128})
    flat = dict(grid={"n": [4096, 8192]}, check={"n": 12288})
    xent = dict(grid={"N": [128, 256], "V": [1024, 2048], "C": [64, 128]}, check={"N": 384, "V": 1024, "C": 128})
    out = {
        "linear_forward": [Workload("linear_forward", **lin, macs=gemm_fwd,
                                    args=lambda ops, rng, d: (_bf16(rng, d["N"], d["K"]), _bf16(rng, d["M"], d["K"])))],
        "linear_backward": [Workload("linear_backward", **lin, macs=gemm_bwd,
                                     args=lambda ops, rng, d: (_bf16(rng, d["N"], d["M"]), _bf16(rng, d["N"], d["K"]),
                                                               _bf16(rng, d["M"], d["K"])))],
        "qlinear_forward": [Workload("qlinear_forward", **lin, macs=gemm_fwd,
                                     args=lambda ops, rng, d: (_periodic(d["N"], d["K"]), _periodic(d["M"], d["K"])))],
        "qlinear_backward": [Workload("qlinear_backward", **lin, macs=gemm_bwd,
                                      args=lambda ops, rng, d: (_periodic(d["N"], d["M"]), _periodic(d["N"], d["K"]),
                                                                _periodic(d["M"], d["K"])))],
        "xent_forward": [Workload("xent_forward", **xent, macs=lambda d: d["N"] * d["V"] * d["C"],
                                  args=lambda ops, rng, d: (*_xent_hw(d), rng.integers(0, d["V"], d["N"]).astype("int32"),
                                                            1e-4))],
        "xent_backward": [Workload("xent_backward", **xent, macs=lambda d: 2 * d["N"] * d["V"] * d["C"],
                                   args=_xent_backward_args)],
        "rmsnorm_forward": [Workload("rmsnorm_forward", **rows, macs=lambda d: 0,
                                     args=lambda ops, rng, d: (_f32(rng, d["R"], d["C"]), _bf16(rng, d["C"]), 1e-6))],
        "rmsnorm_backward": [Workload("rmsnorm_backward", **rows, macs=lambda d: 0, args=_rmsnorm_backward_args)],
        "rope_forward": [Workload("rope_forward", grid={"R": [64, 128]}, check={"R": 192}, fixed={"D": 128},
                                  macs=lambda d: 0, args=_rope_args)],
        "rope_backward": [Workload("rope_backward", grid={"R": [64, 128]}, check={"R": 192}, fixed={"D": 128},
                                   macs=lambda d: 0, args=_rope_args)],
        "swiglu_forward": [Workload("swiglu_forward", grid={"N": [64, 128], "F": [64, 128]}, check={"N": 192, "F": 64},
                                    macs=lambda d: 0, args=lambda ops, rng, d: (_f32(rng, d["N"], 2 * d["F"]),))],
        "swiglu_backward": [Workload("swiglu_backward", grid={"N": [64, 128], "F": [64, 128]}, check={"N": 192, "F": 64},
                                     macs=lambda d: 0,
                                     args=lambda ops, rng, d: (_f32(rng, d["N"], d["F"]), _f32(rng, d["N"], 2 * d["F"])))],
        "f32_to_bf16": [Workload("f32_to_bf16", **flat, macs=lambda d: 0, args=lambda ops, rng, d: (_f32(rng, d["n"]),))],
        "add": [Workload("add", **flat, macs=lambda d: 0, args=lambda ops, rng, d: (_f32(rng, d["n"]), _f32(rng, d["n"])))],
        "add_inplace": [Workload("add_inplace", **flat, macs=lambda d: 0,
                                 args=lambda ops, rng, d: (_f32(rng, d["n"]), _f32(rng, d["n"])))],
        "embedding_forward": [Workload("embedding_forward", grid={"N": [64, 128], "C": [64, 128]},
                                       check={"N": 192, "C": 64}, fixed={"V": 512}, macs=lambda d: 0,
                                       args=lambda ops, rng, d: ((np.arange(d["N"]) % d["V"]).astype("int32"),
                                                                 _bf16(rng, d["V"], d["C"])))],
        "embedding_backward": [Workload("embedding_backward", grid={"N": [64, 128], "C": [64, 128], "V": [256, 512]},
                                        check={"N": 192, "C": 64, "V": 256}, macs=lambda d: 0,
                                        args=lambda ops, rng, d: ((np.arange(d["N"]) % d["V"]).astype("int32"),
                                                                  _f32(rng, d["N"], d["C"]), d["V"]))],
    }
    for op, build in (("attention_forward", _attn_args()), ("attention_forward_i8", _attn_args(i8=True)),
                      ("attention_backward", _attn_args(backward=True))):
        mult = 2 if op == "attention_backward" else 1
        out[op] = [Workload(op, **att_g, args=build, macs=lambda d, m=mult: m * att_macs(d)),
                   Workload(op, **att_w, args=build, macs=lambda d, m=mult: m * att_macs(d))]
    return out


def _xent_hw(d):
    """h and w with every logit equal: the online logsumexp takes the same path at every size (with
    random logits, how often a new maximum rescales the sum is data, not shape, and the tiny
    differences are multiplied by the extrapolation to the open1b vocabulary)."""
    import numpy as np
    return np.full((d["N"], d["C"]), 0x3F80, np.uint16), np.full((d["V"], d["C"]), 0x3C00, np.uint16)


def _xent_backward_args(ops, rng, d):
    import numpy as np
    h, w = _xent_hw(d)
    t = rng.integers(0, d["V"], d["N"]).astype(np.int32)
    _, lse, _ = ops.xent_forward(h, w, t, 1e-4)
    return (h, w, t, 1e-4, np.asarray(ops.to_host(lse)), np.full(d["N"], 1.0 / d["N"], np.float32))


def _rmsnorm_backward_args(ops, rng, d):
    import numpy as np
    x, g = _f32(rng, d["R"], d["C"]), _bf16(rng, d["C"])
    _, rstd = ops.rmsnorm_forward(x, g, 1e-6)
    return (_f32(rng, d["R"], d["C"]), x, g, np.asarray(ops.to_host(rstd)))


def _rope_args(ops, rng, d):
    import numpy as np
    cos, sin = ops.rope_tables(d["R"], d["D"], 500000.0)
    return (_f32(rng, 1, d["R"], 1, d["D"]), np.asarray(ops.to_host(cos)), np.asarray(ops.to_host(sin)))


def workload_for(op: str, dims: dict) -> Workload | None:
    """The workload of op whose fixed sizes match `dims` (attention: global or windowed)."""
    ws = workloads().get(op, [])
    if op.startswith("attention"):
        return ws[0] if dims.get("W", 0) == 0 or dims["W"] >= dims["T"] else ws[1]
    return ws[0] if ws else None


def measure(ops, w: Workload, dims: dict, seed: int = 0) -> dict[str, dict[str, int]]:
    """Per kernel: the summed counts of one call of w.op at dims (the input preparation uncounted)."""
    import numpy as np
    from mlx_open1b.metal.emu import counters
    full = dict(w.fixed, **dims)
    args = w.args(ops, np.random.default_rng(seed), full)
    with counters.counting() as log:
        getattr(ops, w.op)(*args)
    return summarize(log.launches)


@dataclasses.dataclass
class Fit:
    op: str
    grid: dict
    fixed: dict
    values: dict          # grid point -> per-kernel counts
    check_point: dict
    check_measured: dict
    check_ok: bool
    check_diff: list

    def predict(self, dims: dict) -> dict[str, dict[str, float]]:
        kernels = sorted({k for v in self.values.values() for k in v})
        at = {d: dims[d] for d in self.grid}
        out = {}
        for k in kernels:
            out[k] = {q: float(interpolate(self.grid, {p: v.get(k, {}).get(q, 0) for p, v in self.values.items()}, at))
                      for q in QUANTITIES}
        return out


def fit(ops, w: Workload, log=print) -> Fit:
    values = {}
    for point in itertools.product(*w.grid.values()):
        dims = dict(zip(w.grid, point))
        values[point] = measure(ops, w, dims)
    f = Fit(w.op, w.grid, w.fixed, values, w.check, {}, False, [])
    measured = measure(ops, w, w.check)
    predicted = f.predict(w.check)
    diff, worst = check_counts(measured, predicted)
    f.check_measured, f.check_ok, f.check_diff = measured, not diff, diff
    log(f"  fit {w.op} {dict(w.fixed)} over {w.grid}: check at {w.check}: "
        + (f"structure exact, data-dependent counts within {100 * worst:.3f}%" if not diff
           else f"MISSED ({len(diff)}: {'; '.join(diff[:3])})"))
    return f


def check_counts(measured: dict, predicted: dict) -> tuple[list[str], float]:
    """The differences between a measured and a predicted count that break the scaling rule (any
    difference in a structural count, above DATA_TOLERANCE in a data-dependent one), and the
    largest relative difference of the data-dependent ones."""
    diff, worst = [], 0.0
    for k in sorted(set(measured) | set(predicted)):
        for q in QUANTITIES:
            a, b = measured.get(k, {}).get(q, 0), predicted.get(k, {}).get(q, 0.0)
            if q in DATA_DEPENDENT:
                rel = abs(a - b) / max(abs(a), 1)
                worst = max(worst, rel)
                if rel > DATA_TOLERANCE:
                    diff.append(f"{k}.{q}: measured {a}, predicted {b:g}")
            elif a != b:
                diff.append(f"{k}.{q}: measured {a}, predicted {b:g}")
    return diff, worst


# ---------------------------------------------------------------- one microbatch, recorded
# A micro model whose every size below is distinct, so a size seen in an op call names the size
# of the model it stands for (n_layers 2, global_every 5: layer 0 windowed, layer 1 global).
MICRO = dict(vocab_size=64, d_model=24, n_layers=2, n_heads=6, n_kv_heads=3, head_dim=10, ffn_hidden=18,
             seq_len=16, window=4, global_every=5)
MICRO_SEQS = 2


def size_table(cfg, seqs: int) -> dict[str, int]:
    B, T, d, H, G, D, F = seqs, cfg.seq_len, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_hidden
    N = B * T
    return {"B": B, "T": T, "N": N, "d": d, "H": H, "G": G, "D": D, "HD": H * D, "GD": G * D,
            "QKV": (H + 2 * G) * D, "F": F, "2F": 2 * F, "V": cfg.vocab_size, "W": cfg.window,
            "NH": N * H, "NG": N * G}


def size_map(micro: dict[str, int], big: dict[str, int]) -> dict[int, int]:
    by_value = {}
    for k, v in micro.items():
        if v in by_value:
            raise ValueError(f"micro sizes {by_value[v]} and {k} are both {v}: a size must name one dimension")
        by_value[v] = k
    return {v: big[k] for v, k in by_value.items()} | {0: 0}


def call_dims(op: str, args: tuple, kwargs: dict) -> dict | None:
    """The dimensions of a hot op's call (None for any other op)."""
    sh = [getattr(a, "shape", None) for a in args]
    if op in ("linear_forward", "qlinear_forward"):
        return {"N": sh[0][0], "K": sh[0][1], "M": sh[1][0]}
    if op in ("linear_backward", "qlinear_backward"):
        return {"N": sh[0][0], "M": sh[0][1], "K": sh[1][1]}
    if op in ("attention_forward", "attention_forward_i8"):
        (B, T, H, D), G = sh[0], sh[1][2]
        return {"B": B, "T": T, "H": H, "G": G, "D": D, "W": int(args[3])}
    if op == "attention_backward":
        (B, T, H, D), G = sh[1], sh[2][2]
        return {"B": B, "T": T, "H": H, "G": G, "D": D, "W": int(args[6])}
    if op in ("xent_forward", "xent_backward"):
        return {"N": sh[0][0], "C": sh[0][1], "V": sh[1][0]}
    if op == "rmsnorm_forward":
        return {"R": sh[0][0], "C": sh[0][1]}
    if op == "rmsnorm_backward":
        return {"R": sh[1][0], "C": sh[1][1]}
    if op in ("rope_forward", "rope_backward"):
        B, T, R, D = sh[0]
        return {"R": B * T * R, "D": D}
    if op == "swiglu_forward":
        return {"N": sh[0][0], "F": sh[0][1] // 2}
    if op == "swiglu_backward":
        return {"N": sh[0][0], "F": sh[0][1]}
    if op in ("f32_to_bf16", "add", "add_inplace"):
        return {"n": int(_prod(sh[0]))}
    if op == "embedding_forward":
        return {"N": sh[0][0], "C": sh[1][1], "V": sh[1][0]}
    if op == "embedding_backward":
        return {"N": sh[0][0], "C": sh[1][1], "V": int(args[2])}
    return None


def map_dims(dims: dict, m: dict[int, int], micro: dict[str, int], big: dict[str, int]) -> dict:
    out = {}
    for k, v in dims.items():
        if k == "n":          # a flat size: rows x width
            rows = next((r for r in ("NH", "NG", "N") if v % micro[r] == 0 and v // micro[r] in m), None)
            if rows is None:
                raise ValueError(f"flat size {v} is not rows x a known width")
            out[k] = big[rows] * m[v // micro[rows]]
        elif v in m:
            out[k] = m[v]
        else:
            raise ValueError(f"size {k}={v} of an op call names no model dimension")
    return out


@dataclasses.dataclass
class Call:
    op: str
    dims: dict | None
    launches: list         # the counters.Launch of its kernels
    syncs: list            # where the host read a device result
    layer: int | None = None   # the transformer block that made the call (None: outside the blocks)


def _layer_of_caller() -> int | None:
    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_name in ("_block_forward", "_block_backward") and "l" in f.f_locals:
            return int(f.f_locals["l"])
        f = f.f_back
    return None


def record_microbatch(ops, precision: str) -> tuple[list[Call], list[str]]:
    """Run Model.loss_and_grad of the micro model on `ops` (an emulated backend) with the counters
    on; -> the top-level op calls in order, and the host reads made by the model itself."""
    import numpy as np
    from mlx_open1b import arrays
    from mlx_open1b.config import ModelConfig
    from mlx_open1b.metal.emu import counters
    from mlx_open1b.model import Model, init_params
    cfg = ModelConfig(**MICRO)
    calls: list[Call] = []
    model_reads: list[str] = []
    current: list[Call] = []
    real_to_host = arrays.to_host

    def to_host(a):
        f = sys._getframe(1)
        if f.f_code.co_name not in ("_host", "_write_back"):   # numpy mode returning or writing back an op's result: not a sync
            where = f"{pathlib.Path(f.f_code.co_filename).name}:{f.f_code.co_name}"
            (current[-1].syncs if current else model_reads).append(where)
        return real_to_host(a)

    class Recorder:
        def __getattr__(self, name):
            fn = getattr(ops, name)
            if not callable(fn):
                return fn

            def call(*args, **kwargs):
                if current:                         # an op called by an op: part of the outer call
                    return fn(*args, **kwargs)
                if kwargs.get("bf16_out"):          # a fused bf16 output: the op and its conversion, as fitted
                    out = call(*args, **dict(kwargs, bf16_out=False))
                    to_bf16 = self.f32_to_bf16
                    return (to_bf16(out[0]), *out[1:]) if isinstance(out, tuple) else to_bf16(out)
                c = Call(name, call_dims(name, args, kwargs), [], [], _layer_of_caller())
                current.append(c)
                n0 = len(log.launches)
                try:
                    out = fn(*args, **kwargs)
                finally:
                    current.pop()
                c.launches = log.launches[n0:]
                if isinstance(out, float):
                    c.syncs.append(f"{name} returns a host float")
                calls.append(c)
                return out
            return call

    params = init_params(cfg, 1, ops=ops)
    windows = np.random.default_rng(0).integers(0, cfg.vocab_size, (MICRO_SEQS, cfg.seq_len + 1)).astype(np.uint32)
    arrays.to_host = to_host
    try:
        with counters.counting() as log:
            Model(cfg, ops=Recorder(), precision=precision).loss_and_grad(params, windows)
    finally:
        arrays.to_host = real_to_host
    return calls, model_reads


# ---------------------------------------------------------------- the microbatch at open1b
@dataclasses.dataclass
class KernelTotal:
    counts: dict                 # QUANTITIES summed over the microbatch
    macs: float = 0.0            # GEMM multiply-adds of its ops (int8 GEMMs: the emulator cannot count them)
    ops: set = dataclasses.field(default_factory=set)


def fit_all(ops, names=None, log=print, cache: pathlib.Path | None = None) -> dict[tuple[str, int], Fit]:
    """The fits of the named ops; with `cache` (a JSON file for one backend and one set of kernel
    sources) fits found there are reused and new ones are added to it."""
    stored = json.loads(cache.read_text()) if cache is not None and cache.is_file() else {}
    out = {}
    for op, ws in workloads().items():
        if names is not None and op not in names:
            continue
        for i, w in enumerate(ws):
            key = f"{op}[{i}]"
            if key in stored:
                d = stored[key]
                out[(op, i)] = Fit(op, w.grid, w.fixed, {tuple(json.loads(p)): v for p, v in d["values"].items()},
                                   w.check, d["check_measured"], d["check_ok"], d["check_diff"])
                log(f"  fit {op} {dict(w.fixed)}: from {cache.name} (check " +
                    ("passed" if d["check_ok"] else f"MISSED: {'; '.join(d['check_diff'][:3])}") + ")")
                continue
            f = out[(op, i)] = fit(ops, w, log)
            if cache is not None:
                stored[key] = {"values": {json.dumps(list(p)): v for p, v in f.values.items()},
                               "check_measured": f.check_measured, "check_ok": f.check_ok, "check_diff": f.check_diff}
                from mlx_open1b.fsutil import write_bytes_atomic
                write_bytes_atomic(cache, json.dumps(stored).encode())
    return out


def _predict_call(fits, op: str, dims: dict) -> tuple[dict, str | None]:
    ws = workloads().get(op)
    w = workload_for(op, dims)
    if w is None:
        return {}, None
    i = ws.index(w)
    f = fits.get((op, i))
    if f is None:
        return {}, f"{op}: not fitted"
    note = None
    if op.startswith("attention"):
        # every (window, kv head) pair runs its H/G query heads alike: counts linear in B x G at the
        # fit's H/G (checked by the fit in B at G = 1)
        if dims["H"] * w.fixed["G"] != w.fixed["H"] * dims["G"] or dims["D"] != w.fixed["D"]:
            note = f"{op}: H/G or D differ from the fit's ({dims} vs {w.fixed})"
        groups = dims["B"] * dims["G"]
        if "B" in w.grid:
            return f.predict({"B": groups, "T": dims["T"]}), note
        pred = f.predict({"T": dims["T"], "W": dims["W"]})
        return {k: {q: v * groups for q, v in c.items()} for k, c in pred.items()}, note
    for k, v in w.fixed.items():
        if k in dims and dims[k] != v and k != "V":
            note = f"{op}: {k}={dims[k]} but the fit holds {k}={v}"
    return f.predict(dims), note


def microbatch(calls: list[Call], fits, big_cfg, seqs: int) -> tuple[dict[str, KernelTotal], dict]:
    from mlx_open1b.config import ModelConfig
    micro_sizes = size_table(ModelConfig(**MICRO), MICRO_SEQS)
    big_sizes = size_table(big_cfg, seqs)
    m = size_map(micro_sizes, big_sizes)
    kernels: dict[str, KernelTotal] = {}
    notes, launches, syncs, macs = [], 0, 0, 0.0
    micro_cfg = ModelConfig(**MICRO)
    for c in calls:
        # a block's calls stand for every block of the big model of the same kind (windowed or
        # global); MICRO has one of each
        n = 1 if c.layer is None else sum(big_cfg.is_global(l) == micro_cfg.is_global(c.layer)
                                          for l in range(big_cfg.n_layers))
        syncs += n * len(c.syncs)
        pred = None
        if c.dims is not None:
            dims = map_dims(c.dims, m, micro_sizes, big_sizes)
            pred, note = _predict_call(fits, c.op, dims)
            if note:
                notes.append(note)
            w = workload_for(c.op, dims)
            call_macs = w.macs(dict(w.fixed, **dims)) if w else 0
            macs += n * call_macs
        if not pred:              # an op without a fit: its counts as recorded at the micro size
            pred = summarize(c.launches)
            call_macs = 0
        gemms = [k for k in pred if "gemm" in k]
        for k, q in pred.items():
            t = kernels.setdefault(k, KernelTotal(dict.fromkeys(QUANTITIES, 0.0)))
            for name, v in q.items():
                t.counts[name] += n * v
            t.ops.add(c.op)
            if k in gemms:          # the op's GEMM work, shared by its GEMM kernels
                t.macs += n * call_macs / len(gemms)
        launches += n * sum(q["launches"] for q in pred.values())
    where = sorted({w for c in calls for w in c.syncs})
    return kernels, {"launches": launches, "syncs": syncs, "model_macs": macs, "notes": sorted(set(notes)),
                     "micro": {"calls": len(calls), "launches": sum(len(c.launches) for c in calls),
                               "syncs": syncs, "sync_sites": where}}


# ================================================================== (c) roofline
def kernel_time(backend: str, name: str, t: KernelTotal, hw: Hardware, sass: dict) -> dict:
    c = t.counts
    fp_ops = c["add"] + c["sub"] + c["mul"] + c["div"] + c["sqrt"] + c["fma"]
    flops = fp_ops + c["fma"]
    tensor = 0.0
    how = ""
    if backend == "cuda":
        loop = None
        for f in sass.values():
            if isinstance(f, dict) and name in f and f[name]["loops"]:
                loop = f[name]["loops"]
                break
        mma = next((s for s in loop or [] if s.kind == "mma"), None)
        factor, how = issue_factor(sass, name)
        if mma is not None and t.macs:
            issued = t.macs * mma.issued / mma.mma_macs
            tensor = t.macs / hw.int8_mma_macs
            how = f"mma loop @0x{mma.head:x}: {mma.issued / mma.mma_macs:.3f} instr/MAC"
        elif factor is not None and fp_ops:
            issued = fp_ops * factor
            how += f": {factor:.2f} instr/fp32 op"
        else:
            static = next((f[name]["instructions"] for f in sass.values() if isinstance(f, dict) and name in f), 0)
            issued = c["threads"] * static
            how = f"no arithmetic loop: {static} instructions x threads"
    else:
        int_macs = t.macs if "gemm_i8" in name else 0.0
        issued = fp_ops + c["loads"] + c["stores"] + int_macs
        how = "fp32 ops + global loads/stores" + (" + int MACs" if int_macs else "") + " (lower bound)"
    t_issue = issued / hw.issue_rate
    t_mem = max((c["read_unique"] + c["written_unique"]) / hw.dram_bw,
                (c["read"] + c["written"]) / hw.l2_bw if hw.l2_bw else 0.0)
    total = max(t_issue, t_mem, tensor)
    bound = "issue" if total == t_issue else ("memory" if total == t_mem else "tensor")
    return {"kernel": name, "ops": sorted(t.ops), "launches": c["launches"], "fp32_flops": flops,
            "macs": t.macs, "bytes_issued": c["read"] + c["written"],
            "bytes_unique": c["read_unique"] + c["written_unique"], "issued_instr": issued,
            "t_issue": t_issue, "t_mem": t_mem, "t_tensor": tensor, "t": total, "bound": bound, "how": how}


def roofline(backend: str, kernels: dict[str, KernelTotal], summary: dict, hw: Hardware, sass: dict) -> dict:
    rows = sorted((kernel_time(backend, k, t, hw, sass) for k, t in kernels.items()), key=lambda r: -r["t"])
    t_kernels = sum(r["t"] for r in rows)
    t_total = t_kernels + summary["launches"] * hw.launch_s + summary["syncs"] * hw.sync_s
    mfu = 2 * summary["model_macs"] / t_total / hw.bf16_peak if t_total else 0.0
    return {"hardware": hw.name, "rows": rows, "t_kernels": t_kernels, "t_total": t_total, "mfu": mfu,
            "launches": summary["launches"], "syncs": summary["syncs"], "model_flops": 2 * summary["model_macs"]}


# ================================================================== the first-contact benchmark's shapes
# What benchmarks/gpu_bench.py times on a real GPU, at open1b width with one sequence of 4096 tokens
# per op; the model predicts each (below) so the bench can print prediction and measurement side by
# side. BENCH_MODEL: the bench's whole-model run, open1b widths with 2 layers (one windowed, one
# global) on one sequence; MICRO records it (MICRO's 2 layers are the same two kinds).
_ATT = {"B": 1, "T": 4096, "H": 16, "G": 4, "D": 128}
BENCH = [
    ("qkv fwd", "linear_forward", {"N": 4096, "K": 2048, "M": 3072}),
    ("down fwd", "linear_forward", {"N": 4096, "K": 5632, "M": 2048}),
    ("qkv bwd", "linear_backward", {"N": 4096, "M": 3072, "K": 2048}),
    ("qkv fwd int8", "qlinear_forward", {"N": 4096, "K": 2048, "M": 3072}),
    ("qkv bwd int8", "qlinear_backward", {"N": 4096, "M": 3072, "K": 2048}),
    ("attn fwd global", "attention_forward", dict(_ATT, W=0)),
    ("attn fwd local", "attention_forward", dict(_ATT, W=512)),
    ("attn fwd int8 global", "attention_forward_i8", dict(_ATT, W=0)),
    ("attn bwd global", "attention_backward", dict(_ATT, W=0)),
    ("attn bwd local", "attention_backward", dict(_ATT, W=512)),
    ("lm head fwd", "xent_forward", {"N": 4096, "V": 128256, "C": 2048}),
    ("lm head bwd", "xent_backward", {"N": 4096, "V": 128256, "C": 2048}),
    ("rmsnorm fwd", "rmsnorm_forward", {"R": 4096, "C": 2048}),
    ("rmsnorm bwd", "rmsnorm_backward", {"R": 4096, "C": 2048}),
    ("swiglu fwd", "swiglu_forward", {"N": 4096, "F": 5632}),
    ("swiglu bwd", "swiglu_backward", {"N": 4096, "F": 5632}),
    ("rope fwd", "rope_forward", {"R": 4096 * 16, "D": 128}),
    ("add", "add", {"n": 4096 * 2048}),
    ("f32_to_bf16", "f32_to_bf16", {"n": 4096 * 2048}),
]


def bench_model_config():
    from mlx_open1b.config import preset
    return dataclasses.replace(preset("open1b").model, n_layers=2)


def bench_predictions(name: str, fits, sass: dict, hw: Hardware, microbatches: dict) -> dict:
    """label -> predicted seconds and model FLOPs of each BENCH op (its kernels' roofline times plus
    a launch cost per launch), and of the bench model's microbatch per precision."""
    out = {}
    for label, op, dims in BENCH:
        w = workload_for(op, dims)
        if w is None or (op, workloads()[op].index(w)) not in fits:
            continue
        pred, _ = _predict_call(fits, op, dims)
        macs = w.macs(dict(w.fixed, **dims))
        kt = {k: KernelTotal(dict(q), macs / max(1, sum("gemm" in x for x in pred)) if "gemm" in k else 0.0, {op})
              for k, q in pred.items()}
        t = sum(kernel_time(name, k, v, hw, sass)["t"] for k, v in kt.items())
        launches = sum(q["launches"] for q in pred.values())
        out[label] = {"op": op, "dims": dims, "t": t + launches * hw.launch_s, "flops": 2 * macs, "hardware": hw.name}
    for prec, (kernels, summary) in microbatches.items():
        r = roofline(name, kernels, summary, hw, sass)
        out[f"model {prec}"] = {"op": "loss_and_grad", "dims": {"layers": 2, "seqs": 1}, "t": r["t_total"],
                                "flops": r["model_flops"], "hardware": hw.name}
    return out


def sources_digest(tree: pathlib.Path) -> str:
    """SHA-256 of the kernel sources and their launch code (what a prediction was computed from)."""
    import hashlib
    h = hashlib.sha256()
    for pattern in ("cuda/*.cu", "cuda/*.cuh", "cuda/ops.py", "metal/*.metal", "metal/ops.py"):
        for f in sorted(tree.glob(pattern)):
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


# ================================================================== report
def _fmt_t(s: float) -> str:
    return f"{s * 1e3:10.3f} ms" if s < 100 else f"{s:10.1f} s "


def print_sass(sass: dict, out=print) -> None:
    out(f"\n== (a) SASS for sm_90 (nvcc, cuobjdump): registers, spills, shared memory, innermost loops [{LABEL} inputs]")
    if "skipped" in sass:
        out(f"  skipped: {sass['skipped']}")
        return
    out(f"  {'file':14s} {'kernel':28s} {'regs':>4s} {'spill':>6s} {'smem':>6s}  hot loops: kind issued/madds = instr per madd")
    for f, ks in sass.items():
        if "error" in ks:
            out(f"  {f:14s} COMPILE ERROR: {ks['error'][:200]}")
            continue
        for k, v in ks.items():
            loops_txt = "; ".join(
                f"{s.kind} {s.issued}/{s.madds}" + (f" = {s.per_madd:.2f}" if s.per_madd else f" ({s.fp_ops} fp ops)")
                for s in v["loops"][:3])
            out(f"  {f:14s} {k:28s} {v.get('registers', 0):4d} {v.get('spill_stores', 0) + v.get('spill_loads', 0):6d} "
                f"{v.get('smem', 0):6d}  {loops_txt or '-'}")


def gemm_goal(sass: dict) -> tuple[float | None, str]:
    loops_ = sass.get("linear.cu", {}).get("o1b_gemm", {}).get("loops", []) if "skipped" not in sass else []
    fused = [s for s in loops_ if s.kind == "fused"]
    best = min(fused, key=lambda s: s.per_madd) if fused else None
    if best is None:
        return None, "no fused loop in o1b_gemm"
    return best.per_madd, f"o1b_gemm fused loop @0x{best.head:x}: {best.issued} issued / {best.madds} madds"


def print_roofline(backend: str, precision: str, r: dict, out=print) -> None:
    hw = H100 if r["hardware"] == H100.name else M3

    def peak(row) -> str:        # a GEMM kernel's share of the MFU denominator
        return f"{100 * 2 * row['macs'] / row['t'] / hw.bf16_peak:6.2f}" if row["macs"] and row["t"] else "-"

    out(f"\n== (c) {backend} {precision}, one open1b microbatch (4 x 4096 tokens) on {r['hardware']} [{LABEL}]")
    out(f"  {'kernel':30s} {'launch':>7s} {'GFLOP32':>9s} {'GMAC(op)':>9s} {'GB uniq':>8s} {'GB issued':>9s} "
        f"{'t_issue':>13s} {'t_mem':>13s} {'t':>13s} {'%peak':>6s} bound   how")
    for row in r["rows"]:
        if row["t"] < 1e-4 * r["t_kernels"]:
            continue
        out(f"  {row['kernel'][:30]:30s} {row['launches']:7.0f} {row['fp32_flops'] / 1e9:9.1f} {row['macs'] / 1e9:9.1f} "
            f"{row['bytes_unique'] / 1e9:8.2f} {row['bytes_issued'] / 1e9:9.1f} {_fmt_t(row['t_issue'])} "
            f"{_fmt_t(row['t_mem'])} {_fmt_t(row['t'])} {peak(row):>6s} {row['bound']:7s} {row['how']}")
    out(f"  kernels {_fmt_t(r['t_kernels'])}; launches {r['launches']:.0f}, host syncs {r['syncs']}; "
        f"microbatch {_fmt_t(r['t_total'])}; model {r['model_flops'] / 1e12:.1f} TFLOP; MFU {100 * r['mfu']:.3f}% [{LABEL}]")


def goals_table(results: dict, sass: dict, out=print) -> dict:
    got = {}
    per_madd, how = gemm_goal(sass)
    got["gemm_instr_per_madd_fused"] = (per_madd, GOALS["gemm_instr_per_madd_fused"], "<=", how)
    for prec in ("bf16", "int8"):
        r = results.get(("cuda", prec, H100.name))
        if r:
            got[f"mfu_{prec}"] = (r["mfu"], GOALS[f"mfu_{prec}"], ">=", f"H100, {_fmt_t(r['t_total']).strip()} per microbatch")
    r = results.get(("metal", "bf16", M3.name))
    if r:
        g = next((x for x in r["rows"] if x["kernel"] == "gemm"), None)
        if g is not None and g["t"]:
            frac = 2 * g["macs"] / g["t"] / M3.fp32_fma_flops
            got["metal_gemm_frac_fma"] = (frac, GOALS["metal_gemm_frac_fma"], ">=",
                                          f"M3, the gemm kernel over the microbatch's bf16 GEMMs: "
                                          f"{2 * g['macs'] / g['t'] / 1e9:.0f} GFLOP/s")
    out(f"\n== goals [{LABEL}]")
    for k, (v, goal, rel, how) in got.items():
        ok = v is not None and (v <= goal if rel == "<=" else v >= goal)
        vs = "n/a" if v is None else (f"{100 * v:.3f}%" if k != "gemm_instr_per_madd_fused" else f"{v:.3f}")
        gs = f"{100 * goal:.0f}%" if k != "gemm_instr_per_madd_fused" else f"{goal}"
        out(f"  {k:28s} {vs:>10s}  goal {rel} {gs:6s} {'MET' if ok else 'MISSED'}  ({how})")
    return got


# ================================================================== main
PACKAGE_DIRS = {"metal": "metal", "cuda": "cuda", "cpu_ref": "cpu_ref", "parity": "parity", "cli": "cli"}


def checkout(rev: str, dest: pathlib.Path) -> None:
    """The tree of `rev` at dest, importable as mlx_open1b with sys.path[0] = dest (the mapped
    packages linked under mlx_open1b/, the C reference's built library copied from this checkout:
    the model runs the emulated backends, not the C reference). The emulators (cuda/emu, metal/emu)
    are this checkout's: they are the measuring instrument (with the counters), and run the
    revision's kernel sources and launch code."""
    arch = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True)
    if arch.returncode:
        raise SystemExit(f"error: --rev {rev}: git archive failed: {arch.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(dest)], input=arch.stdout, check=True)
    for pkg, folder in PACKAGE_DIRS.items():
        link = dest / "mlx_open1b" / pkg
        if not link.exists() and (dest / folder).is_dir():
            link.symlink_to(dest / folder, target_is_directory=True)
    for so in (ROOT / "cpu_ref").glob("_kernels*.so"):
        shutil.copy2(so, dest / "cpu_ref" / so.name)
    for emu in ("cuda/emu", "metal/emu"):
        shutil.rmtree(dest / emu, ignore_errors=True)
        shutil.copytree(ROOT / emu, dest / emu, ignore=shutil.ignore_patterns("__pycache__"))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", help="model the kernel sources and launch code of this git revision (git archive "
                                  "into a temp dir), e.g. 3622d88")
    ap.add_argument("--tree", help=argparse.SUPPRESS)      # run on an extracted tree (used by --rev)
    ap.add_argument("--rev-name", help=argparse.SUPPRESS)  # the revision as resolved by the parent
    ap.add_argument("--part", choices=("all", "sass", "counts"), default="all")
    ap.add_argument("--backends", default="cuda,metal", help="emulated backends to count (default %(default)s)")
    ap.add_argument("--precisions", default="bf16,int8", help="microbatch precisions (default %(default)s)")
    ap.add_argument("--cuda-bin", help="folder with nvcc and cuobjdump (default: PATH)")
    ap.add_argument("--json", help="write every number to this file")
    ap.add_argument("--bench-json", help="write the predictions for benchmarks/gpu_bench.py's shapes to this file")
    ap.add_argument("--fits-cache", help="a folder keeping the fits per backend and kernel sources (reruns skip them)")
    return ap.parse_args(argv)


def run(args, out=print) -> dict:
    from mlx_open1b import backend as backend_mod
    from mlx_open1b.config import preset
    tree = pathlib.Path(args.tree) if args.tree else ROOT
    out(f"kernel_model: every figure below is a {LABEL} from the sources of {args.rev or 'the working tree'} "
        f"({tree}); no GPU ran anything")
    for hw in (H100, M3):
        out(f"  {hw.name}: {hw.source}")
    report: dict = {"rev": args.rev or "working tree", "label": LABEL}
    # attention.cu compiled as the backend builds it for the open1b preset's head dim (its loops are
    # unrolled over D: a module built at another D has other inner loops)
    attn_d = {"attention.cu": (("ATTN_D", preset("open1b").model.head_dim),)}
    sass = (sass_report(tree / "cuda", args.cuda_bin, attn_d) if args.part in ("all", "sass")
            else {"skipped": "--part"})
    print_sass(sass, out)
    report["sass"] = {f: ({k: dict({a: b for a, b in v.items() if a != "loops"},
                                   loops=[dict(dataclasses.asdict(s), per_madd=s.per_madd, kind=s.kind) for s in v["loops"]])
                           for k, v in ks.items()} if "error" not in ks and f != "skipped" else ks)
                      for f, ks in sass.items()} if "skipped" not in sass else sass
    results = {}
    if args.part in ("all", "counts"):
        big = preset("open1b")
        for name in [b for b in args.backends.split(",") if b]:
            ops = backend_mod.load(name)
            out(f"\n== (b) {name} emulator: fits of the hot ops' counts (scaling rule: see the module docstring)")
            precisions = [p for p in args.precisions.split(",") if p]
            needed = set(workloads()) - ({"linear_forward", "linear_backward", "attention_forward"}
                                         if "bf16" not in precisions else set()) \
                - ({"qlinear_forward", "qlinear_backward", "attention_forward_i8"} if "int8" not in precisions else set())
            cache = (pathlib.Path(args.fits_cache) / f"fits-{name}-{sources_digest(tree)[:16]}.json"
                     if args.fits_cache else None)
            if cache is not None:
                cache.parent.mkdir(parents=True, exist_ok=True)
            fits = fit_all(ops, needed, out, cache)
            report.setdefault("fits", {})[name] = {f"{op}[{i}]": {"check_ok": f.check_ok, "check_diff": f.check_diff}
                                                   for (op, i), f in fits.items()}
            bench_mb = {}
            for prec in precisions:
                calls, model_reads = record_microbatch(ops, prec)
                kernels, summary = microbatch(calls, fits, big.model, big.train.microbatch_seqs)
                summary["syncs"] += len(model_reads)
                bench_mb[prec] = microbatch(calls, fits, bench_model_config(), 1)
                bench_mb[prec][1]["syncs"] += len(model_reads)
                for note in summary["notes"]:
                    out(f"  note: {note}")
                mi = summary["micro"]
                out(f"\n  {name} {prec}, recorded on the micro model ({MICRO}, {MICRO_SEQS} sequences): "
                    f"{mi['calls']} op calls, {mi['launches']} launches, {mi['syncs'] + len(model_reads)} host "
                    f"syncs ({', '.join(mi['sync_sites'] + sorted(set(model_reads)))})")
                for hw in ((H100,) if name == "cuda" else (M3,)):
                    r = roofline(name, kernels, summary, hw, sass if name == "cuda" else {})
                    print_roofline(name, prec, r, out)
                    results[(name, prec, hw.name)] = r
                    report.setdefault("roofline", []).append(dict(r, backend=name, precision=prec))
            hw = H100 if name == "cuda" else M3
            report.setdefault("bench", {})[name] = bench_predictions(name, fits, sass if name == "cuda" else {},
                                                                     hw, bench_mb)
    report["sources_sha256"] = sources_digest(tree)
    report["goals"] = {k: {"value": v[0], "goal": v[1], "relation": v[2], "how": v[3]}
                       for k, v in goals_table(results, sass, out).items()}
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.rev and not args.tree:
        got = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", args.rev], capture_output=True, text=True)
        if got.returncode:
            raise SystemExit(f"error: --rev {args.rev}: not a revision of {ROOT} ({got.stderr.strip()})")
        commit = got.stdout.strip()
        name = args.rev if commit.startswith(args.rev) else f"{args.rev} ({commit})"
        with tempfile.TemporaryDirectory(prefix="o1b-rev-") as tmp:
            checkout(commit, pathlib.Path(tmp))
            rest = [a for a in (argv if argv is not None else sys.argv[1:])]
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([tmp, os.environ.get("PYTHONPATH", "")]))
            return subprocess.run([sys.executable, __file__, *rest, "--rev-name", name, "--tree", tmp],
                                  env=env).returncode
    if args.tree:
        sys.path.insert(0, args.tree)
        args.rev = args.rev_name or args.rev
    report = run(args)
    if args.json:
        from mlx_open1b.fsutil import write_bytes_atomic
        write_bytes_atomic(args.json, json.dumps(report, indent=1, default=str).encode())
    if args.bench_json:
        from mlx_open1b.fsutil import write_bytes_atomic
        keep = {k: report.get(k) for k in ("rev", "label", "sources_sha256", "bench", "goals")}
        write_bytes_atomic(args.bench_json, json.dumps(keep, indent=1, default=str).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
