"""Who loads which window: optimizer steps -> window ranges -> microbatches -> workers.

A step's global batch is M microbatches of `microbatch_windows` consecutive windows; step t
takes the next M * microbatch_windows windows of the canonical stream. Worker r of R owns the
contiguous microbatch range [floor(M r / R), floor(M (r+1) / R)) (DESIGN §5: contiguous ranges
fold locally as aligned blocks). Changing R changes only who loads a window, never which
windows a step has or their order.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .format import DataError
from .stream import Stream


@dataclass(frozen=True)
class Schedule:
    microbatch_windows: int                   # sequences per microbatch
    microbatches: int                         # M for steps before the first phase change
    phases: tuple[tuple[int, int], ...] = field(default_factory=tuple)   # (from_step, M), ascending

    def __post_init__(self):
        if self.microbatch_windows < 1 or self.microbatches < 1:
            raise DataError("schedule: microbatch_windows and microbatches must be >= 1")
        steps = [s for s, _ in self.phases]
        if steps != sorted(steps) or any(m < 1 for _, m in self.phases):
            raise DataError(f"schedule: phases must be ascending by step with M >= 1, got {self.phases}")

    def microbatches_at(self, step: int) -> int:
        m = self.microbatches
        for start, mm in self.phases:
            if step >= start:
                m = mm
        return m

    def step_windows(self, step: int) -> range:
        """The window indices of optimizer step `step` (0-based)."""
        start, prev_step, prev_m = 0, 0, self.microbatches
        for phase_step, m in self.phases:            # whole phases before `step`
            if phase_step >= step:
                break
            start += (phase_step - prev_step) * prev_m * self.microbatch_windows
            prev_step, prev_m = phase_step, m
        start += (step - prev_step) * prev_m * self.microbatch_windows
        n = self.microbatches_at(step) * self.microbatch_windows
        return range(start, start + n)

    def microbatch_windows_of(self, step: int, i: int) -> range:
        w = self.step_windows(step)
        mb = self.microbatch_windows
        if not 0 <= i < len(w) // mb:
            raise DataError(f"schedule: step {step} has {len(w) // mb} microbatches, asked for {i}")
        return range(w.start + i * mb, w.start + (i + 1) * mb)


def worker_microbatches(M: int, rank: int, world: int) -> range:
    """The contiguous microbatch range of worker `rank` of `world`."""
    if not 0 <= rank < world:
        raise DataError(f"rank {rank} is outside [0, {world})")
    return range(M * rank // world, M * (rank + 1) // world)


class WorkerLoader:
    """The windows one worker loads, step by step; it walks the whole stream (lengths only where
    the windows belong to other workers), so its stream state is the global one."""

    def __init__(self, stream: Stream, schedule: Schedule, rank: int = 0, world: int = 1, step: int = 0):
        self.stream, self.schedule, self.rank, self.world, self.step = stream, schedule, rank, world, step
        first = schedule.step_windows(step).start
        if stream.windows_emitted != first:
            raise DataError(f"worker loader: stream is at window {stream.windows_emitted}, step {step} starts at {first}")

    def next_step(self) -> dict[int, np.ndarray]:
        """{microbatch index: (microbatch_windows, seq_len + 1) uint32} for this worker's microbatches."""
        M = self.schedule.microbatches_at(self.step)
        mb = self.schedule.microbatch_windows
        mine = worker_microbatches(M, self.rank, self.world)
        out = {}
        self.stream.skip(mine.start * mb)
        for i in mine:
            out[i] = self.stream.next_windows(mb)
        self.stream.skip((M - mine.stop) * mb)
        self.step += 1
        return out
