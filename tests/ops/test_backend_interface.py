"""Every backend against the interface written once (mlx_open1b/backend.py): the same names, the
same signatures (parameter names, kinds and defaults), so the core calls every op on every backend
without probing; and the one loader's answers and errors."""
from __future__ import annotations

import inspect
import types

import pytest

from mlx_open1b import backend
from mlx_open1b.parity import OPS as PARITY_OPS
from mlx_open1b.parity import backends as parity_backends
from mlx_open1b.parity import spec_backend

from helpers import loadable_backends


def _params(sig: inspect.Signature) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


def problems(module) -> list[str]:
    """What module lacks or gets wrong of the interface, one line each."""
    out = []
    if not isinstance(getattr(module, "NAME", None), str):
        out.append("NAME: missing or not a str")
    for name in backend.FUNCTIONS:
        fn = getattr(module, name, None)
        if not callable(fn):
            out.append(f"{name}: missing")
            continue
        want, got = _params(backend.signature(name)), _params(inspect.signature(fn))
        if got != want:
            out.append(f"{name}: parameters {got}, the interface's {want}")
    return out


LOADED = loadable_backends()


@pytest.mark.parametrize("name,module", LOADED, ids=[n for n, _ in LOADED])
def test_backend_has_every_name_with_the_interface_signature(name, module):
    assert problems(module) == []
    assert module.NAME == name
    ok, how = module.available()
    assert ok and isinstance(how, str) and how


def test_cpu_ref_and_both_emulators_load_here():
    """The emulators run on any machine with g++: metal and cuda load here, so the check above runs
    on every backend (a skip would hide a missing name)."""
    assert [n for n, _ in LOADED] == ["cpu_ref", "metal", "cuda", "spec"]


def test_a_missing_name_or_another_signature_is_found():
    """The check itself: a backend with one op missing, one default changed, one keyword-only
    parameter made positional, and no NAME, is reported on each."""
    fake = types.ModuleType("fake")
    for name in backend.FUNCTIONS:
        setattr(fake, name, getattr(spec_backend, name))
    del fake.gemm_i8
    fake.trunc_normal = lambda seed, stream, index0, n, sigma=0.5: None
    fake.adamw_step = lambda p_, g, m, v, lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, step=1: None
    found = problems(fake)
    assert [line.split(":")[0] for line in found] == ["NAME", "adamw_step", "trunc_normal", "gemm_i8"], found
    assert "missing" in found[3] and "0.5" in found[2] and "KEYWORD_ONLY" in found[1]


def test_the_interface_ops_are_the_parity_ops():
    """Every contract op of the interface has a parity case generator, and every parity op is an
    interface op or a VARIANT of one."""
    variants = parity_backends.VARIANTS
    assert set(backend.OPS) == set(PARITY_OPS) - set(variants)
    assert {base for base, _ in variants.values()} <= set(backend.OPS)
    assert set(backend.NAMES) == {"NAME", "available", "contract_version", "to_device", "to_host", *backend.OPS}


def test_every_interface_function_is_documented():
    for name in backend.FUNCTIONS:
        assert (getattr(backend.Backend, name).__doc__ or "").strip(), name


def test_loader_answers_and_errors(monkeypatch):
    from mlx_open1b import cpu_ref
    from mlx_open1b.step import TrainError
    assert backend.load("cpu_ref") is cpu_ref
    with pytest.raises(backend.BackendUnavailable, match=r"unknown backend 'nosuch' \(backends: cpu_ref, metal, cuda\)") as e:
        backend.load("nosuch")
    assert e.value.exit_code == 2 and isinstance(e.value, TrainError)
    # a backend whose kernels implement another contract is refused, naming both versions
    monkeypatch.setattr(cpu_ref, "contract_version", lambda: 0)
    with pytest.raises(backend.BackendUnavailable, match=r"backend 'cpu_ref' is not available here: it implements "
                                                          r"contract v0, this package v1") as e:
        backend.load("cpu_ref")
    assert e.value.reason.startswith("it implements contract v0") and e.value.exit_code == 2
    rows = dict((n, (s, d)) for n, s, d in backend.status())
    assert rows["cpu_ref"] == ("unavailable", e.value.reason)
    monkeypatch.undo()
    # one whose ops do not import says so
    import builtins
    real_import = builtins.__import__

    def no_cuda_ops(name, globals=None, locals=None, fromlist=(), level=0):
        if fromlist and "ops" in fromlist and name in ("cuda", "mlx_open1b.cuda"):
            raise ImportError("planted")
        return real_import(name, globals, locals, fromlist, level)
    monkeypatch.setattr(builtins, "__import__", no_cuda_ops)
    with pytest.raises(backend.BackendUnavailable, match=r"backend 'cuda' is not available here: "
                                                          r"mlx_open1b.cuda.ops cannot be imported \(ImportError: planted\)"):
        backend.load("cuda")
