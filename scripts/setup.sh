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
# Chromium (Debian's package) for the headless-browser test of the schedule page
# (tests/test_viewer.py skips without it). Installed only where apt-get exists and
# no chromium is present; never fails the setup.
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "setup: no apt-get here; not installing chromium (the browser test will be skipped)"
  else
    sudo=""
    if [ "$(id -u)" != 0 ]; then
      if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo="sudo -n"; fi
    fi
    if [ "$(id -u)" != 0 ] && [ -z "$sudo" ]; then
      echo "setup: not root and no passwordless sudo; not installing chromium (the browser test will be skipped)"
    elif ! { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium; } >/tmp/capturepass-chromium-install.log 2>&1; then
      echo "setup: installing chromium failed (see /tmp/capturepass-chromium-install.log); the browser test will be skipped"
    fi
  fi
fi
