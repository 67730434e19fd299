#!/usr/bin/env bash
# The test suite: sets up .venv if needed (see launch/_setup.sh), then runs pytest.
# Extra arguments go to pytest, e.g. `bash tests/run.sh tests/unit -k gae`.
set -euo pipefail
source "$(dirname "$0")/../launch/_setup.sh"
cd "$root"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline
set +e
python -m pytest "${@:-tests}"
rc=$?
set -e
# pytest exits 5 when it collected no test: with an explicit selection that is a user mistake
# worth saying so; for the whole suite it means the tests are gone, which must fail too.
if [ "$rc" -eq 5 ]; then echo "tests/run.sh: no test was collected for: ${*:-tests}" >&2; fi
exit "$rc"
