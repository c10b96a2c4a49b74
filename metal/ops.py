"""The Metal backend: every op of the interface (mlx_open1b/backend.py) through the Metal kernel
sources of this folder.

Its device arrays are mx.arrays (`to_device`): on a Mac they stay on the GPU, lazily evaluated;
on a Metal GPU a numpy-mode op's numpy operands go up once per op, not with every launch. The
kernels return new arrays, so add, scale and adamw are its own and the in-place ops write their
results back into numpy buffers (mlx_open1b.derived_ops). Each op launches its kernels through
`runtime.kernel(...)`: mx.fast.metal_kernel on a Mac, the emulator elsewhere (which copies mx.arrays
to the host and back) — the same grid sizes, output shapes and template arguments either way. Host
code only checks arguments, allocates, and moves data (bucketing positions for the embedding
backward, assembling chunk rows, joining the slabs of a long kernel: GEMMs, attention and every
row-wise or elementwise kernel whose work grows with the batch are launched in slabs of bounded
work so that no command buffer trips the macOS GPU watchdog, metal/slabs.py); every fp32 value
comes out of a kernel.
"""
from __future__ import annotations

import contextlib

import numpy as np

from mlx_open1b.contract import (CONTRACT_VERSION, INIT_SIGMA, NORM_BLOCK, Q_MAX_P, QB, QMAX,  # noqa: F401
                                 QMAX4, XENT_CHUNK)                                             # (re-exported)
from mlx_open1b import arrays, derived_ops, opargs
from mlx_open1b.opargs import BF16, F32, FUNCTIONS  # noqa: F401  (FUNCTIONS re-exported)
from . import runtime, slabs
from .runtime import available  # noqa: F401  (re-exported)

NAME = "metal"
I64 = np.dtype(np.int64)
U32 = np.dtype(np.uint32)
MAX_GRID = 2 ** 31 - 1

# name -> (input names, output names): the kernels of metal/<name>.metal
KERNELS = {
    "map": (["x"], ["y"]),
    "f32_to_bf16": (["x"], ["y"]),
    "bf16_to_f32": (["x"], ["y"]),
    "add": (["a", "b"], ["out"]),
    "div": (["a", "b"], ["y"]),
    "scale": (["a", "s"], ["out"]),
    "scalar": (["ab"], ["out"]),
    "gemm": (["A", "B", "C0", "prm"], ["C"]),
    "embedding_forward": (["tokens", "wte", "prm"], ["out"]),
    "embedding_backward": (["start", "pos", "dout", "prm"], ["dwte"]),
    "rmsnorm_forward": (["x", "g", "eps", "prm"], ["y", "rstd"]),
    "rmsnorm_backward": (["dy", "x", "g", "rstd", "prm"], ["dx"]),
    "rmsnorm_dg": (["dy", "x", "rstd", "prm"], ["dg"]),
    "rope_tables": (["prm", "theta"], ["cos_t", "sin_t"]),
    "rope": (["x", "cs", "sn", "prm"], ["y"]),
    "swiglu_forward": (["h", "prm"], ["out"]),
    "swiglu_backward": (["dout", "h", "prm"], ["dh"]),
    "attention_forward": (["q", "k", "v", "prm", "scale"], ["o", "lse"]),
    "attention_vquant": (["v", "prm"], ["qv", "sv"]),
    "attention_forward_i8": (["q", "k", "vq", "vs", "prm", "scale"], ["o", "lse"]),
    "attention_di": (["dout", "o", "prm"], ["Di"]),
    "attention_dq": (["dout", "q", "k", "v", "lse", "Di", "prm", "scale"], ["dq"]),
    "attention_dkv": (["dout", "q", "k", "v", "lse", "Di", "prm", "scale"], ["dk", "dv"]),
    "xent_forward_chunk": (["z", "targets", "m_in", "s_in", "zt_in", "prm"], ["m_out", "s_out", "zt_out"]),
    "xent_forward_final": (["m", "s", "zt", "zcoef"], ["loss", "lse", "ce"]),
    "xent_backward_dz": (["z", "targets", "lse", "dloss", "zcoef", "prm"], ["dz"]),
    "adamw": (["p", "g", "m", "v", "sc"], ["p_out", "m_out", "v_out"]),
    "sumsq_blocks": (["x", "prm"], ["out"]),
    "treefold": (["values", "prm"], ["out"]),
    "philox": (["prm"], ["out"]),
    "trunc_normal": (["prm", "sigma"], ["out"]),
    "qw_scale": (["w", "prm"], ["s"]),
    "quant_absmax": (["x", "prm"], ["out"]),
    "quant_apply": (["v", "s", "prm"], ["q", "clip"]),
    "gemm_i8": (["A", "B", "prm"], ["C"]),
    "qdequant": (["acc", "sc", "cs", "clip", "prm"], ["out"]),
    "hadamard": (["x", "prm"], ["y"]),
    "hadamard_i8": (["q", "prm"], ["y"]),
    "qgrad_scale": (["dy", "sw", "prm"], ["g"]),
}


def contract_version() -> int:
    return CONTRACT_VERSION


def to_device(a):
    return a if arrays.kind(a) == arrays.MLX else arrays.from_host(np.asarray(a), arrays.MLX)


def to_host(a):
    return arrays.to_host(a)


