#!/usr/bin/env bash
# Sets up .venv and runs the main demo: a MoE block with a shared expert, on the CPU by default.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/moe_shared_expert.py "$@"
