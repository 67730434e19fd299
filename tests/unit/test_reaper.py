"""The reaper (hybridflow/workers/reaper.py) kills what a killed driver leaves, whether /proc shows
the run's mark on a process or not (Ray's agents write their title over their environment)."""

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.test_faults import alive, wait_gone

ROOT = Path(__file__).resolve().parents[2]

# A driver: starts the reaper (as init_ray does), then a marked child and one whose environment
# lacks the mark, as a retitled agent's does in /proc; prints their pids and sleeps.
DRIVER = """
import json, os, subprocess, sys, time
from hybridflow.workers.group import _start_reaper
_start_reaper()
marked = subprocess.Popen(["sleep", "600"])
unmarked = subprocess.Popen(["env", "-i", "sleep", "600"])
time.sleep(1.5)  # the reaper looks every 0.5 s while the driver lives
print(json.dumps([marked.pid, unmarked.pid]), flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the reaper reads /proc")
def test_a_killed_drivers_processes_go_marked_or_not_and_no_other():
    bystander = subprocess.Popen(["sleep", "600"])  # not the run's: must survive
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    children = []
    try:
        ready, _, _ = select.select([driver.stdout], [], [], 60)
        assert ready, "the driver did not start its children within 60 s"
        children = json.loads(driver.stdout.readline())
        unmarked = Path(f"/proc/{children[1]}/environ").read_bytes()
        assert b"HYBRIDFLOW_RUN=" not in unmarked  # only the family finds it
        assert all(alive(p) for p in children)
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    try:
        assert wait_gone(children, 15) == []
        assert alive(bystander.pid)
    finally:
        for pid in children:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        bystander.kill()
        bystander.wait()
