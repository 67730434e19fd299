"""``hybridflow`` command line: ``hybridflow COMMAND [CONFIG] [key=value ...]``.

A user mistake (a config key, a value, a layout that cannot exist, a bad file) ends with one line
naming the key and the fix, and exit code 2; nothing is written before the config is valid. A run
that stops on a fault is one line and exit code 1; one that a signal stopped where it was, 128 +
the signal's number (143 for SIGTERM, 130 for SIGINT).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hybridflow.errors import ConfigError, Interrupted, RunError
from hybridflow.planner.calibrate import calibrate
from hybridflow.planner.profile import profile_passes

JOBS = ("train", "check", "plan", "lm-demo")
HELP = {"train": "RL post-training (PPO, GRPO, ReMax, RLOO, REINFORCE++, Safe-RLHF)",
        "check": "validate an RL config without starting anything: layouts, world sizes, the "
                 "reshard's bytes per rank",
        "plan": "rank the mappings of an RL config onto its devices (layouts, generation tp, "
                "micro-batch) by the cost model's step time, with cluster.calibration's rates",
        "lm-demo": "Megatron-Core copy-task training demo at a TP/PP/DP layout"}


def _jobs():
    # Imported lazily: `hybridflow --help` should not pay for torch and megatron.
    from hybridflow import lm_demo
    from hybridflow.config import RLConfig
    return {"train": (RLConfig, _train), "check": (RLConfig, _check), "plan": (RLConfig, _plan),
            "lm-demo": (lm_demo.LMDemoConfig, lm_demo.run)}


def _train(cfg) -> None:
    from hybridflow.trainer import RLTrainer  # deferred: it imports torch, transformers
    trainer = RLTrainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.close()


def _check(cfg) -> None:
    # deferred: these import torch
    from hybridflow.preflight import check_run
    from hybridflow.planner.search import plan_layout, run_prediction
    cfg = plan_layout(cfg)
    checked = check_run(cfg)
    print(checked.summary(cfg))
    prediction = run_prediction(cfg, checked.shapes)
    if prediction is not None:
        print(prediction.describe(cfg.cluster.calibration))
    print("config OK")


def _plan(cfg) -> None:
    from hybridflow.planner.search import plan_lines  # deferred: it imports torch
    print("\n".join(plan_lines(cfg)))


def _calibrate(out: str, quick: bool, config: str | None, overrides: list[str],
               configured_only: bool = False) -> None:
    directory = Path(out).parent
    if not directory.is_dir():  # checked first: the measurement takes minutes
        raise ConfigError("--out", f"{out}: directory {directory} does not exist; create it or "
                                   "choose another FILE")
    cfg = None
    if config is not None and "=" in config:  # no file given, only overrides (as for train)
        config, overrides = None, [config, *overrides]
    if config is not None or overrides:  # a bad config stops it before anything is measured
        from hybridflow.config import RLConfig, load_config  # deferred: it imports torch
        cfg = load_config(RLConfig, config, overrides)
    cluster = cfg.ray if cfg is not None and cfg.ray.address != "local" else None
    if cluster is not None:  # an unreachable cluster stops it before anything is measured
        from hybridflow.workers.group import check_ray_address  # deferred: it imports torch
        check_ray_address(cluster.address)
    calibration = calibrate(quick=quick, cluster=cluster)
    if cfg is not None:
        lora = cfg.actor.lora
        print(f"profiling {cfg.model}'s passes ({cfg.actor.engine.dtype}, "
              f"tp={cfg.actor.layout.tp}{f', LoRA rank {lora.rank}' if lora.enabled else ''})...",
              flush=True)
        calibration.passes.append(profile_passes(cfg, calibration, quick=quick,
                                                 configured_only=configured_only))
        print(calibration.passes[-1].describe())
    try:
        calibration.to_json(out)
    except OSError as e:
        raise ConfigError("--out", f"{out}: cannot write it ({e.strerror}); choose another "
                                   "FILE") from None
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hybridflow", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for job in JOBS:
        run_p = sub.add_parser(job, help=HELP[job])
        run_p.add_argument("config", nargs="?", metavar="CONFIG", help="YAML config (optional)")
        run_p.add_argument("overrides", nargs="*",
                           help="key=value, e.g. steps=20 actor.layout.pp=2")
    defaults_p = sub.add_parser("defaults", help="print a command's default config as YAML")
    defaults_p.add_argument("job", choices=("train", "lm-demo"))
    calibrate_p = sub.add_parser("calibrate", help="measure this machine's matmul, memory and "
                                                   "collective rates, and what a micro-batch "
                                                   "and a pipeline stage cost, for the planner; "
                                                   "with a config whose ray.address is a "
                                                   "cluster's, also the rate between two of its "
                                                   "nodes")
    calibrate_p.add_argument("--out", default="calibration.json", metavar="FILE",
                             help="JSON file to write (default: calibration.json)")
    calibrate_p.add_argument("--quick", action="store_true",
                             help="small sizes, few repeats: seconds, rough rates")
    calibrate_p.add_argument("--config", metavar="CONFIG",
                             help="also measure the efficiencies of this run config's model "
                                  "passes (forward, training step, generate); where its "
                                  "ray.address is a cluster's (auto, host:port), also the "
                                  "inter-node rate between two of its nodes")
    calibrate_p.add_argument("--configured-sizes", action="store_true",
                             help="with --config: profile only its micro-batch sizes, not every "
                                  "size the planner may pick (minutes on a CPU, not a quarter "
                                  "hour; other sizes read the nearest measured one)")
    calibrate_p.add_argument("overrides", nargs="*", help="key=value overrides of --config")
    args = parser.parse_args(argv)

    from hybridflow.config import load_config, to_yaml  # deferred: it imports torch
    try:
        if args.command == "defaults":
            cls, _ = _jobs()[args.job]
            print(to_yaml(cls()), end="")
            return 0
        if args.command == "calibrate":
            if args.configured_sizes and args.config is None and not args.overrides:
                parser.error("--configured-sizes profiles a config's passes: give --config")
            _calibrate(args.out, args.quick, args.config, args.overrides, args.configured_sizes)
            return 0
        cls, run = _jobs()[args.command]
        config, overrides = args.config, list(args.overrides)
        if config is not None and "=" in config:  # no file given, only overrides
            config, overrides = None, [config, *overrides]
        cfg = load_config(cls, config, overrides)
        run(cfg)
        return 0
    except ConfigError as e:
        print(f"hybridflow: error: {e}", file=sys.stderr)
        return 2
    except RunError as e:
        print(f"hybridflow: run stopped: {e}", file=sys.stderr)
        return 128 + e.signum if isinstance(e, Interrupted) else 1
    except KeyboardInterrupt:  # Ctrl-C before a run handles it (loading, checking)
        print("hybridflow: interrupted (SIGINT)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
