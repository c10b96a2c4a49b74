// prelude.h — maps the subset of the Metal Shading Language that mlx-open1b's kernels use onto
// C++, so that the exact kernel source text (contract.metal + a kernel body + the signature that
// mx.fast.metal_kernel writes) compiles with g++ and runs on the CPU (DESIGN.md §4).
//
// What is mapped, and nothing else (a kernel that uses anything else fails to compile here):
//   - scalar types uint, ushort, ulong, uchar, half-free; vector types uint2, uint3 (.x .y .z)
//   - address-space qualifiers device, constant, thread: empty; `threadgroup` declares storage
//     shared by the threads of one threadgroup (groups run one after another, so a function-level
//     static is exactly that storage). Use it only to declare arrays in a kernel body.
//   - threadgroup_barrier(mem_flags::...): a faithful barrier. When a kernel's text contains it,
//     the threads of a group run as cooperative fibers (one stack each; fiber_switch.h), scheduled
//     round robin; each runs until it reaches the barrier or returns, and no thread passes a
//     barrier before every thread of its group has reached it. A thread that returns while
//     others wait at a barrier is reported as "barrier divergence".
//   - as_type<T>(x) (bit cast), select(a, b, c)
// Floating point: compiled with -O2 -ffp-contract=off -fno-fast-math (SSE2 binary32, no FMA).
#ifndef O1B_EMU_PRELUDE_H
#define O1B_EMU_PRELUDE_H
#define O1B_EMU 1
#if defined(__APPLE__) && !defined(_XOPEN_SOURCE)
#define _XOPEN_SOURCE 700   // macOS keeps the ucontext routines behind this
#endif

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <cstdio>
#include <ucontext.h>
#include <sys/mman.h>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>    // the launcher's MXCSR (flush-to-zero mode); before `double` is poisoned
#endif
#ifndef MAP_NORESERVE
#define MAP_NORESERVE 0
#endif

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned long ulong;
typedef unsigned char uchar;

struct uint2 {
    uint x, y;
    uint2() : x(0), y(0) {}
    uint2(uint a, uint b) : x(a), y(b) {}
};
struct uint3 {
    uint x, y, z;
    uint3() : x(0), y(0), z(0) {}
    uint3(uint a, uint b, uint c) : x(a), y(b), z(c) {}
};

#define device
#define constant
#define thread
#define threadgroup static

template <typename T, typename U>
inline T as_type(U u) {
    static_assert(sizeof(T) == sizeof(U), "as_type: sizes differ");
    T t;
    std::memcpy(&t, &u, sizeof(T));
    return t;
}
template <typename T>
inline T select(T a, T b, bool c) { return c ? b : a; }

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };

namespace o1b_emu {
enum { RUNNABLE = 0, AT_BARRIER = 1, DONE = 2 };
struct Fiber {
    void *sp;                     // EMU_FAST_SWITCH (fiber_switch.h): the saved stack
    ucontext_t ctx;               // otherwise
    int state;
    uint3 tpitg;
    uint tiitg;
};
static ucontext_t sched;
static void *sched_sp = nullptr;
static Fiber *fibers = nullptr;
static int cur = -1;
static bool fiber_mode = false;
static char errbuf[512];
static int failed = 0;

inline void fail(const char *msg) {
    if (!failed) { std::snprintf(errbuf, sizeof errbuf, "%s", msg); failed = 1; }
}
}  // namespace o1b_emu

inline void threadgroup_barrier(mem_flags) {
    using namespace o1b_emu;
    if (!fiber_mode || cur < 0) { fail("threadgroup_barrier outside fiber mode"); return; }
    Fiber &f = fibers[cur];
    f.state = AT_BARRIER;
#ifdef EMU_FAST_SWITCH
    emu_switch(&f.sp, sched_sp);
#else
    swapcontext(&f.ctx, &sched);
#endif
}

#endif
