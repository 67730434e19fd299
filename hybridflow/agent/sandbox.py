"""Tools run in a sandbox: a fresh process per call, within limits; whatever goes wrong in one
(it raises, hangs, floods its output, allocates without end, forks) comes back as an
``"error: ..."`` message for the model and a ``status`` to count, never as a dead run.

``run_tool`` starts ``python -I`` (the *runner*, our code, with the environment stripped to a
few variables: no proxies) and hands it the call on stdin. The runner imports the tool's module,
then closes what it can before forking the *worker* that calls the tool:

- **Network**: a new network namespace (``unshare(CLONE_NEWNET)``: only a loopback that is
  down), where the kernel allows it (root, or CAP_SYS_ADMIN). Elsewhere a best-effort fallback:
  the worker's ``socket.socket``, ``socket.create_connection`` and ``socket.getaddrinfo`` raise;
  a subprocess or a C extension still reaches the network.
- **Files**: a new mount namespace with private tmpfs over ``/tmp``, ``/var/tmp`` and
  ``/dev/shm`` (each ``memory_mb`` large) where the kernel allows it; the worker runs in
  ``/tmp/tool`` there, and all of it vanishes with the call. As root the worker also drops to a
  uid of its own (``UID_BASE`` + the runner's pid), so the file permissions of the host refuse
  its writes anywhere else (a world-writable directory other than those three excepted). It
  keeps CAP_DAC_READ_SEARCH, to read Python where only root may (``/root/.pyenv``): it can read
  every file of the machine (and give it to the model as output), though write none.
  Without these, the scratch directory is a fresh temporary directory, removed after the call,
  and the tool can write wherever its user can.
- **Processes**: the runner is a child subreaper: every process the tool starts stays its
  descendant, and all are killed (and reaped) when the call ends, however it ends. Under its own
  uid the worker also has RLIMIT_NPROC = ``max_processes``, so a fork bomb stops there; without
  root it is not bounded (RLIMIT_NPROC counts all the processes of the user), only killed.
- **Time, memory, output**: ``timeout_s`` of wall clock, RLIMIT_CPU ``cpu_s``, RLIMIT_AS and
  RLIMIT_FSIZE ``memory_mb``; the output is cut to ``max_output_chars`` with a note saying so.

The statuses (``STATUSES``): ``ok`` (the tool returned a str, given whole), ``truncated`` (it
returned a longer str, cut), ``error`` (it raised, returned something else than a str, or its
process ended without a result), ``timeout`` (past ``timeout_s`` of wall clock or ``cpu_s`` of
CPU time), ``memory`` (a MemoryError at ``memory_mb``, or killed by the kernel's OOM killer).
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import importlib.util
import json
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

from hybridflow.errors import ConfigError, RunError, exception_line

STATUSES = ("ok", "truncated", "error", "timeout", "memory")
"""What can become of a tool call; see the module's docstring."""

TOOLS_KEY = "rollout.multi_turn.tools"
"""The config key that names the tools, for errors."""

TRUST_KEY = "rollout.multi_turn.trust"
"""The config key listing the installed modules whose functions may be tools."""

OWN_TOOLS = "hybridflow.agent.tools"
"""Our tools' module: trusted without being listed."""

UID_BASE = 1_000_000_000
"""As root, a call's worker runs as uid ``UID_BASE + runner pid``: a uid no one else has."""

_SLACK_S = 10.0  # how long past timeout_s the runner may take before it is killed itself
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/",
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_RUNNER = ("import json, sys; request = json.loads(sys.stdin.read()); "
           "sys.path[:] = request['sys_path']; "
           "from hybridflow.agent.sandbox import _runner; _runner(request)")


@dataclass(frozen=True)
class SandboxLimits:
    """What one tool call may use."""

    timeout_s: float = 5.0
    """Wall clock per call."""
    memory_mb: int = 256
    """Address space of the worker (RLIMIT_AS), the largest file it may write, the size of its
    private /tmp."""
    cpu_s: int = 5
    """CPU time of the worker (RLIMIT_CPU)."""
    max_output_chars: int = 2000
    """Longer output is cut to this, with a note saying so."""
    max_processes: int = 16
    """Processes and threads the worker may have at once, itself included (RLIMIT_NPROC under a
    uid of its own: as root only)."""


