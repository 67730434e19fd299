#!/usr/bin/env bash
# The CPU quickstart: sets up .venv if needed (launch/_setup.sh), then runs GRPO on
# SmolLM2-135M-Instruct (experiments/quickstart_grpo.yaml) and writes the reward curve.
# Extra arguments are config overrides, e.g. `bash launch/quickstart.sh steps=4`.
set -euo pipefail
source "$(dirname "$0")/_setup.sh"
cd "$root"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=${WANDB_MODE:-offline}
exec hybridflow train experiments/quickstart_grpo.yaml "$@"
