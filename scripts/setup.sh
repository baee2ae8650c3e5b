#!/usr/bin/env bash
# Creates .venv (once) and installs capturepass with its test dependencies into it.
# torch is pinned to the CPU build that pip finds locally; the package itself accepts torch>=2.11.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=.venv/.capturepass-setup
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 -e '.[test]'
  echo "$want" > "$stamp"
fi
