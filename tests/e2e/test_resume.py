"""Runs survive: a run killed with SIGKILL at several moments (during generation, during the
update, during a checkpoint write) and preempted with SIGTERM, each time started again with the
same command, ends with a metrics.jsonl identical row for row (timings aside) to an uninterrupted
run's. And a reward function that returns NaN stops the run with a message, not a NaN model.

Each attempt is the real command line (``hybridflow train``) in a process of its own, killed from
outside as Slurm or the OOM killer would."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from hybridflow.tracking import CLOCK_KEYS

pytestmark = [pytest.mark.slow]

PROMPTS = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)}
           for a, b in ((1, 1), (2, 3), (4, 4), (7, 1), (3, 3), (5, 2))]

# A reward with three test hooks, driven by the environment of the attempt: KILL_AT_CALL=n kills
# this process 50 ms after the n-th reward call (the phases after scoring: log-probs and the
# update), NAN_REWARD=1 returns NaN, HANG_AT_CALL=n never returns from the n-th call, once it has
# written "hanging" to the file HANG_FILE names.
REWARD = '''
import os, signal, threading, time
calls = 0

def length(response):
    global calls
    calls += 1
    if calls == int(os.environ.get("KILL_AT_CALL", "0")):
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGKILL)).start()
    if calls == int(os.environ.get("HANG_AT_CALL", "0")):
        with open(os.environ["HANG_FILE"], "w") as f:
            f.write("hanging")
        time.sleep(10 ** 6)
    if os.environ.get("NAN_REWARD"):
        return float("nan")
    return len(response) / 10.0
'''

# Started before anything else in every Python process of an attempt given HF_KILL_ON_SAVE_FORK
# (a folder on its PYTHONPATH): the first process forked from a Ray worker inside its save_state
# call (megatron-core's checkpoint writer) SIGKILLs the driver, whose pid is in the file that
# variable names, and then sleeps in place of its work: a writer stuck after its parent died (the
# issue's were asleep in a futex wait, for good).
KILL_ON_SAVE_FORK = '''
import os, signal, time

def _kill_driver():
    with open("/proc/self/cmdline", "rb") as f:  # Ray's process title: ray::Class.method
        if b"save_state" not in f.read():
            return
    with open(os.environ["HF_KILL_ON_SAVE_FORK"]) as f:
        try:
            os.kill(int(f.read()), signal.SIGKILL)
        except OSError:  # the other rank's fork was first
            pass
    time.sleep(120)

if os.environ.get("HF_KILL_ON_SAVE_FORK"):
    os.register_at_fork(after_in_child=_kill_driver)
'''

RUN_FILES = """\
data:
  source: {tmp}/prompts.jsonl
  max_prompt_tokens: 32
checkpoint: {{every: 2, keep: 2}}
ray: {{num_cpus: 2}}
tracking: {{out_dir: {tmp}/runs}}
"""
"""The data, checkpoints, Ray and tracking of the resume tests' runs (``make_setup``'s folder)."""

CONFIG = """\
model: tiny-llama
reward: {tmp}/rewards.py:length
train_batch_size: 2
steps: 6
actor:
  layout: {{tp: 1, pp: 2, dp: 1}}
  engine: {{micro_batch_size: 1, optim: {{lr: 1.0e-3}}}}
rollout:
  backend: megatron
  sampling: {{n: 2, max_tokens: 6}}