@dataclass
class ToolResult:
    """What a tool call gave: ``output`` goes back to the model (the tool's str, or
    ``"error: ..."``), ``status`` is one of ``STATUSES``, ``seconds`` the call's wall time."""

    output: str
    status: str
    seconds: float


def check_tool(fn_ref: str, *, trust: Sequence[str] = (), key: str = TOOLS_KEY) -> None:
    """Refuse ``fn_ref`` with a ConfigError on ``rollout.multi_turn.tools`` unless it names a
    plain ``def`` of the user's file (``path/file.py:function``), of ``hybridflow.agent.tools``
    or of a module of ``trust`` (the rules of reward functions:
    ``hybridflow.rewards.resolve_function``); builtins and the standard library are refused.
    The module is imported (a file executed) here, in the calling process. ``key``: the field
    its errors name (``tools`` where the config's section adds its own prefix)."""
    if not isinstance(fn_ref, str) or ":" not in fn_ref:
        raise ConfigError(key, f"{fn_ref!r} must be 'path/to/file.py:function' or "
                                     f"'module:function', e.g. {OWN_TOOLS}:calculator")
    # Deferred: rewards imports torch, and the sandbox's runner imports this module.
    from hybridflow.rewards import resolve_function
    resolve_function(fn_ref, key, tuple(trust), own=OWN_TOOLS, trust_key=TRUST_KEY)


@functools.lru_cache(maxsize=256)
def _checked(fn_ref: str, trust: tuple[str, ...]) -> None:
    check_tool(fn_ref, trust=trust)


