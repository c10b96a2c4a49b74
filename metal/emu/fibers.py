"""The stack switch of both emulators' fibers (fiber_switch.h), pasted before each one's prelude:
x86-64 Linux switches stacks in a few instructions, anything else (or O1B_EMU_UCONTEXT=1) uses
ucontext."""
from __future__ import annotations

import os
import pathlib

PATH = pathlib.Path(__file__).resolve().parent / "fiber_switch.h"


def ucontext_from_env() -> bool:
    """Whether the environment asks for ucontext fibers in both emulators (O1B_EMU_UCONTEXT=1: the
    same schedule and results; for tests, and for a host where the stack switch is suspect)."""
    return os.environ.get("O1B_EMU_UCONTEXT") == "1"


def switch_text(ucontext: bool = False) -> str:
    """fiber_switch.h with #line markers; ucontext: define EMU_UCONTEXT first (swapcontext fibers)."""
    return ("#define EMU_UCONTEXT 1\n" if ucontext else "") + f'#line 1 "emu/fiber_switch.h"\n{PATH.read_text()}\n'
