"""The tool sandbox (hybridflow.agent.sandbox): every way a tool can go wrong comes back as a
status and an error message, the limits hold, nothing of a call is left running, and only plain
defs of the user's file, of our tools or of trusted modules may be tools."""

import os
import socket
import textwrap

import pytest

from hybridflow.agent.sandbox import STATUSES, SandboxLimits, check_tool, run_tool
from hybridflow.errors import ConfigError

TOOLS = '''
import os, socket, time

def slow():
    time.sleep(60)
    return "woke"

def hungry():
    return str(len(bytearray(1 << 30)))

def forks(n):
    made = []
    for _ in range(n):
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        made.append(str(pid))
    return f"{os.getuid()} {' '.join(made)}"

def connect(port):
    socket.create_connection(("127.0.0.1", port), timeout=2).close()
    return "connected"

def internet():
    socket.create_connection(("1.1.1.1", 80), timeout=2).close()
    return "connected"

def write(path):
    with open(path, "a") as f:
        f.write("tool was here")
    return "written " + os.getcwd()

def flood():
    return "x" * 100_000

def fails(word):
    raise ValueError("no " + word)

def number():
    return 42

def where():
    return os.getcwd()
'''


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "my_tools.py"
    path.write_text(TOOLS)
    return f"{path}:"


LIMITS = SandboxLimits(timeout_s=2.0, memory_mb=256, cpu_s=2, max_output_chars=100,
                       max_processes=8)


def test_a_sleeping_tool_times_out(tools):
    result = run_tool(tools + "slow", {}, LIMITS)
    assert result.status == "timeout"
    assert result.output == "error: the tool did not finish within 2 s"
    assert result.seconds < 30  # generous: the limit is 2 s


def test_a_tool_past_its_memory_limit_is_reported(tools):
    result = run_tool(tools + "hungry", {}, LIMITS)
    assert result.status == "memory"
    assert "256 MB" in result.output


def _processes_of(uid: int) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/status") as f:
                uids = next(line for line in f if line.startswith("Uid:")).split()[1:]
        except (OSError, StopIteration):
            continue
        if str(uid) in uids:
            found.append(int(entry))
    return found


@pytest.mark.skipif(os.geteuid() != 0, reason="RLIMIT_NPROC under a uid of its own needs root")
def test_forked_processes_are_bounded_and_none_outlives_the_call(tools):
    # A serial fork loop, each child sleeping: what a fork bomb leaves, without its risk should
    # the bound fail. The tool returns at once; its children must not outlive the call.
    result = run_tool(tools + "forks", {"n": 200}, LIMITS)
    assert result.status == "ok", result.output
    uid, *made = map(int, result.output.split())
    assert 0 < len(made) < LIMITS.max_processes
    assert _processes_of(uid) == []


def test_the_children_of_a_tool_do_not_outlive_the_call(tools):
    result = run_tool(tools + "forks", {"n": 5}, LIMITS)
    uid, *made = map(int, result.output.split())
    assert len(made) == 5
    assert not [pid for pid in made if os.path.exists(f"/proc/{pid}")]


def test_the_network_is_off(tools):
    with socket.socket() as server:  # a listener the host can reach
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        result = run_tool(tools + "connect", {"port": port}, LIMITS)
    assert result.status == "error"
    assert result.output.startswith("error: ")
    assert run_tool(tools + "internet", {}, LIMITS).status == "error"


@pytest.mark.skipif(os.geteuid() != 0, reason="contained by a uid of its own: needs root")
def test_a_write_outside_the_scratch_directory_does_not_land(tools, tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("mine")
    result = run_tool(tools + "write", {"path": str(outside)}, LIMITS)
    assert outside.read_text() == "mine", result
    assert result.status == "error"
    # Inside its own directory it writes, and that directory is gone afterwards.
    result = run_tool(tools + "write", {"path": "notes.txt"}, LIMITS)
    assert result.status == "ok", result.output
    assert not os.path.exists(result.output.split()[-1] + "/notes.txt")


def test_each_call_runs_in_a_fresh_empty_directory(tools):
    assert run_tool(tools + "where", {}, LIMITS).output != os.getcwd()


def test_a_long_output_is_cut_with_a_note(tools):
    result = run_tool(tools + "flood", {}, LIMITS)
    assert result.status == "truncated"
    assert result.output.startswith("x" * 100 + "\n[output truncated: 100000 characters, the "
                                                 "first 100 shown]")


def test_a_raising_tool_gives_the_last_line_of_its_error(tools):
    result = run_tool(tools + "fails", {"word": "way"}, LIMITS)
    assert (result.status, result.output) == ("error", "error: ValueError: no way")


def test_wrong_arguments_are_the_model_s_error(tools):
    result = run_tool(tools + "fails", {"nope": 1}, LIMITS)
    assert result.status == "error"
    assert "unexpected keyword argument 'nope'" in result.output
    assert run_tool(tools + "fails", ["way"], LIMITS).status == "error"


def test_a_tool_must_return_a_str(tools):
    result = run_tool(tools + "number", {}, LIMITS)
    assert (result.status, result.output) == ("error",
                                              "error: the tool returned a int, not a str")


def test_statuses_are_the_documented_set(tools):
    assert set(STATUSES) == {"ok", "truncated", "error", "timeout", "memory"}


@pytest.mark.parametrize("ref", ["os:system", "builtins:eval", "subprocess:run",
                                 "hybridflow.agent.sandbox:run_tool", "nowhere.py:f"])
def test_builtins_the_standard_library_and_unknown_names_are_refused(ref):
    with pytest.raises(ConfigError) as e:
        check_tool(ref)
    assert e.value.field == "rollout.multi_turn.tools"
    with pytest.raises(ConfigError):
        run_tool(ref, {}, LIMITS)


def test_a_builtin_imported_into_the_user_file_is_refused(tmp_path):
    path = tmp_path / "sneaky.py"
    path.write_text("from os import system\nimport subprocess\nrun = subprocess.run\n")
    for name in ("system", "run"):
        with pytest.raises(ConfigError):
            check_tool(f"{path}:{name}")


def test_our_tools_and_a_trusted_module_pass(tmp_path, monkeypatch):
    check_tool("hybridflow.agent.tools:calculator")
    (tmp_path / "mytools.py").write_text(textwrap.dedent("""
        def shout(text):
            return text.upper()
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="rollout.multi_turn.trust"):
        check_tool("mytools:shout")
    check_tool("mytools:shout", trust=["mytools"])
    assert run_tool("mytools:shout", {"text": "hi"}, LIMITS, trust=["mytools"]).output == "HI"
