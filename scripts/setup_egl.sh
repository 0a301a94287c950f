#!/usr/bin/env bash
# Headless OpenGL for MuJoCo (LIBERO renders its cameras with MUJOCO_GL=egl): the EGL loader,
# Mesa's EGL and software (llvmpipe) drivers, and what opencv needs (libGL, glib). A bare Debian
# bookworm image lacks them. Installs only the missing packages; safe to re-run. Machines with an
# NVIDIA GPU still want these for the loader (the GPU driver brings its own EGL vendor library).
set -euo pipefail

PACKAGES=(libegl1 libegl-mesa0 libgl1-mesa-dri libgl1 libglib2.0-0)
if ! command -v apt-get >/dev/null 2>&1; then
    echo "setup_egl: no apt-get; install your distribution's EGL and Mesa packages" >&2
    exit 1
fi
NAME=setup_egl
. "$(dirname "$0")/apt.sh"
apt_install "${PACKAGES[@]}"
echo "setup_egl: EGL installed${MISSING[*]:+ (now: ${MISSING[*]})}"
