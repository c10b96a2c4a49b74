"""The backend interface, written once, and the one loader of backends by name.

A backend is a module that provides every name of `Backend` below, with the signature written
there: `mlx_open1b.cpu_ref` (the C reference), `mlx_open1b.metal.ops` and `mlx_open1b.cuda.ops`
(their kernel sources on the device, or on the CPU emulators), and the parity harness's `spec`
(mlx_open1b/spec behind these names). tests/ops/test_backend_interface.py holds each to it, so the
core calls every op on every backend without probing. What a backend adds beyond the interface
(cpu_ref's thread and SIMD settings, cuda's torch interop) is its own and documented there; the
one such name the core looks for (getattr, optional) is `weights_held`, a context in which the
training step's microbatches run (cpu_ref: the int8 layer's weight operands computed once per step).

Every op:
- takes bf16 as uint16 and fp32 as float32 ("bf16", "fp32", "int8", "int32" below name the dtype),
  C-contiguous, and checks its arguments before any kernel runs (mlx_open1b.opargs, shared by
  every backend): a bad one is a ValueError naming it;
- returns the kind of arrays it was given (mlx_open1b.arrays): given a device array (mx.array on
  metal, cupy on cuda) among its array arguments it returns device arrays, given numpy only numpy
  (cpu_ref and spec take numpy only); scalar results (treefold, global_norm, clip_coef, scalar_*)
  are Python floats holding an fp32 value;
- computes the bits CONTRACT.md defines, the same on every backend and device.
Dimension letters: B batch, T sequence length, H query heads, G kv heads (H % G == 0), D head dim,
N rows (tokens), C channels, V vocabulary, F FFN hidden width, K, M the other GEMM dimensions.

`load(name)` gives a backend that runs here and implements this package's contract, or raises
BackendUnavailable (a TrainError, exit code 2) saying why; `resolve('auto')` picks the backend of
the fastest hardware present; `status()` is what `open1b info` shows.
"""
from __future__ import annotations

import inspect
import sys
from typing import Any, Protocol, Sequence

from .contract import CONTRACT_VERSION, INIT_SIGMA, QMAX
from .step import TrainError

# Each backend's own module (cpu_ref, metal, cuda, shape) is imported when that backend is asked for,
# in the functions below: one that cannot import here (no built C library, no mlx or cupy) is
# unavailable rather than an error of the package, and the CLI starts without loading any.

Array = Any     # a numpy array, mx.array or cupy array (mlx_open1b.arrays)

BACKENDS = ("cpu_ref", "metal", "cuda")
#: The memory model's backend (mlx_open1b.shape): shapes and allocations, no values. load() gives
#: it by name; it is not a training choice (not in BACKENDS, so the CLI refuses it).
SHAPE_ONLY = "shape"


