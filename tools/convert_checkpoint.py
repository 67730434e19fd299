#!/usr/bin/env python
"""Convert between HF checkpoints and Megatron-Core distributed checkpoints (CPU, gloo).

    python tools/convert_checkpoint.py hf-to-megatron --hf DIR --out DIR --tp T --pp P
    python tools/convert_checkpoint.py megatron-to-hf --ckpt DIR --out DIR [--hf-config-from DIR]

A Megatron checkpoint saved at one (tp, pp) loads at any other. megatron-to-hf also exports the
actor of an RL run's checkpoint: --ckpt a run directory (its newest complete checkpoint), a
<run>/checkpoints/step_N directory, or its actor/ folder. An RL checkpoint holds no tokenizer:
--hf-config-from the model the run started from adds one (without it, none is copied). The actor
of a LoRA run exports merged, with its adapters alone in PEFT's format in <out>/lora. The logic
lives in hybridflow.training.megatron_ckpt; this file only parses arguments. Exit status 2 on bad
input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="convert_checkpoint", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    to_mg = sub.add_parser("hf-to-megatron", help="HF safetensors -> Megatron dist checkpoint")
    to_mg.add_argument("--hf", required=True, help="HF checkpoint directory (config.json, "
                                                   "*.safetensors, tokenizer)")
    to_mg.add_argument("--out", required=True, help="Megatron checkpoint directory to write")
    to_mg.add_argument("--tp", type=_positive, default=1, help="tensor-parallel size to save from")
    to_mg.add_argument("--pp", type=_positive, default=1,
                       help="pipeline-parallel size to save from")
    to_mg.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default="auto",
                       help="stored dtype; auto keeps bf16 and stores anything else as fp32")
    to_hf = sub.add_parser("megatron-to-hf", help="Megatron dist checkpoint -> HF safetensors")
    to_hf.add_argument("--ckpt", required=True,
                       help="Megatron checkpoint directory, or an RL run directory / its "
                            "checkpoints/step_N directory (exports the actor)")
    to_hf.add_argument("--out", required=True, help="HF checkpoint directory to write")
    to_hf.add_argument("--hf-config-from", default=None,
                       help="HF directory whose config.json (and tokenizer) to use; needed only "
                            "for checkpoints without hybridflow_model.json, or for a tokenizer "
                            "(RL checkpoints hold none)")
    to_hf.add_argument("--tp", type=_positive, default=1, help="tensor-parallel size to load at")
    to_hf.add_argument("--pp", type=_positive, default=1, help="pipeline-parallel size to load at")
    for p in (to_mg, to_hf):
        p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
        p.add_argument("--quiet", action="store_true", help="print nothing but errors")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from hybridflow.errors import ConfigError
    from hybridflow.training import megatron_ckpt

    try:
        if args.command == "hf-to-megatron":
            megatron_ckpt.hf_to_megatron_checkpoint(args.hf, args.out, tp=args.tp, pp=args.pp,
                                                    dtype=args.dtype, overwrite=args.overwrite,
                                                    verbose=not args.quiet)
        else:
            megatron_ckpt.megatron_to_hf_checkpoint(args.ckpt, args.out,
                                                    hf_config_from=args.hf_config_from,
                                                    tp=args.tp, pp=args.pp,
                                                    overwrite=args.overwrite,
                                                    verbose=not args.quiet)
    except ConfigError as e:
        if e.field == "model":  # the library's name for the HF checkpoint; here it is a flag
            e = ConfigError("--hf" if args.command == "hf-to-megatron" else "--hf-config-from",
                            e.message)
        print(f"convert_checkpoint: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