# ---------------------------------------------------------------------------------------------
# kinds in, kinds out (derived_ops.returns_given_kind): an op given any mx.array works on mx.arrays
# only (its numpy arguments are moved up first), so every kernel launch of the op returns mx.arrays;
# numpy only -> numpy (on a Metal GPU each numpy operand uploaded once per op: _upload)
# ---------------------------------------------------------------------------------------------
def _lift_numpy() -> bool:
    """Whether a numpy-mode op's launches read device copies of its numpy operands made once per op
    (on a Metal GPU: an operand read by every slab of a long kernel, a GEMM's A and B, attention's
    q, k and v, the embedding table, goes up once instead of with every launch)."""
    return runtime.real_metal()


_uploads: dict | None = None       # while a numpy-mode op runs on the GPU: its operands' buffers, uploads


def _root(a: np.ndarray) -> np.ndarray:
    """The array that owns a's memory (a view's base, followed to the end)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _upload(a: np.ndarray):
    """The mx.array of a view of one of the op's numpy operands, made at its first launch (the
    operands stay alive and unchanged while the op runs, so a view is known by its memory)."""
    key = (a.__array_interface__["data"][0], a.shape, a.strides, a.dtype.str)
    got = _uploads["arrays"].get(key)
    if got is None:
        got = _uploads["arrays"][key] = to_device(a)
    return got


def _operand_roots(values) -> set:
    roots = set()
    arrays.map_numpy(lambda a: roots.add(id(_root(a))), list(values))
    return roots


@contextlib.contextmanager
def _op_mode(device: bool, values):
    """Around an op: a numpy-mode op on the GPU collects its operands' uploads (an op inside an op
    shares the outer op's)."""
    global _uploads
    if device or _uploads is not None or not _lift_numpy():
        yield
        return
    _uploads = {"roots": _operand_roots(values), "arrays": {}}
    try:
        yield
    finally:
        _uploads = None


_given_kind = derived_ops.returns_given_kind(to_device, _op_mode)


def _nz(a):
    """Kernels never read an empty input; give them one element so every buffer exists."""
    return a if a.size else np.zeros(1, arrays.dtype(a))


def _i64(*v) -> np.ndarray:
    return np.array(v, I64)


def _f32(*v) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.array(v, np.float64).astype(np.float32)


def _join(parts: list, axis: int = 0):
    """The slabs of one output joined along axis (data movement only)."""
    return parts[0] if len(parts) == 1 else arrays.concat(parts, axis)


def _part(x, a: int, b: int):
    """x[a:b] along axis 0 (x itself for the whole range)."""
    return x if a == 0 and b == x.shape[0] else x[a:b]


def _pointwise(name: str, flats: list, extra: list, out_dtypes: list, units: str, template=None):
    """Kernel `name`, one thread per element of the flat inputs `flats` (n elements each; the
    inputs `extra` whole), in the bounded ranges of slabs.item_slabs(units, n): one flat output per
    dtype of out_dtypes."""
    n = flats[0].shape[0]
    parts = [_run(name, [_part(x, a, b) for x in flats] + list(extra), [((b - a,), dt) for dt in out_dtypes],
                  (b - a, 1, 1), template=template) for a, b in slabs.item_slabs(units, n)]
    return [_join([p[t] for p in parts]) for t in range(len(out_dtypes))]


def _transpose(a, axes):
    """a with its axes permuted, in row-major order (data movement only)."""
    if arrays.kind(a) == arrays.MLX:
        import mlx.core as mx
        return mx.contiguous(mx.transpose(a, axes))
    return np.ascontiguousarray(np.transpose(a, axes))


GEMM_NT = 256       # threads per threadgroup of gemm.metal and gemm_i8.metal (a 64 x 64 tile of C)


