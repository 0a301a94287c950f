#!/usr/bin/env bash
# LIBERO in a virtualenv that already has the `libero` extra (scripts/setup.sh installs it):
# the libero package without its declared dependencies (robomimic -> torchvision, which the
# project must not pull), robosuite's private macros file (robosuite's documented setup, which
# also silences its warning at every import) and LIBERO's config file (without it, importing
# LIBERO asks on stdin). Safe to re-run. Usage: scripts/setup_libero.sh [VENV]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
PY=$VENV/bin/python
. scripts/install.sh

if ! "$PY" -m pip show -q libero >/dev/null 2>&1; then
    install_into "$VENV" --no-deps "libero==0.1.1"
fi
ROBOSUITE=$("$PY" -c "import importlib.util as u; print(u.find_spec('robosuite').submodule_search_locations[0])")
if [ ! -f "$ROBOSUITE/macros_private.py" ]; then
    "$PY" "$ROBOSUITE/scripts/setup_macros.py" 2>/dev/null
fi
"$PY" -c "from envs.libero import ensure_libero_config; print('setup_libero: LIBERO config', ensure_libero_config())"
