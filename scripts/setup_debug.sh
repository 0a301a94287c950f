#!/usr/bin/env bash
# What crash reports and the memory-error tests need: gdb (native backtraces of every thread of a
# worker that dies of a signal, embodied/crash_report.py), a C compiler to build that signal
# handler once, and AddressSanitizer's runtime (tests/test_channel.py preloads it). Installs only
# the missing packages; safe to re-run. Without them crash reports hold Python's stacks alone.
set -euo pipefail

PACKAGES=(gdb gcc libasan8)
if ! command -v apt-get >/dev/null 2>&1; then
    echo "setup_debug: no apt-get; crash reports will lack native backtraces without gdb and gcc" >&2
    exit 0
fi
NAME=setup_debug
. "$(dirname "$0")/apt.sh"
apt_install "${PACKAGES[@]}"
echo "setup_debug: gdb, gcc and libasan8 installed${MISSING[*]:+ (now: ${MISSING[*]})}"
