#!/usr/bin/env bash
# Sets up .venv and runs the test suite (GPU tests are skipped without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export CAPTUREPASS_VERIFY=1
exec .venv/bin/python -m pytest -q "$@"
