#!/usr/bin/env bash
# One machine: `bash launch/local.sh CONFIG [key=value ...]` runs `hybridflow train` with Ray
# started locally (loopback). On a GPU machine each rank takes one GPU.
set -euo pipefail
source "$(dirname "$0")/_setup.sh"
cd "$root"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
export WANDB_MODE=${WANDB_MODE:-offline}
gpu=()
if command -v nvidia-smi >/dev/null 2>&1; then gpu=(ray.gpus_per_worker=1); fi
exec hybridflow train "$@" "${gpu[@]}"
