"""How long each phase of a distributed run may take (Comm.phase's deadline), from its size.

A step's collectives meet within the collective timeout (--dist-timeout): every rank does the same
work between them. The other phases are longer and their length grows with the model: opening the
run (initialization by element range, or rank 0 reading and verifying the last checkpoint), a
checkpoint (every owner streams its moments to the writer, which writes and hashes ~10 bytes per
parameter) and held-out evaluation (a forward over the probe windows). Waiting ranks watch the
working ranks' heartbeats (a dead rank is reported within the collective timeout) and give up on a
live rank that does not finish within the phase's deadline: the collective timeout plus the phase's
size at a throughput floor, times `scale`. The error names the phase, the rank and the deadline.
"""
from __future__ import annotations

import dataclasses

CKPT_BYTES_PER_PARAM = 2 + 4 + 4        # bf16 parameters, f32 first and second moments


@dataclasses.dataclass(frozen=True)
class PhaseTimeouts:
    """collective: seconds a step's collective (and a rank's silent heartbeat) may take.
    bytes_per_s: the slowest rate assumed for bytes a phase writes, reads, hashes or sends.
    init_per_s: the slowest rate assumed for parameters initialized (truncated normals).
    eval_margin: held-out evaluation (a forward) may take this many times its tokens at the rank's
    measured training rate (a forward and a backward per token).
    scale: multiplies every size-derived part (a slow disk, a shared machine)."""
    collective: float = 120.0
    bytes_per_s: float = 20e6
    init_per_s: float = 2e6
    eval_margin: float = 3.0
    scale: float = 1.0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"phase timeouts: {f.name} must be a positive number, got {v!r}")

    def _of(self, seconds: float) -> float:
        return self.collective + self.scale * seconds

    def checkpoint(self, n_params: int) -> float:
        """Writing a checkpoint: the writer receives, writes and hashes it (twice: file and leaves)."""
        return self._of(2 * CKPT_BYTES_PER_PARAM * n_params / self.bytes_per_s)

    def opening(self, n_params: int, resume: bool) -> float:
        """Opening the run: rank 0 reads and verifies the last checkpoint (resume), or every rank
        initializes its range (a new run; the slowest rank's range counted as the whole)."""
        if resume:
            return self._of(3 * CKPT_BYTES_PER_PARAM * n_params / self.bytes_per_s)
        return self._of(n_params / self.init_per_s)

    def evaluation(self, tokens: int, tokens_per_s: float | None) -> float | None:
        """Held-out evaluation of `tokens` on a rank that trains at tokens_per_s (measured); None
        (heartbeats only) before anything is measured."""
        if not tokens_per_s or tokens_per_s <= 0:
            return None
        return self._of(self.eval_margin * tokens / tokens_per_s)
