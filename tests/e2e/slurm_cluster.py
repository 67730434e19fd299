"""A one-node Slurm cluster for tests: Debian's slurm-wlm and munge (installed with apt-get when
missing; needs root, as CI has), run as root without systemd from a state folder of their own,
on ports of their own, torn down by ``stop()``.

What makes them run in a container (slurm-wlm 22.05): munged's socket folder and its parents
mode 711; slurm.conf with ``AuthInfo=socket=<munged's socket>``, ``ProctrackType=
proctrack/linuxproc``, ``TaskPlugin=task/none`` and no cgroup plugin; ``cred_expire=10`` shortens
the wait before a requeued job may start again (120 s by default), and short scheduler intervals
start it once it may.

Every failure raises SlurmError naming the command and what it printed."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
COMMANDS = ["munged", "munge", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "srun"]
CTLD_PORT, SLURMD_PORT = 26817, 26818  # outside Ray's worker ports and Linux's ephemeral ones
# The daemons live in sbin, which a PATH may lack.
PATH = ":".join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/bin", "/bin"])


def _missing() -> list[str]:
    return [c for c in COMMANDS if not shutil.which(c, path=PATH)]


class SlurmError(Exception):
    pass


def _run(cmd: list[str], timeout: float = 60, **kw) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SlurmError(f"`{' '.join(cmd)}` failed: {e}") from None
    if out.returncode != 0:
        raise SlurmError(f"`{' '.join(cmd)}` exited with {out.returncode}:\n"
                         f"{(out.stdout + out.stderr)[-3000:]}")
    return out.stdout


def install() -> None:
    """apt-get install the daemons and clients unless they are all there. invoke-rc.d is told
    not to start the packages' services (a policy-rc.d, as in Docker images): their init scripts
    fail without a slurm.conf, which would fail the install."""
    if not _missing():
        return
    if os.geteuid() != 0:
        raise SlurmError(f"Slurm is not installed (missing: {_missing()}) and installing it "
                         f"(apt-get install {' '.join(PACKAGES)}) needs root")
    if not shutil.which("apt-get"):
        raise SlurmError("Slurm is not installed and there is no apt-get to install it")
    env = {**os.environ, "PATH": PATH, "DEBIAN_FRONTEND": "noninteractive"}
    policy = Path("/usr/sbin/policy-rc.d")
    made_policy = not policy.exists()
    if made_policy:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends",
           "-o", "DPkg::Lock::Timeout=120", *PACKAGES]
    try:
        try:
            _run(cmd, timeout=600, env=env)
        except SlurmError:  # an empty or stale package index
            _run(["apt-get", "update", "-q", "-o", "DPkg::Lock::Timeout=120"], timeout=300,
                 env=env)
            _run(cmd, timeout=600, env=env)
    finally:
        if made_policy:
            policy.unlink(missing_ok=True)
    missing = _missing()
    if missing:
        raise SlurmError(f"apt-get installed {PACKAGES} but {missing} are still not on PATH")


def _mem_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024 * 9 // 10
    raise SlurmError("no MemTotal in /proc/meminfo")


class SlurmCluster:
    """``start()``: install, stop what an earlier run left in ``state``, start munged, slurmctld
    and slurmd, wait until the node is idle. ``env``: the environment for Slurm's clients."""

    def __init__(self, state: Path, cpus: int = 2):
        self.state, self.cpus = Path(state), cpus
        self.node = socket.gethostname().split(".")[0]
        self.conf = self.state / "slurm.conf"
        self.socket = self.state / "munge" / "run" / "munge.socket"
        self.env = {**os.environ, "PATH": PATH, "SLURM_CONF": str(self.conf)}
        self.daemons: list[subprocess.Popen] = []

    # --------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        install()
        self.kill_leftovers()
        shutil.rmtree(self.state, ignore_errors=True)
        for sub in ("munge/run", "ctld", "spool", "log"):
            (self.state / sub).mkdir(parents=True, exist_ok=True)
        for d in (self.state, self.state / "munge", self.state / "munge" / "run"):
            d.chmod(0o711)  # munged: every folder up to its socket executable by all
        key = self.state / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.conf.write_text(self._slurm_conf())
        (self.state / "plugstack.conf").write_text("")  # not the system's /etc/slurm one
        m = self.state / "munge"
        _run([shutil.which("munged", path=PATH), f"--socket={self.socket}", f"--key-file={key}",
              f"--log-file={m / 'munged.log'}", f"--pid-file={m / 'munged.pid'}",
              f"--seed-file={m / 'munged.seed'}"])
        _run([shutil.which("munge", path=PATH), "-n", "-S", str(self.socket)])  # munged answers
        log = self.state / "log"
        self._daemon(["slurmctld", "-D", "-c", "-f", str(self.conf)], log / "slurmctld.out")
        self._wait(lambda: self._ok(["scontrol", "ping"], "UP"), 60, "slurmctld to answer",
                   log / "slurmctld.log")
        self._daemon(["slurmd", "-D", "-f", str(self.conf), "-N", self.node], log / "slurmd.out")
        self._wait(self._node_idle, 60, f"node {self.node} to be idle", log / "slurmd.log")

    def stop(self) -> None:
        for proc in self.daemons:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.daemons:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self.daemons.clear()
        self.kill_leftovers()

    def kill_leftovers(self) -> None:
        """Stop what a run of these tests left behind (killed before its teardown): every
        process whose command line names the state folder (our daemons, the jobs' scripts,
        drivers and Ray, whose files all live there), by pid."""
        pids = set()
        marker = str(self.state) + "/"
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                    errors="replace")
            except OSError:
                continue
            if marker in cmdline:
                pids.add(int(entry.name))
        for sig in (signal.SIGTERM, signal.SIGKILL):
            live = []
            for pid in pids:
                try:
                    os.kill(pid, sig)
                    live.append(pid)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 10
            while live and time.monotonic() < deadline:
                live = [p for p in live if Path(f"/proc/{p}").exists()
                        and "Z" not in _proc_state(p)]
                time.sleep(0.2)
            pids = set(live)

    # --------------------------------------------------------------------------- clients
    def run(self, *cmd: str, timeout: float = 60) -> str:
        return _run(list(cmd), timeout=timeout, env=self.env)

    def sbatch(self, *args: str, env: dict[str, str] | None = None) -> int:
        out = _run(["sbatch", "--parsable", *args], env={**self.env, **(env or {})})
        return int(out.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """scontrol's fields of a job (JobState, Restarts, ExitCode, StdOut, Reason, ...)."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id))
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_job(self, job_id: int, done, timeout: float, what: str) -> dict[str, str]:
        """Poll the job until ``done(fields)``; SlurmError after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if done(fields):
                return fields
            if time.monotonic() > deadline:
                raise SlurmError(f"job {job_id}: {what} did not happen in {timeout:g} s; now "
                                 f"JobState={fields.get('JobState')} "
                                 f"Reason={fields.get('Reason')} "
                                 f"Restarts={fields.get('Restarts')}")
            time.sleep(1)

    # --------------------------------------------------------------------------- internals
    def _slurm_conf(self) -> str:
        s = self.state
        return f"""\
ClusterName=hftest
SlurmctldHost={self.node}
SlurmUser=root
SlurmdUser=root
SlurmctldPort={CTLD_PORT}
SlurmdPort={SLURMD_PORT}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.socket},cred_expire=10
StateSaveLocation={s}/ctld
SlurmdSpoolDir={s}/spool
SlurmctldPidFile={s}/slurmctld.pid
SlurmdPidFile={s}/slurmd.pid
SlurmctldLogFile={s}/log/slurmctld.log
SlurmdLogFile={s}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
MinJobAge=3600
KillWait=10
JobRequeue=1
PlugStackConfig={s}/plugstack.conf
NodeName={self.node} CPUs={self.cpus} RealMemory={_mem_mb()} State=UNKNOWN
PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
"""

    def _daemon(self, cmd: list[str], out: Path) -> None:
        with open(out, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=self.env,
                                    start_new_session=True)
        self.daemons.append(proc)
        time.sleep(0.5)
        if proc.poll() is not None:
            raise SlurmError(f"`{' '.join(cmd)}` exited with {proc.returncode} at once:\n"
                             f"{out.read_text()[-3000:]}")

    def _ok(self, cmd: list[str], expect: str) -> bool:
        try:
            return expect in self.run(*cmd, timeout=15)
        except SlurmError:
            return False

    def _node_idle(self) -> bool:
        try:
            out = self.run("scontrol", "show", "node", "-o", self.node, timeout=15)
        except SlurmError:
            return False
        state = re.search(r"State=(\S+)", out)
        return bool(state) and state.group(1).split("+")[0] == "IDLE"

    def _wait(self, cond, timeout: float, what: str, log: Path) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            for proc in self.daemons:
                if proc.poll() is not None:
                    raise SlurmError(f"`{' '.join(proc.args)}` exited with {proc.returncode} "
                                     f"while waiting for {what}; the end of {log}:\n"
                                     f"{_tail(log)}")
            if time.monotonic() > deadline:
                raise SlurmError(f"timed out after {timeout:g} s waiting for {what}; the end of "
                                 f"{log}:\n{_tail(log)}")
            time.sleep(0.5)


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError as e:
        return f"({e})"


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"
