#!/usr/bin/env bash
# The README's test command: set everything up, then run the whole suite (slow tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Three test processes, one module at a time each (pytest-xdist), the longest modules first
# (tests/durations.json; xdist's own reorder, by test count, off): end-to-end runs leave the cores
# idle part of the time (waiting on the processes they start), which the other processes fill.
exec .venv/bin/python -m pytest -m "slow or not slow" -p no:cacheprovider -n 3 --dist loadfile --no-loadscope-reorder --durations=15 "$@"