def run_tool(fn_ref: str, arguments: dict, limits: SandboxLimits = SandboxLimits(), *,
             trust: Sequence[str] = ()) -> ToolResult:
    """Call the tool ``fn_ref`` (see ``check_tool``; checked once per name) with the keyword
    ``arguments`` in a fresh sandboxed process (see the module's docstring) and say what came of
    it. A fault of the tool or of its arguments is a ToolResult; a refused ``fn_ref`` is a
    ConfigError, a runner that fails (our fault, or the machine's) a RunError."""
    _checked(fn_ref, tuple(trust))
    start = time.monotonic()
    target, _, attr = fn_ref.rpartition(":")
    try:
        if not isinstance(arguments, dict):
            raise TypeError(f"a {type(arguments).__name__}")
        request = json.dumps({
            "sys_path": [os.path.abspath(p) for p in sys.path],
            "target": os.path.abspath(target) if target.endswith(".py") else target,
            "attr": attr, "arguments": arguments, "limits": asdict(limits)})
    except (TypeError, ValueError) as e:
        return ToolResult(f"error: the arguments must be a JSON object of named values, got {e}",
                          "error", time.monotonic() - start)
    runner = subprocess.Popen([sys.executable, "-I", "-B", "-c", _RUNNER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_ENV, cwd="/",
                              start_new_session=True)
    try:
        out, err = runner.communicate(request.encode(), timeout=limits.timeout_s + _SLACK_S)
    except subprocess.TimeoutExpired:
        os.killpg(runner.pid, signal.SIGKILL)
        runner.communicate()
        return ToolResult(f"error: the tool did not finish within {limits.timeout_s:g} s",
                          "timeout", time.monotonic() - start)
    try:
        answer = json.loads(out)
    except ValueError:
        last = (err.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
        raise RunError(f"the tool sandbox failed on {fn_ref} (exit status "
                       f"{runner.returncode}): {last}") from None
    return ToolResult(answer["output"], answer["status"], time.monotonic() - start)


# The runner: the process run_tool starts, as root where it is.

def _runner(request: dict) -> None:
    """Load the tool, close the sandbox around a worker process calling it, wait for it within
    the time limit, end every process it left, and print its result as JSON to stdout."""
    limits = SandboxLimits(**request["limits"])
    fn = _load(request["target"], request["attr"])  # before the mounts hide a file in /tmp
    libc = ctypes.CDLL(None, use_errno=True)
    netless = libc.unshare(_CLONE_NEWNET) == 0
    private = libc.unshare(_CLONE_NEWNS) == 0 and _mount_private_tmp(libc, limits.memory_mb)
    uid = UID_BASE + os.getpid() if os.geteuid() == 0 and _mapped(UID_BASE + os.getpid()) \
        else None
    scratch = _scratch(private, uid)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    result_r, result_w = os.pipe()
    worker = os.fork()
    if worker == 0:
        os.close(result_r)
        _work(fn, request["arguments"], limits, uid, scratch, netless, result_w)
    os.close(result_w)
    data, finished = _wait(worker, result_r, limits.timeout_s)
    ends = _end_all()
    data += _read_all(result_r)
    if not private:
        shutil.rmtree(scratch, ignore_errors=True)
    if not finished:
        status, output = "timeout", f"error: the tool did not finish within {limits.timeout_s:g} s"
    elif data:
        status, output = json.loads(data)
    else:
        status, output = _ended_without_result(ends.get(worker, 0), limits)
    sys.stdout.write(json.dumps({"status": status, "output": output}))


_CLONE_NEWNS, _CLONE_NEWNET = 0x00020000, 0x40000000
_MS_NOSUID, _MS_NODEV, _MS_REC, _MS_PRIVATE = 2, 4, 1 << 14, 1 << 18
_PR_SET_KEEPCAPS, _PR_SET_CHILD_SUBREAPER = 8, 36
_LINUX_CAPABILITY_VERSION_3, _CAP_DAC_READ_SEARCH = 0x20080522, 2
_PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm")


def _load(target: str, attr: str) -> Callable[..., Any]:
    """The function ``attr`` of the file or module ``target`` (check_tool judged it)."""
    if target.endswith(".py"):
        spec = importlib.util.spec_from_file_location("hybridflow_user_tool", target)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses in it look their module up
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    return getattr(module, attr)


def _mount_private_tmp(libc: ctypes.CDLL, size_mb: int) -> bool:
    """In the runner's new mount namespace: mounts made here stay here, and ``_PRIVATE_DIRS``
    get a tmpfs each. False where the kernel refuses (a container's seccomp or AppArmor)."""
    if libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        return False
    options = f"size={size_mb}m,mode=1777".encode()
    return all(libc.mount(b"tmpfs", d.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, options) == 0
               for d in _PRIVATE_DIRS if os.path.isdir(d))


def _mapped(uid: int) -> bool:
    """Whether ``uid`` exists in this user namespace (a container's may map only a few)."""
    with open("/proc/self/uid_map") as f:
        for line in f:
            inside, _, count = map(int, line.split())
            if inside <= uid < inside + count:
                return True
    return False


def _scratch(private: bool, uid: int | None) -> str:
    """A new empty directory for the worker to run in, its own."""
    if private:
        path = "/tmp/tool"
        os.mkdir(path, 0o700)
    else:
        path = tempfile.mkdtemp(prefix="hybridflow-tool-")
    if uid is not None:
        os.chown(path, uid, uid)
    return path


def _work(fn: Callable[..., Any], arguments: dict, limits: SandboxLimits, uid: int | None,
          scratch: str, netless: bool, result_w: int) -> None:
    """The worker: limit itself, call ``fn(**arguments)``, write ``[status, output]`` as JSON
    to ``result_w`` and exit."""
    try:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file too large: an OSError instead
        _limit(limits, uid is not None)
        if uid is not None:
            _become(uid)
        os.chdir(scratch)
        os.environ.update(HOME=scratch, TMPDIR=scratch)
        if not netless:
            _refuse_sockets()
        status, output = _call(fn, arguments, limits)
    except BaseException as e:  # noqa: BLE001 - reported, the process ends below either way
        status, output = "error", f"error: the sandbox could not start the tool: {exception_line(e)}"
    data = json.dumps([status, output]).encode()
    while data:
        data = data[os.write(result_w, data):]
    os._exit(0)


def _become(uid: int) -> None:
    """Run as ``uid`` (and gid), keeping of root's powers only CAP_DAC_READ_SEARCH: Python, the
    tool's modules, may lie where only root reads (``/root/.pyenv``); writing is the uid's."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_KEEPCAPS, 1, 0, 0, 0)
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    keep = 1 << _CAP_DAC_READ_SEARCH
    sets = (ctypes.c_uint32 * 6)(keep, keep, 0, 0, 0, 0)  # effective, permitted, inheritable x2
    if libc.capset(header, sets) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def _limit(limits: SandboxLimits, own_uid: bool) -> None:
    memory = limits.memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if own_uid:  # counted per user: with the user's own processes otherwise
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes))


def _refuse_sockets() -> None:
    """Best effort, where no network namespace could be made: the socket module refuses."""
    import _socket
    import socket

    def refused(*args: Any, **kwargs: Any) -> None:
        raise PermissionError("network access is off in the tool sandbox")
    for module in (socket, _socket):
        module.socket = refused
    socket.create_connection = socket.getaddrinfo = refused


def _call(fn: Callable[..., Any], arguments: dict, limits: SandboxLimits) -> tuple[str, str]:
    """``(status, output)`` of ``fn(**arguments)``."""
    cut = limits.max_output_chars
    try:
        value = fn(**arguments)
    except MemoryError:
        return "memory", f"error: the tool ran out of memory (limit {limits.memory_mb} MB)"
    except BaseException as e:  # noqa: BLE001 - the tool's fault goes back to the model
        return "error", f"error: {exception_line(e)}"[:cut]
    if not isinstance(value, str):
        return "error", f"error: the tool returned a {type(value).__name__}, not a str"
    if len(value) > cut:
        return "truncated", (f"{value[:cut]}\n[output truncated: {len(value)} characters, the "
                             f"first {cut} shown]")
    return "ok", value


def _wait(worker: int, result_r: int, timeout_s: float) -> tuple[bytes, bool]:
    """What the worker wrote to ``result_r`` until it ended or ``timeout_s`` passed, and
    whether it ended."""
    pidfd = os.pidfd_open(worker)
    deadline = time.monotonic() + timeout_s
    data, watched = b"", [pidfd, result_r]
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select(watched, [], [], left)
        if result_r in ready:
            chunk = os.read(result_r, 1 << 16)
            data += chunk
            if not chunk:
                watched.remove(result_r)
        if pidfd in ready:
            os.close(pidfd)
            return data, True
    os.close(pidfd)
    return data, False


def _end_all() -> dict[int, int]:
    """Kill every descendant (the runner is their subreaper: orphans become its children) and
    reap them all; their wait statuses by pid."""
    ends = {}
    while True:
        for pid in _children():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            pid, status = os.waitpid(-1, 0)  # returns as soon as one of the killed ones is gone
        except ChildProcessError:
            return ends
        ends[pid] = status


def _children() -> list[int]:
    me = os.getpid()
    try:
        with open(f"/proc/{me}/task/{me}/children") as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:  # a kernel without CONFIG_PROC_CHILDREN: read every parent
        found = []
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                        found.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
        return found


def _read_all(fd: int) -> bytes:
    data = b""
    while chunk := os.read(fd, 1 << 16):
        data += chunk
    os.close(fd)
    return data


def _ended_without_result(wait_status: int, limits: SandboxLimits) -> tuple[str, str]:
    """``(status, output)`` for a worker that ended without writing its result."""
    if os.WIFSIGNALED(wait_status):
        sig = os.WTERMSIG(wait_status)
        if sig == signal.SIGXCPU:
            return "timeout", f"error: the tool used more than {limits.cpu_s} s of CPU time"
        if sig == signal.SIGKILL:  # only the OOM killer sends it before the call ends
            return "memory", "error: the tool's process was killed, out of memory"
        return "error", f"error: the tool's process ended by {signal.Signals(sig).name}"
    return "error", (f"error: the tool's process exited with status "
                     f"{os.waitstatus_to_exitcode(wait_status)} without a result")
