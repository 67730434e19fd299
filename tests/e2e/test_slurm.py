"""launch/slurm/train.sbatch on a real Slurm: a one-node slurm-wlm cluster (tests/e2e/
slurm_cluster.py; installed with apt-get when missing) runs the real sbatch script. A job runs a
tiny GRPO run to COMPLETED; a job preempted with SIGTERM checkpoints, requeues itself, and its
second attempt resumes so that metrics.jsonl equals the uninterrupted run's, timings aside.

When Slurm cannot be installed or started, the tests fail saying which command printed what:
they are never skipped. Everything lives in one state folder (a second run of the tests first
stops what an interrupted first one left there)."""

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

from hybridflow.tracking import CLOCK_KEYS

from tests.e2e.slurm_cluster import SlurmCluster, SlurmError

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
STATE = Path("/tmp/hybridflow-slurm")
WORK = STATE / "work"
STEPS = 10
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "BOOT_FAIL", "DEADLINE", "PREEMPTED"}

CONFIG = f"""\
model: tiny-llama
actor:
  layout: {{tp: 1, pp: 2, dp: 1}}
  engine: {{micro_batch_size: 1, optim: {{lr: 1.0e-3}}}}
rollout:
  backend: megatron
  sampling: {{n: 2, max_tokens: 6}}
algorithm: {{name: grpo}}
data:
  source: reasoning_gym
  tasks: [chain_sum]
  task_kwargs:
    chain_sum: {{min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1, allow_negation: false}}
  size: 16
  max_prompt_tokens: 128
reward: reasoning_gym
train_batch_size: 2
steps: {STEPS}
checkpoint: {{every: 2, keep: 2}}
tracking: {{out_dir: {WORK}/runs}}
"""


@pytest.fixture(scope="module")
def slurm():
    cluster = SlurmCluster(STATE)
    try:
        cluster.start()
    except SlurmError as e:
        cluster.stop()
        pytest.fail(f"cannot run a Slurm cluster here: {e}", pytrace=False)
    WORK.mkdir(parents=True)
    (WORK / "run.yaml").write_text(CONFIG)
    yield cluster
    cluster.stop()


class Job:
    """``sbatch launch/slurm/train.sbatch run.yaml name=NAME`` as the tests submit it (or with
    ``args`` instead, and ``more_env``): the interpreter running the tests, Ray on ports and in
    a folder of the tests' own."""

    def __init__(self, cluster: SlurmCluster, name: str, args: list[str] | None = None,
                 more_env: dict[str, str] | None = None):
        self.cluster, self.name = cluster, name
        self.run_dir = WORK / "runs" / name
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "RAY_")) or k == "SLURM_CONF"}
        env.update(
            SLURM_CONF=str(cluster.conf), HYBRIDFLOW_SETUP="0",
            PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}",
            PYTHONPATH=f"{ROOT}:{env.get('PYTHONPATH', '')}".rstrip(":"),
            OMP_NUM_THREADS="1", WANDB_MODE="offline", HF_HUB_OFFLINE="1",
            HYBRIDFLOW_CACHE=str(WORK / "cache"),
            RAY_PORT="26379", RAY_TEMP_ROOT=str(STATE / "ray"),
            RAY_HEAD_ARGS="--ray-client-server-port=26380 --dashboard-port=26381",
            RAY_START_ARGS="--dashboard-agent-listen-port=26382", **(more_env or {}))
        self.id = cluster.sbatch(
            f"--output={WORK}/{name}-%j.out", f"--chdir={WORK}",
            str(ROOT / "launch" / "slurm" / "train.sbatch"),
            *(args or [str(WORK / "run.yaml"), f"name={name}"]), env=env)
        self.out = WORK / f"{name}-{self.id}.out"

    def output(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""

    def report(self) -> str:
        """The job's output and the daemons' logs' ends, for a failure's message."""
        logs = "".join(f"\n--- end of {p}:\n{p.read_text(errors='replace')[-1500:]}"
                       for p in sorted((STATE / "log").glob("*.log")))
        return f"\n--- output of job {self.id} ({self.out}):\n{self.output()[-6000:]}{logs}"

    def fields(self) -> dict[str, str]:
        return self.cluster.job(self.id)

    def wait(self, done, timeout: float, what: str) -> dict[str, str]:
        try:
            return self.cluster.wait_job(self.id, done, timeout, what)
        except SlurmError as e:
            pytest.fail(f"{e}{self.report()}", pytrace=False)

    def finish(self, timeout: float) -> dict[str, str]:
        return self.wait(lambda f: f.get("JobState") in ENDED, timeout, "the end")

    def rows(self) -> int:
        path = self.run_dir / "metrics.jsonl"
        return path.read_text().count("\n") if path.exists() else 0

    def ray_leftovers(self) -> list[str]:
        """Processes of this job's Ray still running (their command lines name its folder)."""
        marker = f"{STATE}/ray/ray-{self.id}/"
        found = []
        for entry in Path("/proc").iterdir():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except (OSError, UnicodeDecodeError):
                continue
            if entry.name.isdigit() and marker in cmd:
                found.append(f"{entry.name}: {cmd[:120]}")
        return found


def metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(CLOCK_KEYS)} for r in rows]