class Backend(Protocol):
    """Every name a backend provides, grouped as CONTRACT.md orders the ops."""

    NAME: str       # the name load() knows it by

    # ------------------------------------------------------------------ the backend itself
    def available(self) -> tuple[bool, str]:
        """(True, what runs the kernels here) or (False, why this backend cannot run here)."""

    def contract_version(self) -> int:
        """The CONTRACT_VERSION the kernels implement (load refuses any other)."""

    def to_device(self, a: Array) -> Array:
        """The backend's array holding the values of host array a (mx.array on metal, cupy on a CUDA
        GPU, the numpy array itself on cpu_ref, spec and the emulated cuda); a device array as is."""

    def to_host(self, a: Array) -> Array:
        """A numpy array with the values of a (a itself when it is numpy; evaluates a lazy mx.array)."""

    # ------------------------------------------------------------------ §4 functions, §3 sqrt, div
    def exp(self, x: Array) -> Array:
        """x fp32, any shape -> fp32 of its shape: the contract's exp (§4) of every element."""

    def log(self, x: Array) -> Array:
        """x fp32 -> the contract's log (§4) of every element."""

    def sin(self, x: Array) -> Array:
        """x fp32 -> the contract's sin (§4) of every element."""

    def cos(self, x: Array) -> Array:
        """x fp32 -> the contract's cos (§4) of every element."""

    def sqrt(self, x: Array) -> Array:
        """x fp32 -> the contract's sqrt (§3, correctly rounded) of every element."""

    def rsqrt(self, x: Array) -> Array:
        """x fp32 -> the contract's rsqrt (§4) of every element."""

    def sigmoid(self, x: Array) -> Array:
        """x fp32 -> the contract's sigmoid (§4) of every element."""

    def silu(self, x: Array) -> Array:
        """x fp32 -> the contract's silu (§4) of every element."""

    def sqrt_int(self, x: Array) -> Array:
        """x fp32 -> sqrt by the contract's integer definition (§3), which equals sqrt."""

    def div_int(self, a: Array, b: Array) -> Array:
        """a, b fp32 of one shape -> div(a, b) elementwise by the contract's integer definition
        (§3), which equals div."""

    # ------------------------------------------------------------------ §2 conversions
    def f32_to_bf16(self, x: Array) -> Array:
        """x fp32, any shape -> bf16 of its shape: round to nearest even by integer arithmetic;
        NaN -> 0x7FC0; subnormals -> signed zero (§2)."""

    def bf16_to_f32(self, x: Array) -> Array:
        """x bf16, any shape -> fp32 of its shape: the 16 bits widened, then the load rule (§2)."""

    # ------------------------------------------------------------------ elementwise updates
    def add_inplace(self, a: Array, b: Array) -> None:
        """a, b fp32 of one shape: a += b elementwise (a is the lower-index operand of a fold), in
        place on a numpy or cupy a (an mx.array cannot be written in place: use add)."""

    def scale_inplace(self, a: Array, s: float) -> None:
        """a fp32: a *= s elementwise, s rounded to fp32 first, in place on a numpy or cupy a."""

    def add(self, a: Array, b: Array) -> Array:
        """add_inplace's a + b as a new array (a and b unchanged)."""

    def scale(self, a: Array, s: float) -> Array:
        """scale_inplace's a * s as a new array (a unchanged)."""

    # ------------------------------------------------------------------ §3 host scalars
    def scalar_add(self, a: float, b: float) -> float:
        """The contract's add (§3) of two values rounded to fp32, as a Python float."""

    def scalar_sub(self, a: float, b: float) -> float:
        """The contract's sub (§3) of two values rounded to fp32, as a Python float."""

    def scalar_mul(self, a: float, b: float) -> float:
        """The contract's mul (§3) of two values rounded to fp32, as a Python float."""

    def scalar_div(self, a: float, b: float) -> float:
        """The contract's div (§3) of two values rounded to fp32, as a Python float."""

    def scalar_sqrt(self, x: float) -> float:
        """The contract's sqrt (§3) of a value rounded to fp32, as a Python float."""

    # ------------------------------------------------------------------ §6.1 the linear layer
    def linear_forward(self, x: Array, w: Array) -> Array:
        """x (N, K) bf16, w (M, K) bf16 -> y = x W^T (N, M) fp32, each sum over k in the contract
        GEMM's order (§6.1)."""

    def linear_backward(self, dy: Array, x: Array, w: Array, need_dx: bool = True,
                        need_dw: bool = True, *, dw_out: Array | None = None) -> tuple[Array, Array]:
        """dy (N, M) bf16, x (N, K) bf16, w (M, K) bf16 -> dx = dy W (N, K) fp32 (sum over m),
        dw = dy^T x (M, K) fp32 (sum over n); None for one that is not needed. dw_out: None, or a
        writable C-contiguous (M, K) fp32 array of the kind dw would be (a view into the model's
        gradient buffer): dw is written there and it is returned as dw (the same bits; the C
        reference writes it in place, the others copy)."""

    # ------------------------------------------------------------------ §6.2-§6.5 layers
    def embedding_forward(self, tokens: Array, wte: Array) -> Array:
        """tokens (N,) int32 in [0, V), wte (V, C) bf16 -> out (N, C) fp32 (rows widened exactly)."""

    def embedding_backward(self, tokens: Array, dout: Array, V: int, *, dw_out: Array | None = None) -> Array:
        """tokens (N,) int32, dout (N, C) fp32 -> dwte (V, C) fp32: each row the sum of its
        positions' dout rows in ascending position; dw_out as linear_backward's, (V, C)."""

    def rmsnorm_forward(self, x: Array, g: Array | None, eps: float, bf16_out: bool = False) -> tuple[Array, Array]:
        """x (N, C) fp32, g (C,) bf16 or None (QK-norm: no gain), eps >= 0 rounded to fp32
        -> y (N, C) fp32, rstd (N,) fp32 (§6.3); bf16_out: y as bf16, as swiglu_forward's."""

    def rmsnorm_backward(self, dy: Array, x: Array, g: Array | None, rstd: Array) -> tuple[Array, Array | None]:
        """dy, x (N, C) fp32, g as in the forward, rstd (N,) from it -> dx (N, C) fp32, dg (C,) fp32
        (None without a gain)."""

    def rope_tables(self, T: int, D: int, theta: float) -> tuple[Array, Array]:
        """T positions, head dim D (even), theta > 1 rounded to fp32 -> cos, sin tables (T, D/2) fp32
        from the contract's exp, log, cos and sin (§6.4)."""

    def rope_forward(self, x: Array, cos: Array, sin: Array) -> Array:
        """x (B, T, R, D) fp32 (R heads), tables of at least T rows -> y (B, T, R, D) fp32: the
        rotate-half pairs (i, i + D/2) turned by the angle of position t."""

    def rope_backward(self, dy: Array, cos: Array, sin: Array) -> Array:
        """dy (B, T, R, D) fp32 -> dx (B, T, R, D) fp32: rope_forward's transpose."""

    def swiglu_forward(self, h: Array, bf16_out: bool = False) -> Array:
        """h (N, 2F) fp32 = [gate | up] -> out (N, F) fp32 = silu(gate) * up; with bf16_out, out as
        bf16: the bits of f32_to_bf16 of the fp32 out (the C reference converts rows while they are
        in cache; the others convert the output)."""

    def swiglu_backward(self, dout: Array, h: Array, bf16_out: bool = False) -> Array:
        """dout (N, F) fp32, h (N, 2F) fp32 from the forward -> dh (N, 2F) fp32 = [dgate | dup];
        bf16_out as swiglu_forward's."""

    # ------------------------------------------------------------------ §6.6, §6.10 attention
    def attention_forward(self, q: Array, k: Array, v: Array, window: int, scale: float) -> tuple[Array, Array]:
        """q (B,T,H,D) bf16, k and v (B,T,G,D) bf16 -> o (B,T,H,D) fp32, lse (B,H,T) fp32: causal
        grouped-query attention, key j visible to query i iff j <= i and (window == 0 or
        i - j < window), an online softmax over aligned 64-key blocks (§6.6). scale is rounded to
        fp32 (the caller passes e.g. 1/sqrt(D))."""

    def attention_forward_i8(self, q: Array, k: Array, v: Array, window: int, scale: float) -> tuple[Array, Array]:
        """As attention_forward, with each block's P·V product in int8 (§6.10): value rows quantized
        per key, the block's weights per query row, exact int32 accumulation."""

    def attention_backward(self, dout: Array, q: Array, k: Array, v: Array, o: Array, lse: Array,
                           window: int, scale: float) -> tuple[Array, Array, Array]:
        """dout (B,T,H,D) fp32; q, k, v, window and scale as in the forward; o and lse from it
        -> dq (B,T,H,D), dk (B,T,G,D), dv (B,T,G,D) fp32 (p recomputed from lse)."""

    # ------------------------------------------------------------------ §6.8 cross-entropy
    def xent_forward(self, h: Array, w: Array, targets: Array, zcoef: float,
                     keep: bool = False) -> tuple[Array, Array, Array] | tuple[Array, Array, Array, Any]:
        """h (N, C) bf16, w (V, C) bf16, targets (N,) int32 in [0, V), zcoef >= 0 rounded to fp32
        -> loss, lse, ce (N,) fp32: the logits z = h W^T (linear_forward's bits) XENT_CHUNK
        vocabulary entries at a time (held whole only to be kept, below); lse = logsumexp(z)
        online over the chunks, ce = lse - z[target], loss = ce + zcoef lse^2 per row (§6.8). The
        mean is the caller's.
        keep=True (a forward whose backward follows): a fourth result, `saved`, for xent_backward
        of the same h and w: what the backend kept of the forward to spare work there (cpu_ref:
        the logits, when they fit its budget), or None where it keeps nothing. No bit depends on it."""

    def xent_backward(self, h: Array, w: Array, targets: Array, zcoef: float, lse: Array,
                      dloss: Array, saved: Any = None, *, dw_out: Array | None = None) -> tuple[Array, Array]:
        """h, w, targets, zcoef as in the forward, lse (N,) from it, dloss (N,) fp32 (usually 1/N
        each) -> dh (N, C), dw (V, C) fp32; dz[n, v] = (softmax_v (1 + 2 zcoef lse) -
        [v == target]) dloss[n], rounded to bf16 for the two GEMMs. saved: None, or what
        xent_forward(h, w, ..., keep=True) returned for these h and w; dw_out as linear_backward's,
        (V, C)."""

    # ------------------------------------------------------------------ §6.7 AdamW, §7 reductions
    def adamw_step(self, p_: Array, g: Array, m: Array, v: Array, *, lr: float, beta1: float = 0.9,
                   beta2: float = 0.95, eps: float = 1e-8, weight_decay: float = 0.0, step: int) -> None:
        """One AdamW step (§6.7) in place on p_ (n,) bf16 and the moments m, v (n,) fp32, g (n,)
        fp32; step is 1-based; the kernel scalars are hostmath.adamw_scalars'. numpy or cupy
        buffers (mx.arrays: use adamw)."""

    def adamw(self, p_: Array, g: Array, m: Array, v: Array, *, lr: float, beta1: float = 0.9,
              beta2: float = 0.95, eps: float = 1e-8, weight_decay: float = 0.0,
              step: int) -> tuple[Array, Array, Array]:
        """adamw_step as new arrays -> (p, m, v) after the step (the inputs unchanged)."""

    def sumsq_blocks(self, x: Array) -> Array:
        """x fp32, any shape -> (ceil(size / NORM_BLOCK),) fp32: each NORM_BLOCK-element block's
        sum of squares of x flattened, in order (§7)."""

    def treefold(self, values: Array) -> float:
        """values (n,) fp32 -> their binary-carry tree fold (§7)."""

    def global_norm(self, tensors: Sequence[Array]) -> float:
        """One or more fp32 tensors in the canonical order -> sqrt of the tree fold of all their
        sumsq_blocks partials, joined in that order (§7)."""

    def clip_coef(self, norm: float, max_norm: float) -> float:
        """div(max_norm, add(norm, CLIP_EPS)) in fp32; the caller scales only when it is < 1 (§7)."""

    # ------------------------------------------------------------------ §5 random numbers
    def philox_blocks(self, seed: int, stream: int, index0: int, n: int, sub: int = 0) -> Array:
        """(n, 4) uint32: the Philox4x32-10 block at counter (seed, stream, index0 + i, sub) for
        i < n (seed and index0 64 bits, stream and sub 32 bits; index0 + i wraps mod 2^64)."""

    def trunc_normal(self, seed: int, stream: int, index0: int, n: int, sigma: float = INIT_SIGMA) -> Array:
        """(n,) fp32 truncated normal N(0, sigma^2) cut at +-2 sigma; element i is a pure function of
        (seed, stream, index0 + i) (§5)."""

    # ------------------------------------------------------------------ §6.9 the int8 linear layer
    def gemm_i8(self, a: Array, b: Array) -> Array:
        """a (I, P) int8, b (J, P) int8, levels in [-127, 127], P <= Q_MAX_P -> C = a b^T (I, J)
        int32, exactly."""

    def hadamard_rows(self, f: Array) -> Array:
        """f (R, C) fp32, R a multiple of QB -> a copy rotated along its rows by the Walsh-Hadamard
        transform in blocks of QB (unnormalized); f unchanged."""

    def quant_weight_rows(self, w: Array) -> tuple[Array, Array]:
        """w (M, K) bf16 -> q (M, K) int8, s (M,) fp32: per-output-row step sizes (§6.9)."""

    def quant_tensor(self, x: Array) -> tuple[Array, Any]:
        """x (any shape) bf16 or fp32 -> q (same shape) int8, s the fp32 per-tensor step size."""

    def qlinear_forward(self, x: Array, w: Array, qmax: int = QMAX) -> Array:
        """x (N, K) bf16, w (M, K) bf16 -> y (N, M) fp32 through int8 quantization (§6.9); qmax 31
        or 7: the simulated int6 or int4 path (levels -qmax ... qmax)."""

    def qlinear_backward(self, dy: Array, x: Array, w: Array, need_dx: bool = True, need_dw: bool = True,
                         qmax: int = QMAX, *, dw_out: Array | None = None) -> tuple[Array, Array]:
        """dy (N, M), x (N, K), w (M, K) bf16 -> dx (N, K), dw (M, K) fp32: the straight-through
        backward in int8 with the Hadamard rotation (§6.9); qmax as qlinear_forward, all four
        operands on levels -qmax ... qmax; None for one that is not needed; dw_out as
        linear_backward's."""


