# shellcheck shell=bash
# Sourced by the setup scripts that install Debian packages, after they set NAME (for messages):
# APT is apt-get as root (directly, or through sudo as SUDO), non-interactive, waiting up to ten
# minutes for another apt to finish.
SUDO=()
if [ "$(id -u)" -ne 0 ]; then
    if ! command -v sudo >/dev/null 2>&1; then
        echo "$NAME: needs root (apt-get) and sudo is missing; run it as root" >&2
        exit 1
    fi
    SUDO=(sudo)
fi
APT=("${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -q -o DPkg::Lock::Timeout=600)