""" + RUN_FILES


def make_setup(tmp_path_factory, name: str, config: str):
    """A folder holding the prompts, the reward function and ``config`` as run.yaml, and the
    environment of the runs there: what ``Attempt`` takes."""
    tmp = tmp_path_factory.mktemp(name)
    (tmp / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    (tmp / "rewards.py").write_text(REWARD)
    (tmp / "run.yaml").write_text(config.format(tmp=tmp))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "HYBRIDFLOW_CACHE": str(tmp_path_factory.getbasetemp() / "cache")}
    return tmp, env


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return make_setup(tmp_path_factory, "resume", CONFIG)


class Attempt:
    """``hybridflow train run.yaml name=NAME [overrides]`` in a process of its own."""

    def __init__(self, setup, name: str, *overrides: str, out_dir=None, **env):
        tmp, base_env = setup
        out_dir = out_dir or tmp / "runs"
        overrides = (*overrides, f"tracking.out_dir={out_dir}")
        self.run_dir = out_dir / name
        self.log = tmp / f"{name}-{time.monotonic_ns()}.log"
        metrics = self.run_dir / "metrics.jsonl"
        self._inode = metrics.stat().st_ino if metrics.exists() else None
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "hybridflow.cli", "train", str(tmp / "run.yaml"),
                 f"name={name}", *overrides], stdout=out, stderr=subprocess.STDOUT,
                env={**base_env, **env})

    def rows(self) -> int:
        """Rows in metrics.jsonl, once this attempt has rewritten it (a resumed run replaces
        the file with its rows up to the checkpoint: until then the rows are the last one's)."""
        path = self.run_dir / "metrics.jsonl"
        if not path.exists() or path.stat().st_ino == self._inode:
            return 0
        return path.read_text().count("\n")

    def writing_checkpoint(self) -> bool:
        root = self.run_dir / "checkpoints"
        return root.exists() and any(root.glob(".step_*.tmp-*"))

    def wait_until(self, condition, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.proc.poll() is None, f"ended early:\n{self.output()}"
            assert time.monotonic() < deadline, f"timed out:\n{self.output()}"
            time.sleep(0.01)

    def finish(self, timeout: float = 300) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(30)

    def output(self) -> str:
        return self.log.read_text()


def metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(CLOCK_KEYS)} for r in rows]