#: The functions of the interface, in the order above.
FUNCTIONS: tuple[str, ...] = tuple(n for n, v in vars(Backend).items() if not n.startswith("_") and callable(v))
#: The contract ops: every function but the backend's own four (the parity harness has a case
#: generator for each).
OPS: tuple[str, ...] = tuple(n for n in FUNCTIONS if n not in ("available", "contract_version", "to_device", "to_host"))
#: Every name a backend provides.
NAMES: tuple[str, ...] = ("NAME",) + FUNCTIONS


def signature(name: str) -> inspect.Signature:
    """The interface's signature of a function `name`, as a module function has it (no self)."""
    sig = inspect.signature(getattr(Backend, name))
    return sig.replace(parameters=list(sig.parameters.values())[1:])


# ---------------------------------------------------------------------------------- the loader
class BackendUnavailable(TrainError):
    """A backend that cannot run here: unknown, not built, no device and no emulator, another
    contract. The message says which and why; `reason` is the why alone (what `open1b info` shows)."""

    def __init__(self, message: str, reason: str | None = None, exit_code: int = 2):
        super().__init__(message, exit_code)
        self.reason = message if reason is None else reason


def _unavailable(name: str, reason: str) -> BackendUnavailable:
    return BackendUnavailable(f"backend {name!r} is not available here: {reason}", reason)


