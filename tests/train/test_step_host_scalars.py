"""The step's scalar work on host values (the means over microbatches, the global norm from the
partials already on the host, the clip coefficient) runs the C reference's contract ops on the
host: none of it goes to the backend, where each call would be a launch and a blocking read."""
import collections

import pytest

from mlx_open1b.train import Trainer

from data_helpers import MICRO_MIX, make_corpus
from runs import micro_cfg


class CountingOps:
    def __init__(self, ops, calls):
        self._ops, self._calls = ops, calls

    def __getattr__(self, name):
        fn = getattr(self._ops, name)
        if not callable(fn):
            return fn

        def call(*args, **kwargs):
            self._calls[name] += 1
            return fn(*args, **kwargs)
        return call


def test_step_folds_host_scalars_without_the_backend(tmp_path):
    make_corpus(tmp_path / "corpus", MICRO_MIX)
    tr = Trainer(tmp_path / "run", micro_cfg(), tmp_path / "corpus")
    calls = collections.Counter()
    tr.ops = CountingOps(tr.ops, calls)
    tr.train(2)
    assert calls["sumsq_blocks"] > 0 and calls["adamw_step"] > 0, dict(calls)   # the proxy is in use
    assert not {"treefold", "scalar_sqrt", "scalar_mul", "clip_coef", "global_norm"} & set(calls), dict(calls)
