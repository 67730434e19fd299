"""``hybridflow`` command line: ``hybridflow COMMAND [CONFIG] [key=value ...]``.

A user mistake (a config key, a value, a layout that cannot exist, a bad file) ends with one line
naming the field and the fix, and exit code 2; nothing is written before the config is valid.
"""

from __future__ import annotations

import argparse
import sys

from hybridflow.config.errors import ConfigError
from hybridflow.parallel.layout import LayoutError


def _jobs():
    # Imported lazily: `hybridflow --help` should not pay for torch and megatron.
    from hybridflow.training import lm_demo
    return {"lm-demo": (lm_demo.LMDemoConfig, lm_demo.run,
                        "train a tiny Llama on a copy task with Megatron-Core at a TP/PP/DP layout")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hybridflow", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser("lm-demo", help="Megatron-Core copy-task training demo (CPU or GPU)")
    run_p.add_argument("config", nargs="?", help="YAML config (optional)")
    run_p.add_argument("overrides", nargs="*", help="key=value, e.g. layout.tp=1 steps=20")
    defaults_p = sub.add_parser("defaults", help="print a command's default config as YAML")
    defaults_p.add_argument("job", choices=["lm-demo"])
    args = parser.parse_args(argv)

    from hybridflow.config import load_config, to_yaml
    try:
        if args.command == "defaults":
            cls, _, _ = _jobs()[args.job]
            print(to_yaml(cls()), end="")
            return 0
        cls, run, _ = _jobs()[args.command]
        config, overrides = args.config, list(args.overrides)
        if config is not None and "=" in config:  # no file given, only overrides
            config, overrides = None, [config, *overrides]
        cfg = load_config(cls, config, overrides)
        run(cfg)
        return 0
    except (ConfigError, LayoutError) as e:
        print(f"hybridflow: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
