"""The run: from where it stands (step 0 or its newest checkpoint) to ``config.steps``.

``fit`` holds out the validation prompts, restores a checkpoint, then runs the iterations
(``step.iteration``) with validation and checkpoints at their cadence, a SIGTERM ending it after a
checkpoint (``StopOnSignals``: or where it is, past ray.stop_timeout_s), and non-finite gradients
stopping it (or skipped); metrics go to the run's tracker and, at the end, a summary and the
reward curve.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

from tqdm import tqdm

from hybridflow.checkpoint import ResumePlan, remove_partial_checkpoints, save_checkpoint
from hybridflow.config.loader import to_yaml
from hybridflow.data.loader import PromptSampler
from hybridflow.data.prompts import PromptItem
from hybridflow.driver import step as steps
from hybridflow.driver.pipeline import Pipeline
from hybridflow.driver.step import Run
from hybridflow.errors import ConfigError, Interrupted, RunError
from hybridflow.rewards import describe_reward_fn
from hybridflow.tracking import Tracker, plot_metric, read_metrics
from hybridflow.validation import split_held_out


TIMELINE = "timeline.json"
"""The run folder's Chrome trace of every call (``dataflow.Timeline``)."""


def fit(run: Run, items: list[PromptItem], plan: ResumePlan, identity: dict[str, Any],
        stop: StopOnSignals) -> tuple[list[dict[str, float]], int]:
    """Run the iterations from ``plan``'s step to ``config.steps`` over ``items`` (tokenized
    prompts, enough for the validation split: ``check_validation``); ``identity``: what a
    checkpoint of this run records it must match; ``stop``: the signals' handling, entered by the
    caller (before the workers' start). Writes metrics.jsonl, config.yaml, checkpoints and
    reward_curve.png under the run folder. Returns the metric rows of this call and the step the
    run reached."""
    cfg = run.config
    items, held_out = split_held_out(items, cfg.validation.size, cfg.data.seed)
    sampler = PromptSampler(len(items), cfg.train_batch_size, seed=cfg.data.seed,
                            shuffle=cfg.data.shuffle)
    for fn, key in ((run.reward_fn, "reward"), (run.cost_fn, "cost")):
        if fn is not None:
            print(describe_reward_fn(fn, key), flush=True)
    # Generation on a pool of its own runs ahead of training (driver/pipeline.py).
    pipeline = Pipeline(run, items, sampler) if cfg.rollout.mode != "sync" else None
    first = plan.step
    if plan.checkpoint is not None:
        stop.where = f"the load of {plan.checkpoint}"
        first = load_checkpoint(run, plan.checkpoint, plan.state, sampler, pipeline)
    if pipeline is not None:
        stop.where = "the first weight push"
        pipeline.start(first)
    if plan.checkpoint is not None or plan.continues:
        print(plan.describe(), flush=True)
    # Only now, with the workers up and the state loaded, is anything of the run written.
    remove_partial_checkpoints(plan.run_dir)
    # A run that continues from step 0 drops its step-0 row (validation before step 1), which it
    # writes again.
    kept = plan.step if plan.step else -1
    tracker = Tracker(plan.run_dir, to_yaml(cfg), cfg.tracking, cfg.name,
                      resume_step=kept if plan.checkpoint or plan.continues else None,
                      wandb_id=plan.state.get("wandb_id"))
    reached = first
    try:
        history = []
        for reached, metrics in _iterations(run, items, held_out, sampler, tracker, first,
                                            stop, identity, pipeline):
            history.append(metrics)
    finally:
        tracker.close()
    if reached == cfg.steps:
        summarize(cfg, tracker.metrics_path, plan.run_dir)
    return history, reached


