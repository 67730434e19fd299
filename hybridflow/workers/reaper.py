"""``python -m hybridflow.workers.reaper DRIVER_PID MARK``: no process of a local run outlives its
driver.

A local run's driver starts Ray: its servers, agents and worker processes, and whatever those fork
(megatron-core's checkpoint writer forks from each worker while it saves). When the driver is
killed (SIGKILL, OOM), Ray's servers die with it (PR_SET_PDEATHSIG) and the workers a few seconds
later, but Ray 2.60's agents linger for a minute or more, and a worker's fork is re-parented to
init and may wait forever (a writer whose parent died). The reaper, started by the driver in a
session of its own before Ray, knows the run's processes two ways:

- **The mark.** Before it starts Ray the driver puts ``HYBRIDFLOW_RUN=MARK`` into its environment
  (``MARK`` unique to it); every process started or forked from then on inherits it, forks of
  forks included, orphans too. But /proc shows a process's environment as it was laid out in
  memory at its start, and a process that retitles itself (Ray's agents and workers:
  ``ray::RuntimeEnvAgent``) may write its title over the first entries: whether the mark is among
  them is chance (CI saw the runtime-env agent outlive a run so). A child that execs with an
  environment of its own making has no mark either.
- **The family.** While the driver lives, the reaper looks every ``interval_s`` and remembers every
  descendant of the driver and of a marked process (by pid and start time, so a reused pid is not
  mistaken), which covers both.

Once the driver is gone it kills, again and again (one may fork meanwhile), every process that is
marked, remembered, or a descendant of one, until none is left. Linux only (it reads /proc);
elsewhere it exits at once.
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


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks after boot) of process ``pid``; None if it is gone
    or a zombie (dead: killed, its parent not yet told)."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:  # gone meanwhile
        return None
    # After the command (in parentheses, which may hold anything): state, ppid, ..., and the
    # start time, 20th after the state.
    fields = stat[stat.rindex(")") + 2:].split()
    return None if fields[0] in ("Z", "X") else (int(fields[1]), int(fields[19]))


def started(pid: int) -> int | None:
    """The start time of process ``pid``, None if it is gone."""
    stat = _stat(pid)
    return stat[1] if stat else None


def _processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time) of every live process but this one."""
    table = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            if (stat := _stat(int(entry.name))) is not None:
                table[int(entry.name)] = stat
    return table


def marked(mark: str, pids=None) -> list[int]:
    """The pids, of ``pids`` (default: every live process), of the processes whose environment,
    as /proc shows it, holds ``RUN_MARK=mark``, this one aside."""
    entry_of_mark = f"{RUN_MARK}={mark}".encode()
    if pids is None:
        pids = [int(e.name) for e in _PROC.iterdir() if e.name.isdigit()]
    found = []
    for pid in pids:
        if pid == os.getpid():
            continue
        try:
            environ = (_PROC / str(pid) / "environ").read_bytes()  # a zombie's is empty
        except OSError:  # gone meanwhile, or another user's
            continue
        if entry_of_mark in environ.split(b"\0"):
            found.append(pid)
    return found


def run_processes(mark: str, known: dict[int, int] | None = None) -> dict[int, int]:
    """pid -> start time of the run's processes alive now: those ``mark`` marks, those in
    ``known`` (pid -> start time) that are still the same process, and every descendant of
    either."""
    table = _processes()
    run = {pid: table[pid][1] for pid in marked(mark, table)}  # one scan of /proc a look
    run.update({pid: start for pid, start in (known or {}).items()
                if pid in table and table[pid][1] == start})
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    todo = list(run)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in run:
                run[child] = table[child][1]
                todo.append(child)
    return run


def reap(driver: int, mark: str, interval_s: float = 0.5, patience_s: float = 20.0) -> None:
    """While ``driver`` lives, remember the run's processes; once it is gone (this process is
    re-parented), SIGKILL them and any that are marked, again and again, until none is left or
    ``patience_s`` passed."""
    known = {driver: started(driver)}
    while os.getppid() == driver:
        known = run_processes(mark, known)
        time.sleep(interval_s)
    deadline = time.monotonic() + patience_s
    while (known := run_processes(mark, known)) and time.monotonic() < deadline:
        for pid in known:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:  # gone meanwhile
                pass
        time.sleep(0.1)


if __name__ == "__main__":
    if _PROC.is_dir():
        reap(int(sys.argv[1]), sys.argv[2])
