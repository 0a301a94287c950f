#!/usr/bin/env bash
# The README's test command: set everything up, then run the whole suite (slow tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -m "slow or not slow" -p no:cacheprovider --durations=15 "$@"
