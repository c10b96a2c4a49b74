"""The model program run once per shape and replayed after: what keeps a step of the open1b preset
(hundreds of microbatches, thousands of allocations each) within seconds.

On shape arrays nothing depends on a value, so every call of Model.loss_and_grad with the same
parameter and window shapes and the same precision paths allocates and frees the same buffers in
the same order. `ReplayedProgram` (installed as a trainer's model.loss_and_grad) runs the real
program at its first call (which sets the model up: the RoPE tables on the device) and the first
time a key is seen after that, recording the ledger's events (shared by every simulated worker of
the process); after that a call applies the recording: the traffic it counted, the
highest point its live bytes reached above where they started on each place (and which buffers
made that point: the model Cache's arrays are "activations"), and the one buffer it returns, the
gradient. The code around the call — the folds, the
reducer, the collectives, the optimizer, the hashes — runs for real at every microbatch.

tests/train/test_memory_model.py checks that a replayed step measures exactly what the real one does.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from . import array as xp
from .ledger import DEVICE, HOST, Alloc, cache_arrays, current


@dataclass
class Recording:
    high: dict           # {place: (bytes above the start at the highest point, [Alloc live there], path)}
    counts: list         # [(key, bytes)] traffic
    result: tuple        # the gradient's (shape, dtype, site)
    scalars: tuple       # (loss, ce, zloss)


_recordings: dict = {}
_lock = threading.Lock()


def _summarize(trace, activations: set) -> tuple[dict, list]:
    live: dict[int, Alloc] = {}
    level = {DEVICE: 0, HOST: 0}
    high = {DEVICE: (0, [], ""), HOST: (0, [], "")}
    counts = []
    for ev in trace:
        if ev[0] == "alloc":
            _, serial, n, place, tag, site, where = ev
            tag = "activations" if serial in activations and tag is None else tag
            live[serial] = Alloc(n, place, tag, site)
            level[place] += n
            if level[place] > high[place][0]:
                high[place] = (level[place], [a for a in live.values() if a.place == place], where)
        elif ev[0] == "free":
            a = live.pop(ev[1], None)
            if a is not None:
                level[a.place] -= a.nbytes
        else:
            counts.append((ev[1], ev[2]))
    return high, counts


class ReplayedProgram:
    """model.loss_and_grad, recorded on the first call of each key and replayed after."""

    def __init__(self, model):
        self.model = model
        self.program = type(model).loss_and_grad.__get__(model)
        self.warm = False

    def _key(self, params, windows):
        m = self.model
        return (type(m), m.cfg, m.precision, tuple(sorted(m.paths.items())), m.recompute_gate_up, m.recompute_blocks,
                tuple(params.shape), tuple(windows.shape))

    def __call__(self, params, windows):
        if not self.warm:                      # the first call sets the model up (RoPE tables): real
            self.warm = True
            return self.program(params, windows)
        key = self._key(params, windows)
        rec = _recordings.get(key)
        if rec is None:
            with _lock:
                rec = _recordings.get(key)
                if rec is None:
                    return self._record(key, params, windows)
        return self._replay(rec)

    def _record(self, key, params, windows):
        led, m = current(), self.model
        cache_serials: set = set()
        backward = type(m)._backward.__get__(m)

        def spy(params_, cache):              # the Cache's arrays: what the backward reads
            for a in cache_arrays(cache):
                cache_serials.add(a._buf.serial)
            return backward(params_, cache)

        led.trace, m._backward = [], spy
        try:
            out = self.program(params, windows)
            trace = led.trace
        finally:
            led.trace = None
            del m._backward
        g = out[3]
        high, counts = _summarize(trace, cache_serials)
        _recordings[key] = Recording(high, counts, (g.shape, g.dtype, led.live[g._buf.serial].site), out[:3])
        return out

    def _replay(self, rec: Recording):
        led = current()
        for k, n in rec.counts:
            led.count(k, n)
        for place, (high, allocs, where) in rec.high.items():
            if high:
                led.burst(place, high, allocs, where)
        shape, dtype, site = rec.result
        with led.tagged(site=site):
            g = xp.ShapeArray(shape, dtype)
        return (*rec.scalars, g)


def install(trainer, replay: bool = True) -> None:
    """Replay the trainer's model program (replay=False: run it for real at every call)."""
    if replay:
        trainer.model.loss_and_grad = ReplayedProgram(trainer.model)

