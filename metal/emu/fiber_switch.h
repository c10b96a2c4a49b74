/* fiber_switch.h — the stack switch of both emulators' fibers (the Metal emulator's threads of a
 * threadgroup, the CUDA emulator's threads of a block), pasted before each one's prelude.
 *
 * On x86-64 Linux, unless EMU_UCONTEXT is defined, fibers switch with a 15-instruction stack
 * switch: glibc's swapcontext makes a sigprocmask system call per switch, which dominates
 * barrier-heavy kernels (the tiled GEMMs, the Hadamard rotation). Elsewhere, or with EMU_UCONTEXT,
 * the preludes use ucontext's swapcontext. Both run the same fibers in the same order, so no
 * result depends on which one switches. The switch carries the callee-saved general registers
 * only, not the floating-point control state (MXCSR, the x87 control word): no fiber changes it
 * (the Metal launcher sets MXCSR once per launch, before its fibers start; the CUDA emulator
 * flushes in software).
 */
#ifndef O1B_EMU_FIBER_SWITCH_H
#define O1B_EMU_FIBER_SWITCH_H
#if defined(__x86_64__) && defined(__linux__) && !defined(EMU_UCONTEXT)
#define EMU_FAST_SWITCH 1
#include <cstddef>
#include <cstdint>
/* Saves the callee-saved registers on the current stack, stores its pointer in *save_sp, and
 * continues on new_sp (a stack that emu_switch saved, or one prepared by emu_prepare). */
extern "C" void emu_switch(void **save_sp, void *new_sp);
__asm__(".text\n.p2align 4\n.hidden emu_switch\n.globl emu_switch\n.type emu_switch,@function\n"
        "emu_switch:\n"
        "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
        "  movq %rsp, (%rdi)\n  movq %rsi, %rsp\n"
        "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n  ret\n"
        ".size emu_switch, .-emu_switch\n");

/* A fresh stack of `size` bytes at `stack` that emu_switch "returns" into entry from, aligned as
 * after a call. entry must never return: it ends by switching away for good. */
static void *emu_prepare(char *stack, size_t size, void (*entry)(void)) {
    uintptr_t top = ((uintptr_t)(stack + size)) & ~(uintptr_t)15;
    void **sp = (void **)top;
    *--sp = 0;                                    /* fake return address of entry */
    *--sp = (void *)entry;                        /* emu_switch's ret */
    for (int r = 0; r < 6; r++) *--sp = 0;        /* rbp rbx r12 r13 r14 r15 */
    return (void *)sp;
}
#endif
/* Which switch this library's fibers use (1: the stack switch, 0: ucontext), for the tests. */
extern "C" int o1b_emu_fast_switch(void) {
#ifdef EMU_FAST_SWITCH
    return 1;
#else
    return 0;
#endif
}
#endif
