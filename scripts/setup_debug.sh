#!/usr/bin/env bash
# What crash reports and the memory-error tests need: gdb (native backtraces of every thread of a
# worker that dies of a signal, embodied/crash_report.py), a C compiler to build that signal
# handler once, and AddressSanitizer's runtime (tests/test_channel.py preloads it). Installs only
# the missing packages; safe to re-run. Without them crash reports hold Python's stacks alone.
set -euo pipefail

PACKAGES=(gdb gcc libasan8)
missing=()
for pkg in "${PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$pkg")
    fi
done
if [ ${#missing[@]} -eq 0 ]; then
    echo "setup_debug: gdb, gcc and libasan8 already installed"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "setup_debug: missing ${missing[*]}; crash reports will lack native backtraces" >&2
    exit 0
fi
NAME=setup_debug
. "$(dirname "$0")/apt.sh"
if ! "${APT[@]}" install -y --no-install-recommends "${missing[@]}"; then
    "${APT[@]}" update
    "${APT[@]}" install -y --no-install-recommends "${missing[@]}"
fi
echo "setup_debug: installed ${missing[*]}"