def _iterations(run: Run, items, held_out, sampler, tracker: Tracker, first: int,
                stop: StopOnSignals, identity: dict[str, Any], pipeline: Pipeline | None):
    """Yields (step, metrics) after each iteration (``pipeline``'s where the run generates
    ahead of training), logged and checkpointed at their cadence."""
    cfg = run.config
    bar = tqdm(total=cfg.steps, initial=first, desc=f"{cfg.algorithm.name} {cfg.name}",
               unit="step")
    stop.steps_running = True
    try:
        if first == 0 and cfg.validation.due(0, cfg.steps):
            stop.where = "the validation before step 1"
            tracker.log(0, _validate(run, held_out, bar, 0))
        for step in range(first + 1, cfg.steps + 1):
            if stop.requested:  # before any step of this process: nothing new to save
                bar.write(f"SIGTERM: stopped before step {step}; run the same command to resume")
                break
            stop.where = f"step {step}"
            metrics = (pipeline.iteration() if pipeline is not None else
                       steps.iteration(run, lambda: [items[i] for i in next(sampler)]))
            if cfg.validation.due(step, cfg.steps):
                metrics.update(_validate(run, held_out, bar, step))
            tracker.log(step, metrics)
            run.groups.timeline.write(tracker.run_dir / TIMELINE, step)
            bar.update(1)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", kl=f"{metrics['kl']:.4f}")
            nonfinite = [k for k in metrics if k.endswith("/nonfinite_skipped") and metrics[k]]
            halt = bool(nonfinite) and cfg.on_nonfinite == "stop"
            every = cfg.checkpoint.every
            if halt or stop.requested or every and (step % every == 0 or step == cfg.steps):
                stop.where = f"the checkpoint of step {step}"
                saved = save(run, step, sampler, tracker, identity, pipeline)
                bar.write(f"step {step}: checkpoint {saved}")
            if halt:
                raise RunError(f"non-finite gradients at step {step} ("
                               + ", ".join(f"{k}={metrics[k]:g}" for k in nonfinite)
                               + " optimizer steps not applied); the last good state is "
                               f"saved in {saved}: look for the cause (rewards, learning "
                               "rate, dtype), or set on_nonfinite=skip to skip such steps")
            yield step, metrics
            if stop.requested:
                bar.write(f"SIGTERM: stopped after step {step}; run the same command to resume")
                break
    finally:
        bar.close()


def _validate(run: Run, held_out: list[PromptItem], bar, step: int) -> dict[str, float]:
    out = steps.validate(run, held_out)
    when = f"after step {step}" if step else "before step 1"
    bar.write(f"validation {when}: val/reward {out['val/reward']:.3f} over {len(held_out)} "
              "held-out prompts (greedy)")
    return out


# --------------------------------------------------------------------------------- checkpoints
def save(run: Run, step: int, sampler: PromptSampler, tracker: Tracker,
         identity: dict[str, Any], pipeline: Pipeline | None = None) -> Path:
    """A checkpoint of ``step``: the trained groups' states, the sampler and the controllers,
    and the batches in flight where generation runs ahead (``pipeline``)."""
    state = {**identity, "sampler": sampler.state_dict(), **run.controllers.state_dict(),
             "wandb_id": tracker.wandb_id}
    if pipeline is not None:
        state["in_flight"] = pipeline.state_dict()

    def write_parts(tmp: Path) -> None:
        for group in run.groups.trained():
            group.save(str(tmp))
        if pipeline is not None:
            pipeline.save(tmp)
    return save_checkpoint(tracker.run_dir, step, state, write_parts, run.config.checkpoint.keep)


def load_checkpoint(run: Run, path: Path, state: dict[str, Any], sampler: PromptSampler,
                    pipeline: Pipeline | None = None) -> int:
    """Restore what ``save`` wrote; the step it holds."""
    try:
        sampler.load_state_dict(state["sampler"])
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError("resume", f"{path}: its prompt sampler does not fit this run's data "
                                    f"({e})") from None
    for group in run.groups.trained():
        group.load(str(path))
    run.controllers.load_state_dict(state)
    if pipeline is not None:
        pipeline.load(path, state)
    return int(state["step"])


