"""Calls on different pools at the same time, and the timeline of every call.

``at_once(calls)`` runs a stage of independent calls (PPO after generation: old and reference
log-probs, values, scores): the calls of one pool one after another, in the order given (models
on one pool share its devices and take turns), the pools' lanes at the same time. With one lane
it is exactly a plain sequence of calls in the caller's thread.

``Timeline`` records the start and end of every call per pool: each step's ``timing/overlap_s``
(the time two or more pools were busy at once) and ``timing/idle_<pool>_s`` (the step's time a
pool was not busy), and a Chrome trace file (``timeline.json`` in the run folder, open it in
Perfetto or chrome://tracing) with a row per pool.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

DRIVER = "driver"
"""The lane of work the driver does itself (reward and cost functions)."""


@dataclass(frozen=True)
class Call:
    """One call of a stage: ``fn()`` on ``pool``; its result is keyed by ``name``."""

    name: str
    pool: str
    fn: Callable[[], Any]


def at_once(calls: list[Call]) -> dict[str, Any]:
    """The results of ``calls`` by name: a lane per pool, each running its calls in order, the
    lanes at the same time. One lane runs in the caller's thread, the driver's where there is
    one (SIGTERM, SIGINT and a reward function's time limit reach the main thread only); an
    error in it, or in a lane it then waits for, is raised at once, leaving the other lanes'
    calls to end with their groups (``Groups.close``)."""
    lanes: dict[str, list[Call]] = {}
    for call in calls:
        lanes.setdefault(call.pool, []).append(call)
    here, *others = sorted(lanes, key=lambda pool: pool != DRIVER) or [None]

    def lane(pool: str) -> dict[str, Any]:
        return {call.name: call.fn() for call in lanes[pool]}
    if not others:
        return lane(here) if here is not None else {}
    threads = ThreadPoolExecutor(max_workers=len(others), thread_name_prefix="pool")
    try:
        futures = [threads.submit(lane, pool) for pool in others]
        results = lane(here)
        for future in futures:
            results.update(future.result())
        return results
    finally:  # the other lanes are done, or abandoned to end with their groups
        threads.shutdown(wait=False, cancel_futures=True)


class Timeline:
    """Every call's (pool, name, start, end), in seconds of ``time.perf_counter``."""

    def __init__(self):
        self.events: list[tuple[str, str, float, float]] = []
        self._lock = threading.Lock()  # lanes record from their threads
        self._written = 0
        self._rows: dict[str, int] = {}  # pool -> its row (thread id) in the trace
        self.origin = time.perf_counter()

    def record(self, pool: str, name: str, start: float, end: float) -> None:
        with self._lock:
            self.events.append((pool, name, start, end))

    def timed(self, pool: str, name: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, recorded as a call ``name`` on ``pool``."""
        start = time.perf_counter()
        try:
            return fn()
        finally:
            self.record(pool, name, start, time.perf_counter())

    def step_metrics(self, start: float, end: float, pools: list[str]) -> dict[str, float]:
        """``timing/overlap_s`` and ``timing/idle_<pool>_s`` of the window [start, end]."""
        busy = {pool: _union([(max(s, start), min(e, end)) for p, _, s, e in self.events
                              if p == pool and e > start and s < end]) for pool in pools}
        out = {f"timing/idle_{pool}_s": (end - start) - _length(spans)
               for pool, spans in busy.items()}
        # a sweep over the pools' busy spans: the time at least two are busy
        edges = sorted((t, d) for spans in busy.values() for s, e in spans
                       for t, d in ((s, 1), (e, -1)))
        overlap, busy_now, last = 0.0, 0, start
        for t, d in edges:
            if busy_now >= 2:
                overlap += t - last
            busy_now, last = busy_now + d, t
        out["timing/overlap_s"] = overlap
        return out

    def write(self, path: Path, step: int) -> None:
        """Append the calls recorded since the last write to the Chrome trace at ``path`` (a JSON
        array whose closing bracket the format lets a growing file leave out), each tagged with
        ``step``."""
        with self._lock:
            new, self._written = self.events[self._written:], len(self.events)
        lines = []
        if not path.exists():
            lines.append("[")
        for pool, name, start, end in new:
            if pool not in self._rows:
                self._rows[pool] = len(self._rows) + 1
                lines.append(json.dumps({"name": "thread_name", "ph": "M", "pid": 1,
                                         "tid": self._rows[pool], "args": {"name": pool}}) + ",")
            lines.append(json.dumps({"name": name, "cat": pool, "ph": "X", "pid": 1,
                                     "tid": self._rows[pool],
                                     "ts": round((start - self.origin) * 1e6),
                                     "dur": round((end - start) * 1e6),
                                     "args": {"step": step}}) + ",")
        with open(path, "a") as f:
            f.write("\n".join(lines) + "\n")


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint spans covering the same time as ``spans``."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in spans)
