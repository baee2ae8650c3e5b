#!/usr/bin/env bash
# Creates .venv (once) and installs capturepass with its test dependencies into it. Touches
# nothing outside .venv: no system package, no browser (scripts/install_browser.sh, opt-in, does
# that for the browser test of the schedule page, which is skipped without one).
# torch is pinned to the CPU build that pip finds locally; the package itself accepts torch>=2.11.
# numpy is not a dependency of capturepass: it is torch's optional companion, installed here
# because importing torch without it warns "Failed to initialize NumPy" in every command.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  python3 -m venv .venv
fi
stamp=.venv/.capturepass-setup
want="$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: installing torch 2.13.0, numpy and capturepass[test] into .venv (pip's output: .venv/pip.log)"
  if ! .venv/bin/python -m pip install --disable-pip-version-check torch==2.13.0 numpy -e '.[test]' \
      > .venv/pip.log 2>&1; then
    tail -n 30 .venv/pip.log >&2
    echo "setup: pip failed; its whole output is in .venv/pip.log" >&2
    exit 1
  fi
  echo "$want" > "$stamp"
fi
