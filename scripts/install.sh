# shellcheck shell=bash
# Sourced by the setup scripts. install_into VENV ARGS... installs ARGS (pip install's arguments)
# into the virtualenv VENV with uv when VENV has it, else with pip. uv installs the project's
# extras at the same versions as pip (compared package by package) in 53 s from an empty cache
# instead of pip's 192 s with a warm one, on a 2-core VM. uv does not read pip's configuration, so
# the options pip takes from it (config files and PIP_* variables: index URLs, find-links,
# constraints) are handed to uv; local folders that do not exist are left out, as pip skips them
# with a warning, and every index is searched for the best match, as pip does (uv's default takes
# a package from the first index that has it). uv, unlike pip, leaves the bytecode to the first
# import, and where PYTHONDONTWRITEBYTECODE is set (it is on these machines) that is every import of
# every process: `import torch, transformers, mani_skill.envs, ray, gymnasium, peft` took 18.9 s
# instead of 7.8 s, and CI's run of the test command went from 2022 to 3261 s.
install_into() {
    local venv=$1
    shift
    if [ -x "$venv/bin/uv" ]; then
        local options
        mapfile -t options < <("$venv/bin/python" - <<'EOF'
import os
import re
import subprocess
import sys
from urllib.parse import urlparse

# pip's effective configuration, the environment's PIP_* over its files ("global.", "install.", ":env:.")
listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
config = {}
for line in listed.splitlines():
    match = re.match(r"^(global|install|:env:)\.([a-z-]+)='(.*)'$", line)
    if match and (match[1] == ":env:" or match[2] not in config or config[match[2]][0] != ":env:"):
        config[match[2]] = (match[1], match[3])
FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint"}
for key, flag in FLAGS.items():
    for value in config.get(key, ("", ""))[1].split():
        if value.startswith("file:"):
            local = urlparse(value).path
        elif "://" in value:
            local = None  # a remote index: passed on as it is
        else:
            local = value
        if local is None or os.path.exists(local):
            print(flag)
            print(value)
EOF
        )
        "$venv/bin/uv" pip install --quiet --python "$venv/bin/python" --index-strategy unsafe-best-match \
            --compile-bytecode "${options[@]}" "$@"
    else
        "$venv/bin/python" -m pip --disable-pip-version-check -q install "$@"
    fi
}