def test_killed_and_preempted_run_equals_an_uninterrupted_one(setup):
    reference = Attempt(setup, "uninterrupted")
    assert reference.finish() == 0, reference.output()
    expected = metrics(reference.run_dir)
    assert [r["step"] for r in expected] == [1, 2, 3, 4, 5, 6]

    # During generation: step 3's row is written, step 4 is generating (checkpoint: step 2).
    first = Attempt(setup, "interrupted")
    first.wait_until(lambda: first.rows() >= 3)
    first.kill()
    # During a checkpoint write (step 4's): the half-written one must be neither kept nor loaded.
    second = Attempt(setup, "interrupted")
    second.wait_until(second.writing_checkpoint)
    second.kill()
    assert "resuming from" in second.output() and "step_000002" in second.output()
    # During the update: 50 ms after step 4's first reward call (resumed from step 2, the 5th).
    third = Attempt(setup, "interrupted", KILL_AT_CALL="5")
    assert third.finish() == -signal.SIGKILL, third.output()
    # Preempted: SIGTERM once step 3 is logged; the run checkpoints and exits 0.
    fourth = Attempt(setup, "interrupted")
    fourth.wait_until(lambda: fourth.rows() >= 3)
    fourth.proc.send_signal(signal.SIGTERM)
    assert fourth.finish() == 0, fourth.output()
    assert "SIGTERM: stopped after step" in fourth.output()
    stopped_at = json.loads((fourth.run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert (fourth.run_dir / "checkpoints" / f"step_{stopped_at['step']:06d}").is_dir()
    # The same command once more finishes the run.
    last = Attempt(setup, "interrupted")
    assert last.finish() == 0, last.output()
    assert f"resuming from" in last.output()

    assert metrics(last.run_dir) == expected
    assert not list((last.run_dir / "checkpoints").glob(".step_*"))  # no partial write left
    kept = sorted(p.name for p in (last.run_dir / "checkpoints").iterdir())
    assert kept == ["step_000004", "step_000006"]  # checkpoint.keep=2
    # Started again when complete: nothing to do, nothing rewritten.
    again = Attempt(setup, "interrupted")
    assert again.finish() == 0 and "is complete" in again.output()
    assert metrics(last.run_dir) == expected


def processes_of(tag: str) -> list[tuple[int, str]]:
    """(pid, command line) of every process whose environment holds HF_TEST_TAG=tag: whatever
    an attempt started with that tag, forks of forks included."""
    entry = f"HF_TEST_TAG={tag}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and entry in (proc / "environ").read_bytes().split(b"\0"):
                found.append((int(proc.name), (proc / "cmdline").read_bytes().decode(
                    errors="replace").replace("\0", " ").strip()))
        except OSError:  # gone meanwhile
            pass
    return found


def test_a_driver_killed_while_saving_leaves_no_process(setup):
    """SIGKILL of the driver while the workers write a checkpoint (at the moment megatron-core's
    writer forks from them): within 30 s nothing the run started is left, the forks included."""
    tmp, _ = setup
    hook = tmp / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(KILL_ON_SAVE_FORK)
    tag = uuid.uuid4().hex
    attempt = Attempt(setup, "killed_while_saving", HF_TEST_TAG=tag,
                      HF_KILL_ON_SAVE_FORK=str(tmp / "driver.pid"),
                      PYTHONPATH=os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]))
    (tmp / "driver.pid").write_text(str(attempt.proc.pid))
    try:
        assert attempt.finish() == -signal.SIGKILL, attempt.output()
        assert attempt.writing_checkpoint()  # killed during the save
        deadline = time.monotonic() + 30
        while (left := processes_of(tag)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert left == []
    finally:  # a failure leaves nothing behind either
        for pid, _ in processes_of(tag):
            os.kill(pid, signal.SIGKILL)


# Multi-turn on the tiny random model, which writes no tool calls: this parser reads one in every
# turn (a third of the vocabulary ends a turn), and the echo tool answers with the turn's end.
TOOLS = '''
def every_turn(text):
    return [{"name": "echo", "arguments": {"text": text[-6:]}}]

def echo(text):
    return "echo " + text
'''


def test_a_multi_turn_run_killed_and_resumed_equals_an_uninterrupted_one(setup):
    tmp, _ = setup
    (tmp / "tools.py").write_text(TOOLS)
    stops = ",".join(str(t) for t in range(3, 512, 3))
    args = (f"rollout.multi_turn.tools=[{tmp}/tools.py:echo]",
            f"rollout.multi_turn.parser={tmp}/tools.py:every_turn",
            "rollout.sampling.max_tokens=40", f"rollout.sampling.stop_token_ids=[{stops}]",
            "steps=4", "validation.every=2", "validation.size=2")
    reference = Attempt(setup, "multi_turn", *args)
    assert reference.finish() == 0, reference.output()
    expected = metrics(reference.run_dir)
    train = [r for r in expected if "reward/mean" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert all(r["multi_turn/turns_mean"] > 1.5 and r["multi_turn/ok_call_frac"] > 0.5
               for r in train), expected
    assert [r["step"] for r in expected if "val/reward" in r] == [0, 2, 4]  # greedy, multi-turn
    # Killed once step 2's checkpoint is complete (during step 3), started again with the same
    # command.
    first = Attempt(setup, "multi_turn_interrupted", *args)
    first.wait_until((first.run_dir / "checkpoints" / "step_000002").is_dir)
    first.kill()
    last = Attempt(setup, "multi_turn_interrupted", *args)
    assert last.finish() == 0, last.output()
    assert "resuming from" in last.output()
    assert metrics(last.run_dir) == expected


def test_a_nan_reward_stops_the_run_naming_the_sample(setup):
    attempt = Attempt(setup, "nan", NAN_REWARD="1")
    assert attempt.finish() == 1, attempt.output()
    out = attempt.output()
    last = out.strip().splitlines()[-1]
    assert last.startswith("hybridflow: run stopped: "), out
    assert "sample 0" in last and "rewards.py:length" in last and "nan" in last, last
    assert "Traceback" not in out
    # No step was logged and nothing was trained on the NaN.
    assert attempt.rows() == 0


def test_a_full_disk_at_a_checkpoint_is_one_line_and_the_last_one_resumes(setup, small_fs):
    """Issue 45, item 10: the disk (a 12 MiB tmpfs: the run's files and one checkpoint of
    ~8.5 MiB) fills while step 2's checkpoint is written by the workers: exit 1 with one line
    naming the checkpoint, the file and the error, no traceback; with space freed (the tmpfs
    grown), the same command resumes from step 1's checkpoint and finishes."""
    out_dir = small_fs("12m")
    args = ("steps=2", "checkpoint.every=1")
    full = Attempt(setup, "full", *args, out_dir=out_dir)
    assert full.finish() == 1, full.output()
    out = full.output()
    last = out.strip().splitlines()[-1]
    step_dir = full.run_dir / "checkpoints"
    assert last == (f"hybridflow: run stopped: writing checkpoint {step_dir}/step_000002 failed: "
                    f"actor: No space left on device; the last complete checkpoint "
                    f"({step_dir}/step_000001) is intact: free space or choose a writable "
                    "tracking.out_dir, then run the same command to resume"), out
    assert "Traceback" not in out, out
    assert sorted(p.name for p in step_dir.iterdir()) == ["step_000001"]
    subprocess.run(["mount", "-o", "remount,size=64m", str(out_dir)], check=True)
    again = Attempt(setup, "full", *args, out_dir=out_dir)
    assert again.finish() == 0, again.output()
    assert f"resuming from {step_dir}/step_000001 (step 1)" in again.output()
    assert [r["step"] for r in metrics(again.run_dir)] == [1, 2]


# Steps take 4 reward calls (2 prompts x 2 samples): the 9th is step 3's first, after the
# checkpoint of step 2.
def test_a_reward_that_never_returns_stops_the_run_at_its_timeout(setup):
    tmp, _ = setup
    attempt = Attempt(setup, "hang", "reward_timeout_s=3", HANG_AT_CALL="9",
                      HANG_FILE=str(tmp / "hang"))
    assert attempt.finish() == 1, attempt.output()
    out = attempt.output()
    last = out.strip().splitlines()[-1]
    assert last.startswith("hybridflow: run stopped: reward function rewards.py:length ("), out
    assert "did not return within 3s (reward_timeout_s, for a batch of 4 samples) on " \
           "sample 0 (response " in last, last
    assert "Traceback" not in out
    assert [r["step"] for r in metrics(attempt.run_dir)] == [1, 2]
    assert (attempt.run_dir / "checkpoints" / "step_000002").is_dir()


def test_a_sigterm_stops_a_step_that_never_ends_within_the_grace(setup):
    """SIGTERM during a reward that never returns (and no reward timeout): the run does not wait
    for the step past ray.stop_timeout_s; it stops where it is, keeps its checkpoint and rows,
    exit code 143 (launch/slurm requeues it), and leaves no process behind."""
    tmp, _ = setup
    tag = uuid.uuid4().hex
    attempt = Attempt(setup, "hang_term", "reward_timeout_s=0", "ray.stop_timeout_s=2",
                      HANG_AT_CALL="9", HANG_FILE=str(tmp / "hang_term"), HF_TEST_TAG=tag)
    attempt.wait_until((tmp / "hang_term").exists)
    attempt.proc.send_signal(signal.SIGTERM)
    assert attempt.finish() == 128 + signal.SIGTERM, attempt.output()
    out = attempt.output()
    assert "SIGTERM: stopping after this step with a checkpoint within " \
           "ray.stop_timeout_s=2s" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("hybridflow: run stopped: SIGTERM: stopped during step 3, which did "
                           "not end within ray.stop_timeout_s=2s of the SIGTERM; "), out
    assert "Traceback" not in out
    assert [r["step"] for r in metrics(attempt.run_dir)] == [1, 2]
    assert sorted(p.name for p in (attempt.run_dir / "checkpoints").iterdir()) == \
        ["step_000002"]
    deadline = time.monotonic() + 30
    while (left := processes_of(tag)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == []
