"""The stack switch of both emulators' fibers (fiber_switch.h), pasted before each one's prelude:
x86-64 Linux switches stacks in a few instructions, anything else (or EMU_UCONTEXT) uses ucontext."""
from __future__ import annotations

import pathlib

PATH = pathlib.Path(__file__).resolve().parent / "fiber_switch.h"


def switch_text(ucontext: bool = False) -> str:
    """fiber_switch.h with #line markers; ucontext: define EMU_UCONTEXT first (swapcontext fibers)."""
    return ("#define EMU_UCONTEXT 1\n" if ucontext else "") + f'#line 1 "emu/fiber_switch.h"\n{PATH.read_text()}\n'