_WARNED: set = set()


def _warn_once(message: str) -> None:
    """One line on stderr, once per process (resolve runs for every command and worker)."""
    if message not in _WARNED:
        _WARNED.add(message)
        print(f"warning: {message}", file=sys.stderr)


def on_device(name: str) -> bool:
    """Whether backend `name` runs its kernels on a device here: metal on a Metal GPU, cuda on a CUDA
    GPU that compiled and ran the probe kernel (neither on its CPU emulator); cpu_ref always."""
    try:
        if name == "metal":
            from .metal import runtime as metal_runtime
            return bool(metal_runtime.real_metal())
        if name == "cuda":
            from .cuda import runtime as cuda_runtime
            return bool(cuda_runtime.real_cuda())
    except Exception:   # noqa: BLE001 - no usable runtime: not on a device
        return False
    return name == "cpu_ref"


def resolve(name: str) -> str:
    """A backend name, with 'auto' resolved: metal where MLX runs on a Metal GPU (Apple silicon),
    cuda where CuPy sees an NVIDIA GPU, cpu_ref elsewhere. Every backend gives the same bits, so
    'auto' picks the fastest hardware, never a different result. (The emulators are never chosen
    automatically: they are for testing.)"""
    if name != "auto":
        return name
    if on_device("metal"):
        try:
            from .metal import runtime as metal_runtime
            ok, why = metal_runtime.available()
        except Exception as e:   # noqa: BLE001 - an MLX that fails: try the next
            ok, why = False, f"{type(e).__name__}: {e}"
        if ok:
            return "metal"
        _warn_once(f"--backend auto does not use the Metal GPU: {why}")
    if on_device("cuda"):
        return "cuda"
    return "cpu_ref"


