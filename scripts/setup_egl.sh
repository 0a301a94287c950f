#!/usr/bin/env bash
# Headless OpenGL for MuJoCo (LIBERO renders its cameras with MUJOCO_GL=egl): the EGL loader,
# Mesa's EGL and software (llvmpipe) drivers, and what opencv needs (libGL, glib). A bare Debian
# bookworm image lacks them. Installs only the missing packages; safe to re-run. Machines with an
# NVIDIA GPU still want these for the loader (the GPU driver brings its own EGL vendor library).
set -euo pipefail

PACKAGES=(libegl1 libegl-mesa0 libgl1-mesa-dri libgl1 libglib2.0-0)
missing=()
for pkg in "${PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$pkg")
    fi
done
if [ ${#missing[@]} -eq 0 ]; then
    echo "setup_egl: EGL already installed"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "setup_egl: missing ${missing[*]}; install your distribution's EGL and Mesa packages" >&2
    exit 1
fi
NAME=setup_egl
. "$(dirname "$0")/apt.sh"
if ! "${APT[@]}" install -y --no-install-recommends "${missing[@]}"; then
    "${APT[@]}" update
    "${APT[@]}" install -y --no-install-recommends "${missing[@]}"
fi
echo "setup_egl: installed ${missing[*]}"