# --------------------------------------------------------------------------------- the end
def summarize(cfg, metrics_path: Path, run_dir: Path) -> None:
    """The reward curve's plot, and a line each for the reward, the validation reward and the
    measured against the predicted seconds."""
    all_rows = read_metrics(metrics_path)
    rows = [r for r in all_rows if "reward/mean" in r]  # a step-0 row holds validation only
    plot = run_dir / "reward_curve.png"
    plot_metric(metrics_path, "reward/mean", plot, title=cfg.name)
    k = max(1, len(rows) // 3)
    first = sum(r["reward/mean"] for r in rows[:k]) / k
    last = sum(r["reward/mean"] for r in rows[-k:]) / k
    print(f"reward/mean: {first:.3f} over the first {k} steps -> {last:.3f} over the last {k}",
          flush=True)
    val = [r for r in all_rows if "val/reward" in r]
    if val:
        print(f"val/reward (greedy, {cfg.validation.size} held-out prompts): "
              f"{val[0]['val/reward']:.3f} at step {val[0]['step']} -> "
              f"{val[-1]['val/reward']:.3f} at step {val[-1]['step']}", flush=True)
    warm = [r for r in rows if "throughput/tokens_per_s_per_gpu" in r][1:]  # step 1 warms up
    if warm:
        print(f"throughput: {_mean(warm, 'throughput/tokens_per_s_per_gpu'):.1f} tokens/s per "
              f"device (prompt + response, mean over steps 2 on), step "
              f"{_mean(warm, 'timing/step_s'):.2f} s", flush=True)
    timed = [r for r in rows if "predicted/step_s" in r][1:]  # the first step warms up
    if timed:
        names = [k.removeprefix("predicted/") for k in timed[0]
                 if k.startswith("predicted/") and "timing/" + k[10:] in timed[0]]
        print("measured / predicted seconds (mean over steps 2 on): " + ", ".join(
            f"{n.removesuffix('_s')} {_mean(timed, 'timing/' + n):.3g} / "
            f"{timed[0]['predicted/' + n]:.3g}" for n in names), flush=True)
    print(f"wrote {metrics_path} and {plot}", flush=True)


def _mean(rows: list[dict[str, float]], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


class StopOnSignals:
    """How a run answers SIGTERM (Slurm's preemption notice) and SIGINT (Ctrl-C), in the main
    thread (elsewhere it does nothing); ``with`` it around the whole run, the workers' start
    included.

    Once the steps run (``steps_running``), a first SIGTERM asks the loop to stop at the end of
    the current step, after a checkpoint (``requested``), and gives it ``grace_s`` seconds (0:
    as long as the step takes). Past them, at a second SIGTERM, at a SIGTERM before the steps,
    and at SIGINT, the run stops where it is (``where``): KeyboardInterrupt is raised in the main
    thread, into whatever it waits for (Ray's waits, a reward function, a sleep), and leaving the
    block turns it into ``Interrupted``. From then on both signals have their default action: a
    further one ends the process at once."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.where = "the workers' start"
        """What the run is doing, for the message of a stop there."""
        self.steps_running = False
        self.requested = False
        self._stopped_by: int | None = None  # the signal that stopped the run where it was
        self._expired = False
        self._timer: threading.Timer | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGTERM and self.steps_running and not self.requested:
            self.requested = True
            within = f" within ray.stop_timeout_s={self.grace_s:g}s" if self.grace_s else ""
            print(f"SIGTERM: stopping after this step with a checkpoint{within} (send it again "
                  "to stop now)", flush=True)
            if self.grace_s:
                self._timer = threading.Timer(self.grace_s, self._expire)
                self._timer.daemon = True
                self._timer.start()
            return
        self._stopped_by = signum
        for sig in self._previous:
            signal.signal(sig, signal.SIG_DFL)
        raise KeyboardInterrupt

    def _expire(self) -> None:
        """The grace is over: a SIGTERM of our own stops the run where it is."""
        if self._stopped_by is None:
            self._expired = True
            signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)

    def _message(self) -> str:
        name = signal.Signals(self._stopped_by).name
        why = (f", which did not end within ray.stop_timeout_s={self.grace_s:g}s of the SIGTERM"
               if self._expired else " at a second SIGTERM" if self.requested else "")
        return (f"{name}: stopped during {self.where}{why}; what it had not saved is lost, the "
                "last checkpoint (if any) is intact: run the same command to resume")

    def __enter__(self) -> "StopOnSignals":
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle)
                              for sig in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._stopped_by is not None and exc_type is not None and \
                issubclass(exc_type, KeyboardInterrupt):
            raise Interrupted(self._stopped_by, self._message()) from None