def _cpu_ref():
    try:
        from . import cpu_ref
    except ImportError as e:            # the C library is not built
        raise _unavailable("cpu_ref", str(e)) from None
    return cpu_ref


def _gpu_ops(name: str):
    """The ops module of metal or cuda, when it imports and says it can run here (on the device or
    its CPU emulator)."""
    try:
        if name == "metal":
            from .metal import ops
        else:
            from .cuda import ops
    except Exception as e:   # noqa: BLE001 - any import failure makes the backend unavailable
        raise _unavailable(name, f"mlx_open1b.{name}.ops cannot be imported ({type(e).__name__}: {e})") from None
    ok, why = ops.available()
    if not ok:
        raise _unavailable(name, why)
    return ops


def load(name: str):
    """The backend `name` ('auto': resolve's pick): its module, once it imports, says it can run
    here and implements this package's contract; else BackendUnavailable saying why."""
    name = resolve(name)
    if name == SHAPE_ONLY:
        from .shape import ops as shape_ops
        return shape_ops.load()
    if name not in BACKENDS:
        raise BackendUnavailable(f"unknown backend {name!r} (backends: {', '.join(BACKENDS)})")
    b = _cpu_ref() if name == "cpu_ref" else _gpu_ops(name)
    if b.contract_version() != CONTRACT_VERSION:
        raise _unavailable(name, f"it implements contract v{b.contract_version()}, this package v{CONTRACT_VERSION}; "
                                 "rebuild with `pip install -e .`")
    return b


def _no_device(name: str) -> str:
    """Why a backend that loads runs on its emulator here (what is missing for the device)."""
    if name == "metal":
        try:
            import mlx.core  # noqa: F401
        except ImportError:
            return "mlx not installed (pip install 'mlx-open1b[metal]')"
        return "mlx installed, no Metal device"
    from .cuda import runtime as cuda_runtime
    why = cuda_runtime.cuda_status()[1]
    return "cupy not installed (pip install 'mlx-open1b[cuda]')" if why.startswith("cupy is not importable") else why


def status() -> list[tuple[str, str, str]]:
    """(name, 'available' | 'emulated' | 'unavailable', detail) of every backend: what runs it, why
    it runs emulated (the kernel sources on the CPU: bit-identical, slow), or why it cannot run."""
    rows = []
    for name in BACKENDS:
        try:
            b = load(name)
        except BackendUnavailable as e:
            rows.append((name, "unavailable", e.reason))
            continue
        if on_device(name):
            rows.append((name, "available", b.available()[1]))
        else:
            rows.append((name, "emulated", _no_device(name)))
    return rows
