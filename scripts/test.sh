#!/usr/bin/env bash
# Sets up .venv and runs the test suite (GPU tests are skipped without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export CAPTUREPASS_VERIFY=1
# Two or more processes (pytest-xdist, one per core; CAPTUREPASS_TEST_WORKERS=0: this one):
# most of the suite is Inductor compiling, one core's work at a time. loadscope keeps a module's
# tests in one worker, so its module fixtures (the zoo's models, built once) are built once.
exec .venv/bin/python -m pytest -q -n "${CAPTUREPASS_TEST_WORKERS:-auto}" --dist loadscope "$@"
