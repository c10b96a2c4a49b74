"""The emulated GPU's fp32 unit, shared by the Metal and the CUDA emulator: planted faults and the
adversarial flush mode (hwfloat.h holds the C++ side and says exactly what each mode does).

Each emulator has one `Setting` (module-level state) and exposes its `context` as
`emu.hardware(fault=None, adversarial_flush=False, seed=0)`:

- `fault`: None, or one of FAULTS — "div_rz" (fp32 division rounds toward zero), "fma" (a multiply
  feeding an add is contracted into one fused multiply-add), "flush_unsigned" (every tiny result
  comes back as +0 whatever its sign);
- `adversarial_flush`: every fp32 add/sub/mul/div result whose exact value is nonzero and below
  2^-126 in magnitude comes back as the IEEE value, +0 or -0, chosen pseudo-randomly per operation;
- `seed`: picks the adversary's choices (0 <= seed < 2^64).

Launches inside the block run on that hardware; fault and mode are compiled into the library (they
are part of its text, hence of its cache key), the seed is set at each launch. Outside any block
the hardware is the plain one, or the adversarial one with seed $O1B_EMU_ADVERSARIAL_SEED (default
0) where the environment variable O1B_EMU_ADVERSARIAL=1, so a whole test suite can run under it.
Blocks nest; the innermost one applies.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import threading

HWFLOAT_PATH = pathlib.Path(__file__).resolve().parent / "hwfloat.h"
FAULTS = ("div_rz", "fma", "flush_unsigned")        # their numbers in hwfloat.h: index + 1


@dataclasses.dataclass(frozen=True)
class Hardware:
    fault: str | None = None
    adversarial_flush: bool = False
    seed: int = 0

    @property
    def active(self) -> bool:
        """False for the plain hardware (the emulators then compile exactly what they always did)."""
        return self.fault is not None or self.adversarial_flush

    def defines(self) -> str:
        """The compile-time part, as #define lines (empty for the plain hardware)."""
        if not self.active:
            return ""
        fault = 0 if self.fault is None else FAULTS.index(self.fault) + 1
        return (f"#define O1B_HW_FAULT {fault}\n"
                f"#define O1B_HW_ADVERSARIAL {int(self.adversarial_flush)}\n")


def hwfloat_text() -> str:
    return f'#line 1 "emu/hwfloat.h"\n{HWFLOAT_PATH.read_text()}\n'


def _from_environment() -> Hardware:
    if os.environ.get("O1B_EMU_ADVERSARIAL") != "1":
        return Hardware()
    raw = os.environ.get("O1B_EMU_ADVERSARIAL_SEED", "0")
    try:
        seed = int(raw, 0)
    except ValueError:
        raise ValueError(f"O1B_EMU_ADVERSARIAL_SEED: expected an integer, got {raw!r}") from None
    return Hardware(adversarial_flush=True, seed=_check_seed(seed, "O1B_EMU_ADVERSARIAL_SEED"))


def _check_seed(seed, what: str) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 64:
        raise ValueError(f"{what}: expected an integer in [0, 2^64), got {seed!r}")
    return seed


class Setting:
    """The hardware that launches run on: the innermost active `context`, else the environment's."""

    def __init__(self):
        self._lock = threading.Lock()
        self._stack: list[Hardware] = []

    def current(self) -> Hardware:
        with self._lock:
            if self._stack:
                return self._stack[-1]
        return _from_environment()

    @contextlib.contextmanager
    def context(self, fault: str | None = None, adversarial_flush: bool = False, seed: int = 0):
        if fault is not None and fault not in FAULTS:
            raise ValueError(f"hardware fault: expected None or one of {', '.join(FAULTS)}, got {fault!r}")
        hw = Hardware(fault, bool(adversarial_flush), _check_seed(seed, "hardware seed"))
        with self._lock:
            self._stack.append(hw)
        try:
            yield hw
        finally:
            with self._lock:                 # remove this block's entry (blocks may end out of order
                for i in range(len(self._stack) - 1, -1, -1):    # across threads)
                    if self._stack[i] is hw:
                        del self._stack[i]
                        break
