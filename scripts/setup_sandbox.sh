#!/usr/bin/env bash
# The Python tool's sandbox (envs/sandbox.py): bubblewrap for its namespaces and read-only root,
# util-linux for prlimit and setpriv. Installs only the missing packages; safe to re-run.
set -euo pipefail

PACKAGES=(bubblewrap util-linux)
if ! command -v apt-get >/dev/null 2>&1; then
    echo "setup_sandbox: no apt-get; install bubblewrap (bwrap), prlimit and setpriv for the Python tool" >&2
    exit 1
fi
NAME=setup_sandbox
. "$(dirname "$0")/apt.sh"
apt_install "${PACKAGES[@]}"
echo "setup_sandbox: bubblewrap installed${MISSING[*]:+ (now: ${MISSING[*]})}"