def _gemm_tiles(I: int, J: int) -> int:
    """Threadgroups of gemm.metal / gemm_i8.metal for C (I, J): one per slabs.GEMM_TILE square."""
    T = slabs.GEMM_TILE
    return -(-I // T) * -(-J // T)


def _gemm_blocks(I: int, J: int, P: int, launch):
    """C (I, J) from launch(i0, i1, j0, j1) -> the block C[i0:i1, j0:j1], over the bounded blocks of
    slabs.gemm_slabs (each output element computed whole by one thread of one launch)."""
    rows, cur, at = [], [], None
    for i0, i1, j0, j1 in slabs.gemm_slabs(I, J, P):
        if at is not None and at != (i0, i1):
            rows.append(_join(cur, 1))
            cur = []
        at = (i0, i1)
        cur.append(launch(i0, i1, j0, j1))
    rows.append(_join(cur, 1))
    return _join(rows, 0)


def _run(name: str, inputs, outputs, grid, threadgroup=(256, 1, 1), template=None):
    """Launch metal/<name>.metal; outputs = [(shape, dtype)]; returns the output arrays."""
    if any(int(g) > MAX_GRID for g in grid):
        raise ValueError(f"{name}: grid {tuple(grid)} exceeds {MAX_GRID} threads in one dimension")
    device = arrays.any_device(inputs) is not None      # any mx.array in -> mx.arrays out
    if any(int(g) == 0 for g in grid):
        outs = [np.zeros(shape, dt) for shape, dt in outputs]
        return [to_device(o) for o in outs] if device else outs
    in_names, out_names = KERNELS[name]
    k = runtime.kernel(name, in_names, out_names)
    if _uploads is not None:     # a numpy-mode op on the GPU: its operands go up once (_upload)
        inputs = [_upload(a) if arrays.kind(a) == arrays.NUMPY and id(_root(a)) in _uploads["roots"] else a
                  for a in inputs]
    if k.real:      # mx.fast.metal_kernel: mx.arrays in; out stay lazy on the GPU in device mode
        ins = [_nz(a) if arrays.kind(a) == arrays.MLX else _nz(np.ascontiguousarray(a)) for a in inputs]
    else:           # the emulator reads host memory (its copy stands for the GPU reading the buffer)
        ins = [_nz(np.ascontiguousarray(np.asarray(a))) for a in inputs]
    outs = k(inputs=ins, output_shapes=[shape for shape, _ in outputs], output_dtypes=[dt for _, dt in outputs],
             grid=tuple(int(g) for g in grid), threadgroup=threadgroup, template=template, keep=device)
    outs = [o.reshape(shape) for o, (shape, _) in zip(outs, outputs)]
    if device and not k.real:
        outs = [to_device(o) for o in outs]
    return outs


# ---------------------------------------------------------------------------------------------
# §4 functions, §2 conversions, elementwise ops, host scalars
# ---------------------------------------------------------------------------------------------
def _map(index: int, x: np.ndarray) -> np.ndarray:
    (y,) = _pointwise("map", [x.reshape(-1)], [], [F32], "map", template=[("OP", index)])
    return y.reshape(x.shape)


exp, log, sin, cos, sqrt, rsqrt, sigmoid, silu, sqrt_int = map(_given_kind, opargs.map_functions(_map))


@_given_kind
def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    opargs.f32_to_bf16(x)
    (y,) = _pointwise("f32_to_bf16", [x.reshape(-1)], [], [BF16], "convert")
    return y.reshape(x.shape)


@_given_kind
def bf16_to_f32(x: np.ndarray) -> np.ndarray:
    opargs.bf16_to_f32(x)
    (y,) = _pointwise("bf16_to_f32", [x.reshape(-1)], [], [F32], "convert")
    return y.reshape(x.shape)


@_given_kind
def div_int(a, b):
    opargs.div_int(a, b)
    (y,) = _pointwise("div", [a.reshape(-1), b.reshape(-1)], [], [F32], "div")
    return y.reshape(a.shape)


@_given_kind
def add(a, b):
    opargs.add_inplace(a, b, inplace=False)
    (out,) = _pointwise("add", [a.reshape(-1), b.reshape(-1)], [], [F32], "convert")
    return out.reshape(a.shape)


@_given_kind
def scale(a, s: float):
    opargs.scale_inplace(a, inplace=False)
    (out,) = _pointwise("scale", [a.reshape(-1)], [_f32(s)], [F32], "convert")
    return out.reshape(a.shape)


def _scalar(op: int, a: float, b: float = 0.0) -> float:
    (out,) = _run("scalar", [_f32(a, b)], [((1,), F32)], (1, 1, 1), (1, 1, 1), template=[("OP", op)])
    return float(out[0])


scalar_add, scalar_sub, scalar_mul, scalar_div, scalar_sqrt = map(_given_kind, opargs.scalar_functions(_scalar))


# ---------------------------------------------------------------------------------------------
# §6.1 GEMM and the linear layer
# ---------------------------------------------------------------------------------------------
def _gemm(I, J, P, A, oa, sai, sap, B, ob, sbp, sbj, C0=None) -> np.ndarray:
    """C (I, J) = the contract GEMM of A(i, p) = A[oa + i sai + p sap], B(p, j) = B[ob + p sbp + j sbj],
    accumulating onto C0 when given."""
    acc = C0 is not None
    A, B = A.reshape(-1), B.reshape(-1)

    def block(i0, i1, j0, j1):
        c0 = C0[i0:i1, j0:j1].reshape(-1) if acc else np.zeros(1, F32)
        (C,) = _run("gemm", [A, B, c0, _i64(i1 - i0, j1 - j0, P, oa + i0 * sai, sai, sap, ob + j0 * sbj, sbp, sbj)],
                    [((i1 - i0, j1 - j0), F32)], (_gemm_tiles(i1 - i0, j1 - j0) * GEMM_NT, 1, 1), (GEMM_NT, 1, 1),
                    template=[("ACC", int(acc))])
        return C
    return _gemm_blocks(I, J, P, block)


@_given_kind
def linear_forward(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    N, K, M = opargs.linear_forward(x, w)
    return _gemm(N, M, K, x, 0, K, 1, w, 0, 1, K)


@_given_kind
def linear_backward(dy: np.ndarray, x: np.ndarray, w: np.ndarray, need_dx: bool = True,
                    need_dw: bool = True, *, dw_out: np.ndarray | None = None):
    N, K, M = opargs.linear_backward(dy, x, w)
    dw_out = opargs.dw_out(dw_out, M, K, need_dw)
    dx = _gemm(N, K, M, dy, 0, M, 1, w, 0, K, 1) if need_dx else None
    dw = _gemm(M, K, N, dy, 0, 1, M, x, 0, K, 1) if need_dw else None
    return dx, derived_ops.into(dw_out, dw)


# ---------------------------------------------------------------------------------------------
# §6.2–§6.5 layers
# ---------------------------------------------------------------------------------------------
@_given_kind
def embedding_forward(tokens: np.ndarray, wte: np.ndarray) -> np.ndarray:
    N, V, C = opargs.embedding_forward(tokens, wte)
    wf = wte.reshape(-1)
    outs = [_run("embedding_forward", [_part(tokens, a, b), wf, _i64(C)], [((b - a, C), F32)], (C, b - a, 1),
                 (32, 8, 1))[0] for a, b in slabs.item_slabs("embedding_forward", N, C)]
    return _join(outs)


@_given_kind
def embedding_backward(tokens: np.ndarray, dout: np.ndarray, V: int, *,
                       dw_out: np.ndarray | None = None) -> np.ndarray:
    N, V, C = opargs.embedding_backward(tokens, dout, V)
    dw_out = opargs.dw_out(dw_out, V, C, True)
    # the stable counting sort of positions by token (data movement only, on the host; the
    # index arrays go back to the device with the launch)
    tokens = opargs.host_ids(tokens)
    start = np.zeros(V + 1, I64)
    start[1:] = np.cumsum(np.bincount(tokens, minlength=V))
    pos = np.argsort(tokens, kind="stable").astype(I64)
    (dwte,) = _run("embedding_backward", [start, pos, dout.reshape(-1), _i64(C)], [((V, C), F32)],
                   (C, V, 1), (32, 8, 1))
    return derived_ops.into(dw_out, dwte)


@_given_kind
def rmsnorm_forward(x: np.ndarray, g: np.ndarray | None, eps: float, bf16_out: bool = False):
    N, C = opargs.rmsnorm_forward(x, g, eps)
    gg = g if g is not None else np.zeros(1, BF16)
    xf, has_g = x.reshape(-1), int(g is not None)
    parts = [_run("rmsnorm_forward", [_part(xf, a * C, b * C), gg, _f32(eps), _i64(C)],
                  [((b - a, C), F32), ((b - a,), F32)], (b - a, 1, 1), (64, 1, 1), template=[("HAS_G", has_g)])
             for a, b in slabs.item_slabs("rmsnorm", N, C)]
    y = _join([y for y, _ in parts])
    return (f32_to_bf16(y) if bf16_out else y), _join([r for _, r in parts])


@_given_kind
def rmsnorm_backward(dy: np.ndarray, x: np.ndarray, g: np.ndarray | None, rstd: np.ndarray):
    N, C = opargs.rmsnorm_backward(dy, x, g, rstd)
    gg = g if g is not None else np.zeros(1, BF16)
    dyf, xf, has_g = dy.reshape(-1), x.reshape(-1), int(g is not None)
    dx = _join([_run("rmsnorm_backward", [_part(dyf, a * C, b * C), _part(xf, a * C, b * C), gg, _part(rstd, a, b),
                                          _i64(C)], [((b - a, C), F32)], (b - a, 1, 1), (64, 1, 1),
                     template=[("HAS_G", has_g)])[0] for a, b in slabs.item_slabs("rmsnorm", N, C)])
    dg = None
    if g is not None:
        (dg,) = _run("rmsnorm_dg", [dy.reshape(-1), x.reshape(-1), rstd, _i64(N, C)], [((C,), F32)],
                     (C, 1, 1), (64, 1, 1))
    return dx, dg


@_given_kind
def rope_tables(T: int, D: int, theta: float):
    T, D = opargs.rope_tables(T, D, theta)
    cos_t, sin_t = _run("rope_tables", [_i64(T, D), _f32(theta)], [((T, D // 2), F32), ((T, D // 2), F32)],
                        (D // 2, T, 1), (32, 8, 1))
    return cos_t, sin_t


def _rope(x, cos_t, sin_t, backward, name):
    B, T, R, D = opargs.rope(x, cos_t, sin_t, name)
    # whole sequences per launch: the kernel's position t = (row / R) % T counts from a sequence start
    cs, sn = cos_t.reshape(-1), sin_t.reshape(-1)
    ys = [_run("rope", [_part(x, a, b).reshape(-1), cs, sn, _i64(T, R, D)], [((b - a, T, R, D), F32)],
               (D // 2, (b - a) * T * R, 1), (32, 8, 1), template=[("BWD", int(backward))])[0]
          for a, b in slabs.item_slabs("rope", B, T * R * D)]
    return _join(ys)


@_given_kind
def rope_forward(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    return _rope(x, cos, sin, False, "x")


@_given_kind
def rope_backward(dy: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    return _rope(dy, cos, sin, True, "dy")


@_given_kind
def swiglu_forward(h: np.ndarray, bf16_out: bool = False) -> np.ndarray:
    N, F = opargs.swiglu_forward(h)
    outs = [_run("swiglu_forward", [h[a:b].reshape(-1), _i64(F)], [((b - a, F), F32)], (F, b - a, 1), (32, 8, 1))[0]
            for a, b in slabs.item_slabs("swiglu_forward", N, F)]
    return f32_to_bf16(_join(outs)) if bf16_out else _join(outs)


@_given_kind
def swiglu_backward(dout: np.ndarray, h: np.ndarray, bf16_out: bool = False) -> np.ndarray:
    N, F = opargs.swiglu_backward(dout, h)
    dhs = [_run("swiglu_backward", [dout[a:b].reshape(-1), h[a:b].reshape(-1), _i64(F)], [((b - a, 2 * F), F32)],
                (F, b - a, 1), (32, 8, 1))[0]
           for a, b in slabs.item_slabs("swiglu_backward", N, F)]
    return f32_to_bf16(_join(dhs)) if bf16_out else _join(dhs)


# ---------------------------------------------------------------------------------------------
# §6.6 attention
# ---------------------------------------------------------------------------------------------
ATTN_ROWS = 32       # rows (query or key) per threadgroup of the tiled attention kernels
ATTN_THREADS = {"attention_forward": 64, "attention_forward_i8": 64,      # threads per threadgroup: two per row
                "attention_dq": 128, "attention_dkv": 128}              # four per row

# the largest head dim D for which attention_dkv.metal keeps its smallest query tile (8 rows) within
# 32 KiB of threadgroup memory (tests/ops/test_attention_head_dims.py holds it to the source)
ATTN_MAX_HEAD_DIM = 638


def _attention_head_dim(D: int) -> None:
    """Refuse, before any launch, a head dim whose attention tiles would not fit on chip."""
    if D > ATTN_MAX_HEAD_DIM:
        raise ValueError(f"attention: head_dim {D} is over this backend's limit of {ATTN_MAX_HEAD_DIM} "
                         "(the dk/dv pass's smallest query tile must fit on chip)")


def attention_tile_slabs(B: int, T: int, heads: int, row_work, bound: int | None = None) -> list:
    """(t0, t1) ranges of the tiles (b heads + h) nt + tb of ATTN_ROWS rows of one head
    (nt = ceil(T / ATTN_ROWS)), each tile's work the sum of its rows' (row_work: (T,) units), at most
    `bound` units a range (slabs.row_slabs: a tile costing more gets a range of its own)."""
    nt = -(-T // ATTN_ROWS)
    work = np.zeros(nt * ATTN_ROWS, np.int64)
    work[:T] = row_work
    return slabs.row_slabs(np.tile(work.reshape(nt, ATTN_ROWS).sum(1), B * heads), bound)


def _attention_tiles(name: str, inputs: list, outputs: list, B: int, T: int, heads: int, row_work, prm: list,
                     D: int, s: float):
    """A tiled attention kernel over the tiles (b heads + h) nt + tb of ATTN_ROWS rows of one head
    (nt = ceil(T / ATTN_ROWS)), launched slab by slab of whole tiles (attention_tile_slabs);
    outputs: the shape of one row of each fp32 output, (D,) or ().
    Returns each output joined, as (B, heads, T) + its row shape."""
    nt = -(-T // ATTN_ROWS)
    parts = []
    for t0, t1 in attention_tile_slabs(B, T, heads, row_work):
        rows = (t1 - t0) * ATTN_ROWS
        parts.append(_run(name, inputs + [_i64(*prm, t0), _f32(s)],
                          [((rows,) + shape, F32) for shape in outputs],
                          ((t1 - t0) * ATTN_THREADS[name], 1, 1), (ATTN_THREADS[name], 1, 1), template=[("D", D)]))
    out = []
    for x, shape in zip(zip(*parts), outputs):
        x = _join(list(x)).reshape((B, heads, nt * ATTN_ROWS) + shape)[:, :, :T]
        out.append(_transpose(x, tuple(range(x.ndim))))         # contiguous (data movement)
    return out


def _query_work(T: int, W: int, D: int) -> np.ndarray:
    """(T,) units of a query row of the forward and dq kernels (the slab plan's work)."""
    return slabs.query_keys(T, W) * slabs.attention_pair_work(D)


@_given_kind
def attention_forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int, scale: float):
    B, T, H, G, D, W, s = opargs.attention_forward(q, k, v, window, scale)
    _attention_head_dim(D)
    o, lse = _attention_tiles("attention_forward", [q.reshape(-1), k.reshape(-1), v.reshape(-1)], [(D,), ()],
                              B, T, H, _query_work(T, W, D), [T, H, G, W], D, s)
    return _transpose(o, (0, 2, 1, 3)), lse


@_given_kind
def attention_forward_i8(q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int, scale: float):
    """The value rows quantized once per key row (attention_vquant), then the query rows as in
    attention_forward."""
    B, T, H, G, D, W, s = opargs.attention_forward(q, k, v, window, scale)
    _attention_head_dim(D)
    vf = v.reshape(-1)
    parts = [_run("attention_vquant", [_part(vf, a * D, b * D), _i64(D)], [((b - a, D), I8), ((b - a,), F32)],
                  (b - a, 1, 1), (64, 1, 1)) for a, b in slabs.item_slabs("attention_vquant", B * T * G, D)]
    vq, vs = _join([a for a, _ in parts]), _join([b for _, b in parts])
    o, lse = _attention_tiles("attention_forward_i8", [q.reshape(-1), k.reshape(-1), vq.reshape(-1), vs.reshape(-1)],
                              [(D,), ()], B, T, H, _query_work(T, W, D), [T, H, G, W], D, s)
    return _transpose(o, (0, 2, 1, 3)), lse


@_given_kind
def attention_backward(dout: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                       o: np.ndarray, lse: np.ndarray, window: int, scale: float):
    B, T, H, G, D, W, s = opargs.attention_backward(dout, q, k, v, o, lse, window, scale)
    _attention_head_dim(D)
    Di = _join([_run("attention_di", [_part(dout, a, b).reshape(-1), _part(o, a, b).reshape(-1), _i64(T, H, D)],
                     [((b - a, H, T), F32)], ((b - a) * H * T, 1, 1), (64, 1, 1))[0]
                for a, b in slabs.item_slabs("attention_di", B, T * H * D)])
    ins = [dout.reshape(-1), q.reshape(-1), k.reshape(-1), v.reshape(-1), lse.reshape(-1), Di.reshape(-1)]
    (dq,) = _attention_tiles("attention_dq", ins, [(D,)], B, T, H, _query_work(T, W, D), [T, H, G, W], D, s)
    dk, dv = _attention_tiles("attention_dkv", ins, [(D,), (D,)], B, T, G,
                              slabs.key_queries(T, W) * (H // G) * slabs.attention_pair_work(D), [T, H, G, W], D, s)
    return tuple(_transpose(x, (0, 2, 1, 3)) for x in (dq, dk, dv))


# ---------------------------------------------------------------------------------------------
# §6.8 cross-entropy with z-loss
# ---------------------------------------------------------------------------------------------
def _chunks(V: int, chunk: int):
    for v0 in range(0, V, chunk):
        yield v0, min(chunk, V - v0)


def _forward_chunked(h, w, targets, zcoef, chunk):
    N, C, V, zc = opargs.xent_forward(h, w, targets, zcoef)
    m = np.full(N, -np.inf, F32)
    s = np.zeros(N, F32)
    zt = np.zeros(N, F32)
    for v0, L in _chunks(V, chunk):
        z = _gemm(N, L, C, h, 0, C, 1, w, v0 * C, 1, C)            # the columns v0.. of linear_forward(h, w)
        parts = [_run("xent_forward_chunk", [_part(x, a, b) for x in (z, targets, m, s, zt)] + [_i64(v0, L)],
                      [((b - a,), F32)] * 3, (b - a, 1, 1), (64, 1, 1))
                 for a, b in slabs.item_slabs("xent_chunk", N, L)]
        m, s, zt = (_join([p[t] for p in parts]) for t in range(3))
    loss, lse, ce = _run("xent_forward_final", [m, s, zt, _f32(zc)], [((N,), F32)] * 3, (N, 1, 1), (64, 1, 1))
    return loss, lse, ce


def _backward_chunked(h, w, targets, zcoef, lse, dloss, chunk, dw_out=None):
    N, C, V, zc = opargs.xent_backward(h, w, targets, zcoef, lse, dloss)
    dw_out = opargs.dw_out(dw_out, V, C, True)
    dh = None
    dw = arrays.FlatBuffer(V * C, F32, arrays.any_device([h, w, targets, lse, dloss]) or arrays.NUMPY)
    for v0, L in _chunks(V, chunk):
        z = _gemm(N, L, C, h, 0, C, 1, w, v0 * C, 1, C)            # logits, as in the forward
        dz = _join([_run("xent_backward_dz", [_part(x, a, b) for x in (z, targets, lse, dloss)]
                         + [_f32(zc), _i64(v0, L)], [((b - a, L), BF16)], (L, b - a, 1), (32, 8, 1))[0]
                    for a, b in slabs.item_slabs("xent_chunk", N, L)])
        # dh[n, c] (+)= sum over j ascending of dz[n, j] w[v0 + j, c]: one accumulator across chunks
        dh = _gemm(N, C, L, dz, 0, L, 1, w, v0 * C, C, 1, C0=dh)
        # dw[v0 + j, c] = sum over n ascending of dz[n, j] h[n, c]
        dw.write(v0 * C, _gemm(L, C, N, dz, 0, 1, L, h, 0, C, 1))
    return dh, derived_ops.into(dw_out, dw.result().reshape(V, C))


@_given_kind
def xent_forward(h: np.ndarray, w: np.ndarray, targets: np.ndarray, zcoef: float, keep: bool = False):
    out = _forward_chunked(h, w, targets, zcoef, XENT_CHUNK)
    return (*out, None) if keep else out             # keeps nothing: the backward computes the logits


@_given_kind
def xent_backward(h: np.ndarray, w: np.ndarray, targets: np.ndarray, zcoef: float,
                  lse: np.ndarray, dloss: np.ndarray, saved=None, *, dw_out: np.ndarray | None = None):
    return _backward_chunked(h, w, targets, zcoef, lse, dloss, XENT_CHUNK, dw_out)


# ---------------------------------------------------------------------------------------------
# §6.7 AdamW, §7 reductions and clipping
# ---------------------------------------------------------------------------------------------
@_given_kind
def adamw(p_, g, m, v, *, lr: float, beta1: float = 0.9, beta2: float = 0.95, eps: float = 1e-8,
          weight_decay: float = 0.0, step: int):
    n, scalars = opargs.adamw(p_, g, m, v, lr, beta1, beta2, eps, weight_decay, step, inplace=False)
    sc = _f32(*scalars)
    flat = [a.reshape(-1) for a in (p_, g, m, v)]
    return tuple(_pointwise("adamw", flat, [sc], [BF16, F32, F32], "adamw"))


# the kernels return new arrays; numpy buffers are updated by writing their results back
add_inplace, scale_inplace, adamw_step = derived_ops.inplace_ops(add, scale, adamw)


@_given_kind
def sumsq_blocks(x: np.ndarray) -> np.ndarray:
    nb = opargs.sumsq_blocks(x, NORM_BLOCK)
    xf, n, parts = x.reshape(-1), x.size, []
    for a, b in slabs.item_slabs("sumsq_blocks", nb, NORM_BLOCK):       # whole blocks per launch
        e0, e1 = a * NORM_BLOCK, min(n, b * NORM_BLOCK)
        parts.append(_run("sumsq_blocks", [_part(xf, e0, e1), _i64(e1 - e0)], [((b - a,), F32)], (b - a, 1, 1),
                          (64, 1, 1))[0])
    return _join(parts)


@_given_kind
def treefold(values: np.ndarray) -> float:
    n = opargs.treefold(values)
    (out,) = _run("treefold", [values, _i64(n)], [((1,), F32)], (1, 1, 1), (1, 1, 1))
    return float(out[0])


global_norm = _given_kind(derived_ops.global_norm_of(sumsq_blocks, treefold, scalar_sqrt))


@_given_kind
def clip_coef(norm: float, max_norm: float) -> float:
    return _scalar(5, norm, max_norm)


# ---------------------------------------------------------------------------------------------
# §5 random numbers
# ---------------------------------------------------------------------------------------------
def _prm_random(seed, stream, index0, sub):
    seed, stream, index0, sub = opargs.philox(seed, stream, index0, sub)
    return np.array([seed & 0xFFFFFFFF, seed >> 32, stream, sub, index0 & 0xFFFFFFFF, index0 >> 32], U32)


@_given_kind
def philox_blocks(seed: int, stream: int, index0: int, n: int, sub: int = 0) -> np.ndarray:
    _prm_random(seed, stream, index0, sub)                  # checks the arguments
    n = int(n)
    if n < 0:
        raise ValueError(f"n: expected an integer >= 0, got {n}")
    outs = [_run("philox", [_prm_random(seed, stream, (index0 + a) % 2 ** 64, sub)], [((b - a, 4), U32)],
                 (b - a, 1, 1))[0] for a, b in slabs.item_slabs("philox", n)]
    return _join(outs)


@_given_kind
def trunc_normal(seed: int, stream: int, index0: int, n: int, sigma: float = INIT_SIGMA) -> np.ndarray:
    _prm_random(seed, stream, index0, 0)                    # checks the arguments
    n = int(n)
    if n < 0:
        raise ValueError(f"n: expected an integer >= 0, got {n}")
    outs = [_run("trunc_normal", [_prm_random(seed, stream, (index0 + a) % 2 ** 64, 0), _f32(sigma)], [((b - a,), F32)],
                 (b - a, 1, 1), (64, 1, 1))[0] for a, b in slabs.item_slabs("trunc_normal", n)]
    return _join(outs)


# ---------------------------------------------------------------------------------------------
# §6.9 the int8 quantized linear layer (W8A8, Hadamard-rotated straight-through backward) and its
# simulated int4 / int6 paths (qmax = 7 / 31: the same kernels with the template argument QMAX)
# ---------------------------------------------------------------------------------------------
I8, I32, U8 = np.dtype(np.int8), np.dtype(np.int32), np.dtype(np.uint8)
QUANT_BLOCK = 4096          # elements per threadgroup of the absmax's first pass (any split is exact)
QUANT_NT = 256              # quant_absmax.metal's QA_NT: threads per threadgroup of the absmax
HADAMARD_NT, HADAMARD_COLS = 256, 16    # hadamard(_i8).metal's H_NT, H_COLS: threads, columns per threadgroup


def _pad_qb(n: int) -> int:
    return (n + QB - 1) // QB * QB


def _quant_f32(v: np.ndarray, qmax: int = QMAX):
    """v (any shape) fp32 -> q (same shape) int8 in [-qmax, qmax], s (1,) fp32: the per-tensor
    quantization."""
    n = v.size
    flat = v.reshape(-1)
    nb = (n + QUANT_BLOCK - 1) // QUANT_BLOCK
    # the first pass over whole blocks of QUANT_BLOCK elements (each block's maximum as one launch
    # computes it, a threadgroup per block), then the second over all the block maxima in one
    # threadgroup
    parts = []
    for a, b in slabs.item_slabs("quant_absmax", nb, QUANT_BLOCK):
        e0, e1 = a * QUANT_BLOCK, min(n, b * QUANT_BLOCK)
        parts.append(_run("quant_absmax", [_part(flat, e0, e1), _i64(e1 - e0, QUANT_BLOCK)], [((b - a,), F32)],
                          ((b - a) * QUANT_NT, 1, 1), (QUANT_NT, 1, 1), template=[("SCALE", 0), ("QMAX", qmax)])[0])
    (s,) = _run("quant_absmax", [_join(parts), _i64(nb, max(nb, 1))], [((1,), F32)], (QUANT_NT, 1, 1),
                (QUANT_NT, 1, 1), template=[("SCALE", 1), ("QMAX", qmax)])
    q, _ = _pointwise("quant_apply", [flat], [s, _i64(1)], [I8, U8], "quant_apply",
                      template=[("PER_ROW", 0), ("QMAX", qmax)])
    return q.reshape(v.shape), s


def _quant_w(w: np.ndarray, M: int, K: int, qmax: int = QMAX):
    """w (M, K) bf16 -> q (M, K) int8 in [-qmax, qmax], s (M,) fp32, clip (M, K) uint8 (1 clipped,
    2 NaN row)."""
    (s,) = _run("qw_scale", [w.reshape(-1), _i64(K)], [((M,), F32)], (M, 1, 1), (64, 1, 1),
                template=[("QMAX", qmax)])
    wf = bf16_to_f32(w.reshape(-1))
    # whole rows per launch (row m's step size is s[m])
    parts = [_run("quant_apply", [_part(wf, a * K, b * K), _part(s, a, b), _i64(K)],
                  [((b - a, K), I8), ((b - a, K), U8)], ((b - a) * K, 1, 1), template=[("PER_ROW", 1), ("QMAX", qmax)])
             for a, b in slabs.item_slabs("quant_apply", M, K)]
    return _join([q for q, _ in parts]), s, _join([c for _, c in parts])


def _gemm_i8(I, J, P, A, sai, sap, B, sbj, sbp) -> np.ndarray:
    """C (I, J) int32 = sum over p of A[i sai + p sap] B[j sbj + p sbp] (exact)."""
    A, B = A.reshape(-1), B.reshape(-1)

    def block(i0, i1, j0, j1):
        (C,) = _run("gemm_i8", [A, B, _i64(i1 - i0, j1 - j0, P, sai, sap, sbj, sbp, i0 * sai, j0 * sbj)],
                    [((i1 - i0, j1 - j0), I32)], (_gemm_tiles(i1 - i0, j1 - j0) * GEMM_NT, 1, 1), (GEMM_NT, 1, 1))
        return C
    return _gemm_blocks(I, J, P, block)


def _dequant(mode: int, acc: np.ndarray, sc: np.ndarray, cs=None, clip=None) -> np.ndarray:
    I, J = acc.shape
    cs = cs.reshape(-1) if cs is not None else np.zeros(1, F32)
    rows = (lambda a, b: _part(clip, a, b).reshape(-1)) if clip is not None else (lambda a, b: np.zeros(1, U8))
    return _join([_run("qdequant", [_part(acc, a, b).reshape(-1), sc, cs, rows(a, b), _i64(J)], [((b - a, J), F32)],
                       (J, b - a, 1), (32, 8, 1), template=[("MODE", mode)])[0]
                  for a, b in slabs.item_slabs("qdequant", I, J)])


def _rotate(name: str, a: np.ndarray, R: int, C: int) -> np.ndarray:
    """a (R, C) fp32 or int8, zero-padded to a multiple of QB rows and rotated along them -> fp32."""
    af, ys = a.reshape(-1), []
    for b0, b1 in slabs.item_slabs("hadamard", _pad_qb(R) // QB, QB * C):     # whole blocks of QB rows
        r0, r1 = b0 * QB, min(R, b1 * QB)
        ys.append(_run(name, [_part(af, r0 * C, r1 * C), _i64(r1 - r0, C)], [(((b1 - b0) * QB, C), F32)],
                       (-(-C // HADAMARD_COLS) * HADAMARD_NT, b1 - b0, 1), (HADAMARD_NT, 1, 1))[0])
    return _join(ys)


@_given_kind
def quant_weight_rows(w: np.ndarray):
    M, K = opargs.quant_weight_rows(w)
    q, s, _ = _quant_w(w, M, K)
    return q, s


@_given_kind
def quant_tensor(x: np.ndarray):
    f32 = arrays.dtype(x) == F32
    opargs.quant_tensor(x, F32 if f32 else BF16)
    v = x if f32 else bf16_to_f32(x)
    q, s = _quant_f32(v)
    return q, s[0]


@_given_kind
def gemm_i8(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    I, J, P = opargs.gemm_i8(a, b)
    return _gemm_i8(I, J, P, a, P, 1, b, P, 1)


@_given_kind
def hadamard_rows(f: np.ndarray) -> np.ndarray:
    if arrays.kind(f) != arrays.MLX:
        f = np.array(f, np.float32, copy=True, order="C")
    R, C = opargs.hadamard_rows(f, inplace=False)
    return _rotate("hadamard", f, R, C)


@_given_kind
def qlinear_forward(x: np.ndarray, w: np.ndarray, qmax: int = QMAX) -> np.ndarray:
    N, K, M = opargs.qlinear_forward(x, w)
    qmax = opargs.qmax(qmax)
    qx, sx = _quant_f32(bf16_to_f32(x), qmax)
    qw, sw, _ = _quant_w(w, M, K, qmax)
    acc = _gemm_i8(N, M, K, qx, K, 1, qw, K, 1)
    return _dequant(0, acc, sx, cs=sw)


@_given_kind
def qlinear_backward(dy: np.ndarray, x: np.ndarray, w: np.ndarray, need_dx: bool = True,
                     need_dw: bool = True, qmax: int = QMAX, *, dw_out: np.ndarray | None = None):
    N, K, M = opargs.qlinear_backward(dy, x, w)
    qmax = opargs.qmax(qmax)
    dw_out = opargs.dw_out(dw_out, M, K, need_dw)
    qw, sw, clip = _quant_w(w, M, K, qmax)
    dx = dw = None
    if need_dx:
        Mp = _pad_qb(M)
        g = _join([_run("qgrad_scale", [_part(dy, a, b).reshape(-1), sw, _i64(M, b - a)], [((M, b - a), F32)],
                        (b - a, M, 1), (32, 8, 1))[0] for a, b in slabs.item_slabs("qgrad_scale", N, M)], 1)
        qg, sg = _quant_f32(_rotate("hadamard", g, M, N), qmax)             # (Mp, N)
        qr, sr = _quant_f32(_rotate("hadamard_i8", qw, M, K), qmax)         # (Mp, K)
        acc = _gemm_i8(N, K, Mp, qg, 1, N, qr, 1, K)
        dx = _dequant(1, acc, arrays.concat([sg, sr]))
    if need_dw:
        Np = _pad_qb(N)
        qx, sx = _quant_f32(bf16_to_f32(x), qmax)
        qd, sd = _quant_f32(_rotate("hadamard", bf16_to_f32(dy), N, M), qmax)     # (Np, M)
        qX, sX = _quant_f32(_rotate("hadamard_i8", qx, N, K), qmax)               # (Np, K)
        acc = _gemm_i8(M, K, Np, qd, 1, M, qX, 1, K)
        dw = _dequant(2, acc, arrays.concat([sd, sX, sx]), clip=clip)
    return dx, derived_ops.into(dw_out, dw)
