"""``python -m hybridflow.workers.reaper DRIVER_PID``: no process of a run outlives its driver.

A local run's driver starts Ray (its servers, agents and worker processes). When the driver is
killed (SIGKILL, OOM), Ray's servers die with it and the workers a few seconds later, but Ray
2.60's dashboard and runtime-env agents linger for a minute or more. The reaper, started by the
driver in a session of its own, notes the driver's descendants every second; once the driver is
gone (the reaper is re-parented) it kills the ones still running. Linux only (it reads /proc);
elsewhere it exits at once.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

_PROC = Path("/proc")


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, start time) of every process, from /proc/<pid>/stat."""
    out = {}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(entry.name)] = (int(fields[1]), fields[19])
    return out


def descendants(root: int) -> dict[int, str]:
    """pid -> start time of every process below ``root``."""
    table = _processes()
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found[pid] = table[pid][1]
        todo += children.get(pid, [])
    return found


def reap(driver: int, interval_s: float = 1.0) -> None:
    me = os.getpid()
    known: dict[int, str] = {}
    while os.getppid() == driver:
        known.update({p: t for p, t in descendants(driver).items() if p != me})
        time.sleep(interval_s)
    table = _processes()
    for pid, start in known.items():
        if pid in table and table[pid][1] == start:  # the same process, not a reused pid
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


if __name__ == "__main__":
    if _PROC.is_dir():
        reap(int(sys.argv[1]))