@pytest.fixture(scope="module")
def uninterrupted(slurm):
    job = Job(slurm, "whole")
    return job, job.finish(timeout=240)


def test_a_job_runs_to_completion(uninterrupted):
    job, fields = uninterrupted
    out = job.output()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", job.report()
    assert fields["Restarts"] == "0", job.report()
    assert [r["step"] for r in metrics(job.run_dir)] == list(range(1, STEPS + 1)), job.report()
    for phase in ("Ray: token authentication", f"head started on {slurm_node(fields)}",
                  "1/1 nodes joined", "driver started", "driver exited with code 0",
                  "Ray stopped on 1 node(s)"):
        assert phase in out, f"no '{phase}' in the output{job.report()}"
    phases = "\n".join(line for line in out.splitlines() if line.startswith("[slurm "))
    assert "requeued" not in phases and "SIGTERM" not in phases, job.report()
    # The driver was handed the Ray of the job and no GPU (a CPU partition).
    assert re.search(r"driver started .* ray\.address=[\d.]+:26379$", out, re.M), job.report()
    assert "ray.gpus_per_worker" not in out, job.report()
    assert not job.ray_leftovers(), job.ray_leftovers()


def test_a_calibrate_job_measures_on_the_jobs_ray(slurm):
    """HYBRIDFLOW_COMMAND=calibrate runs `hybridflow calibrate` on the job's Ray: on one node it
    writes the file, without an inter-node rate, and says why."""
    from hybridflow.planner.rates import Calibration
    out = WORK / "calibration.json"
    job = Job(slurm, "calibrate", ["--quick", "--configured-sizes", "--out", str(out),
                                   "--config", str(WORK / "run.yaml")],
              more_env={"HYBRIDFLOW_COMMAND": "calibrate"})
    fields = job.finish(timeout=600)
    text = job.output()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", job.report()
    assert re.search(r"driver started .*: hybridflow calibrate --quick .* "
                     r"ray\.address=[\d.]+:26379$", text, re.M), job.report()
    assert re.search(r"^inter-node: not measured: the Ray cluster at [\d.]+:26379 has one node; "
                     r"set cluster.inter_node_gb_s", text, re.M), job.report()
    assert Calibration.from_json(out).inter_node is None
    assert not job.ray_leftovers(), job.ray_leftovers()


def slurm_node(fields: dict[str, str]) -> str:
    return fields["BatchHost"]


def test_a_preempted_job_checkpoints_requeues_and_resumes(slurm, uninterrupted):
    expected = metrics(uninterrupted[0].run_dir)
    job = Job(slurm, "preempted")
    # Preempted once a checkpoint (step 2) is written and step 3 is logged.
    deadline = time.monotonic() + 180
    while job.rows() < 3:
        fields = job.fields()
        assert fields["JobState"] in ("PENDING", "RUNNING"), f"{fields}{job.report()}"
        assert time.monotonic() < deadline, f"no 3 steps in 180 s{job.report()}"
        time.sleep(0.2)
    assert (job.run_dir / "checkpoints" / "step_000002").is_dir(), job.report()
    slurm.run("scancel", "--batch", "--signal=TERM", str(job.id))
    job.wait(lambda f: int(f.get("Restarts", "0")) >= 1, 90, "the requeue")
    fields = job.finish(timeout=240)

    out = job.output()
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", job.report()
    stopped = re.search(r"SIGTERM: stopped after step (\d+)", out)
    assert stopped, f"the driver did not stop at a checkpoint{job.report()}"
    step = int(stopped.group(1))
    assert 3 <= step < STEPS, job.report()
    first, second = out.split("attempt 2 on", 1) if "attempt 2 on" in out else (out, "")
    assert "SIGTERM: the driver checkpoints" in first and "requeued" in first, job.report()
    assert "Ray stopped on 1 node(s)" in first, job.report()
    assert f"step_{step:06d} (step {step})" in second and "resuming from" in second, job.report()
    assert "requeued" not in second and "driver exited with code 0" in second, job.report()
    # Each step exactly once, and the rows of the uninterrupted run.
    assert [r["step"] for r in metrics(job.run_dir)] == list(range(1, STEPS + 1)), job.report()
    assert metrics(job.run_dir) == expected
    assert not job.ray_leftovers(), job.ray_leftovers()
