#!/usr/bin/env bash
# The README's test command: set everything up, then run the whole suite (slow tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two test processes, one module at a time each (pytest-xdist): end-to-end runs leave the cores idle
# about a fifth of the time (waiting on the processes they start), which the other process fills.
exec .venv/bin/python -m pytest -m "slow or not slow" -p no:cacheprovider -n 2 --dist loadfile --durations=15 "$@"
