"""The C reference's thread pool (cpu_ref/src/runtime.c): workers kept between calls, each side
spinning on the clock for a while before it sleeps. However long the spin (none: every call finds
the worker asleep and wakes it; longer than any gap: it never sleeps), parallel ops complete and give
the same bits as with the default, after gaps longer than the spin as without gaps."""
import threading
import time

import numpy as np

import mlx_open1b.cpu_ref as C
from mlx_open1b.cpu_ref import _lib, layers as CL, linear as CLin
from mlx_open1b.spec import arith as A

from helpers import assert_bits_equal


def test_results_and_wakeups_do_not_depend_on_the_spin():
    lib = _lib.lib
    default = lib.o1b_pool_spin_us()
    assert default > 0
    rng = np.random.default_rng(5)
    x = A.f32_to_bf16(rng.standard_normal((300, 200)).astype(np.float32))
    w = A.f32_to_bf16(rng.standard_normal((150, 200)).astype(np.float32))
    h = rng.standard_normal((4096, 64)).astype(np.float32)
    ops = lambda: (CLin.linear_forward(x, w), CL.rmsnorm_forward(h, None, 1e-6)[0])
    failure = []

    def calls():
        try:
            with C.settings(threads=2):
                want = ops()
                for spin in (0, 1, default, 10 ** 5):
                    lib.o1b_set_pool_spin_us(spin)
                    assert lib.o1b_pool_spin_us() == spin
                    for gap in (0.0, 0.003, 0.0):          # 3 ms: longer than the short spins
                        time.sleep(gap)
                        for a, b, what in zip(ops(), want, ("linear_forward", "rmsnorm_forward")):
                            assert_bits_equal(a, b, f"{what}, spin {spin} us, gap {gap} s")
                lib.o1b_set_pool_spin_us(-5)
                assert lib.o1b_pool_spin_us() == 0                 # a negative spin is none
        except BaseException as e:                                 # reported by the test below
            failure.append(e)
        finally:
            lib.o1b_set_pool_spin_us(default)

    t = threading.Thread(target=calls, daemon=True)    # a lost wake-up hangs it: fail, not hang
    t.start()
    t.join(timeout=60)
    assert not t.is_alive(), "a parallel call did not return within 60 s (a worker never woken?)"
    if failure:
        raise failure[0]
