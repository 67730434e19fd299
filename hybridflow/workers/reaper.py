"""``python -m hybridflow.workers.reaper DRIVER_PID MARK``: no process of a local run outlives its
driver.

A local run's driver starts Ray: its servers, agents and worker processes, and whatever those fork
(megatron-core's checkpoint writer forks from each worker while it saves). When the driver is
killed (SIGKILL, OOM), Ray's servers die with it (PR_SET_PDEATHSIG) and the workers a few seconds
later, but Ray 2.60's runtime-env agent lingers for a minute or more, and a worker's fork is
re-parented to init and may wait forever (a writer whose parent died). No family tree finds those:
a process forked after anyone looked is not in it, and an orphan has left it. The environment
does: before it starts Ray the driver puts ``HYBRIDFLOW_RUN=MARK`` into its environment (``MARK``
unique to it), and every process started or forked from then on, forks of forks included,
inherits it (a child that execs with an environment of its own making would escape; Ray and
megatron-core pass theirs on). The reaper, started by the driver in a session of its own before
Ray, waits for the driver to go, then kills every process whose environment holds the mark until
none is left. Linux only (it reads /proc); elsewhere it exits at once.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

RUN_MARK = "HYBRIDFLOW_RUN"
"""The environment variable that marks every process of a local run (its value: the mark)."""

_PROC = Path("/proc")


def marked(mark: str) -> list[int]:
    """The pids of the processes whose environment holds ``RUN_MARK=mark``, this one aside (a
    process's environment as it was when it started, or was forked: what it inherited)."""
    entry_of_mark = f"{RUN_MARK}={mark}".encode()
    found = []
    for entry in _PROC.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()  # a zombie's is empty
        except OSError:  # gone meanwhile, or another user's
            continue
        if entry_of_mark in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def reap(driver: int, mark: str, interval_s: float = 0.5, patience_s: float = 20.0) -> None:
    """Once ``driver`` is gone (this process is re-parented), SIGKILL the processes ``mark``
    marks, again and again (one may fork meanwhile), until none is left or ``patience_s``
    passed."""
    while os.getppid() == driver:
        time.sleep(interval_s)
    deadline = time.monotonic() + patience_s
    while (pids := marked(mark)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:  # gone meanwhile
                pass
        time.sleep(0.1)


if __name__ == "__main__":
    if _PROC.is_dir():
        reap(int(sys.argv[1]), sys.argv[2])
