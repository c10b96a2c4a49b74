"""opargs.checked_ids: token ids the caller checked on the host are not read back by the ops, and
only the very arrays it names, for its bound, inside its context, are trusted."""
import numpy as np
import pytest

from mlx_open1b import opargs

V = 10


def _ids():
    # dev stands for the device copy; its bad entry shows whether an op checked it or trusted it
    return np.array([1, 2, 99], np.int32), np.array([1, 2, 3], np.int32)


def test_tokens_trust_only_the_named_array_and_bound_inside_the_context():
    dev, host = _ids()
    with pytest.raises(ValueError, match="outside"):
        opargs.tokens(dev, V)
    with opargs.checked_ids(V, (dev, host)):
        assert opargs.tokens(dev, V) is dev
        assert opargs.host_ids(dev) is host
        with pytest.raises(ValueError, match="outside"):
            opargs.tokens(dev.copy(), V)             # equal values, another array: checked
        with pytest.raises(ValueError, match="outside"):
            opargs.tokens(dev, 50)                   # another bound: checked
    with pytest.raises(ValueError, match="outside"):
        opargs.tokens(dev, V)                        # after the context: checked again
    assert opargs.host_ids(dev) is not host


def test_xent_targets_trusted_inside_the_context_only():
    dev, host = _ids()
    h = np.zeros((3, 4), np.uint16)
    w = np.zeros((V, 4), np.uint16)
    with pytest.raises(ValueError, match="targets"):
        opargs.xent_forward(h, w, dev, 0.0)
    with opargs.checked_ids(V, (dev, host)):
        assert opargs.xent_forward(h, w, dev, 0.0)[:3] == (3, 4, V)
    with pytest.raises(ValueError, match="targets"):
        opargs.xent_forward(h, w, dev, 0.0)
