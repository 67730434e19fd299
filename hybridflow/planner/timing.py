"""The timer the planner's measurements share (``calibrate``, ``profile``, ``overhead``)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def timed_median(fn: Callable[[], object], sync: Callable[[], None], *, warmup: int,
                 repeats: int, inner: int) -> float:
    """Median seconds per call of ``fn`` over ``repeats`` samples of ``inner`` calls each."""
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)


def collective_times(op: Callable[[], object], sync: Callable[[], None],
                     barrier: Callable[[], None], *, warmup: int, repeats: int) -> list[float]:
    """One rank's seconds per call of the collective ``op`` over ``repeats`` iterations after
    ``warmup``: each iteration starts when every rank has passed ``barrier`` with its device idle,
    and ends when its device is done."""
    times = []
    for _ in range(warmup + repeats):
        sync()
        barrier()
        sync()  # a barrier on NCCL is itself device work
        start = time.perf_counter()
        op()
        sync()
        times.append(time.perf_counter() - start)
    return times[warmup:]


def slowest_median(per_rank: list[list[float]]) -> float:
    """The median over iterations of the slowest rank's seconds (``collective_times`` of every
    rank): an iteration of a collective lasts as long as its slowest rank."""
    return statistics.median(map(max, zip(*per_rank)))
