#!/usr/bin/env bash
# The README's test command: set everything up, then run the whole suite (slow tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Three test processes, one module at a time each (pytest-xdist), the longest modules first
# (tests/durations.json; xdist's own reorder, by test count, off): end-to-end runs leave the cores
# idle part of the time (waiting on the processes they start), which the other processes fill.
# One thread per process: three processes (and their Ray workers, which Ray already gives one) on
# two cores; torch's two OpenMP threads spin-wait for each other across processes (measured on 7
# modules: 298 -> 282 s, 580 -> 549 CPU-seconds).
export OMP_NUM_THREADS=1
exec .venv/bin/python -m pytest -m "slow or not slow" -p no:cacheprovider -n 3 --dist loadfile --no-loadscope-reorder --durations=15 "$@"
