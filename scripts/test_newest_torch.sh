#!/usr/bin/env bash
# Runs the test suite on the newest torch release (2.14.1), in .venv-torch-newest (made once;
# again when pyproject.toml changes). capturepass accepts torch 2.11 and newer by detecting
# features; scripts/test.sh runs the suite on 2.13.0, the CPU build CI installs. torch 2.14.1
# is a CUDA build (about 5.5 GB with its CUDA libraries); without a GPU its GPU tests skip.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=2.14.1
venv=.venv-torch-newest
stamp=$venv/.capturepass-setup
want="torch==$TORCH_VERSION $(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || [ ! -x "$venv/bin/python" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  echo "setup: installing torch $TORCH_VERSION, numpy and capturepass[test] into $venv (pip's output: $venv/pip.log)"
  if ! "$venv/bin/python" -m pip install --disable-pip-version-check "torch==$TORCH_VERSION" numpy -e '.[test]' \
      > "$venv/pip.log" 2>&1; then
    tail -n 30 "$venv/pip.log" >&2
    echo "setup: pip failed; its whole output is in $venv/pip.log" >&2
    exit 1
  fi
  echo "$want" > "$stamp"
fi
"$venv/bin/python" -c "import torch; print('torch', torch.__version__)"
export CAPTUREPASS_VERIFY=1
exec "$venv/bin/python" -m pytest -q -n "${CAPTUREPASS_TEST_WORKERS:-auto}" --dist loadscope "$@"  # as scripts/test.sh
