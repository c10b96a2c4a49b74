"""`open1b parity fuzz`: cases drawn for a time, every op given the same time, each compared bit for
bit; a mismatch is printed with the command that reproduces it, and that command does."""
import types

import numpy as np
from click.testing import CliRunner

from mlx_open1b import parity
from mlx_open1b.cli.main import cli
from mlx_open1b.parity.fuzz import fuzz


def test_cpu_ref_and_spec_agree_for_a_few_seconds():
    rep = fuzz(["cpu_ref", "spec"], ["add", "rmsnorm_forward", "exp"], seconds=3, seed=11)
    assert rep.ok and rep.mismatches == [] and all(r.cases > 0 for r in rep.ops.values())
    assert rep.cases == sum(r.cases for r in rep.ops.values()) and rep.seconds >= 3


def _one_ulp_off(op: str):
    """cpu_ref with `op` wrong in the last bit of its first output element (only for inputs whose
    first element is above 1, so that the fuzzer must look for it)."""
    cpu = parity.load("cpu_ref")
    real = getattr(cpu, op)

    def wrong(*a, **k):
        out = real(*a, **k)
        x = np.asarray(a[0])
        if x.size and x.reshape(-1)[0] > 1:
            o = np.array(out, copy=True)
            o.reshape(-1).view(np.uint32)[0] ^= 1
            return o
        return out
    ns = types.SimpleNamespace(**{name: getattr(cpu, name) for name in dir(cpu) if not name.startswith("_")})
    setattr(ns, op, wrong)
    return ns


def test_a_planted_mismatch_is_found_and_its_reproducer_reproduces_it():
    parity.register("faulty", _one_ulp_off("exp"))
    try:
        res = CliRunner().invoke(cli, ["parity", "fuzz", "--seconds", "3", "--backends", "cpu_ref,faulty",
                                       "--ops", "exp,add", "--seed", "5"])
        assert res.exit_code == 1, res.output
        assert "MISMATCH exp:" in res.output and "no mismatch" not in res.output
        line = next(x for x in res.output.splitlines() if x.strip().startswith("reproduce: "))
        args = line.split("reproduce: open1b ")[1].split()
        assert args[:2] == ["parity", "run"] and "--ops" in args and "exp" in args
        again = CliRunner().invoke(cli, args)
        assert again.exit_code == 1 and "exp" in again.output, again.output
    finally:
        parity.unregister("faulty")
