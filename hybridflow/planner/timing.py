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
