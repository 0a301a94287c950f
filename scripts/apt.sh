# shellcheck shell=bash
# Sourced by the setup scripts that install Debian packages, after they set NAME (for messages):
# APT is apt-get as root (directly, or through sudo as SUDO), non-interactive, waiting up to ten
# minutes for another apt to finish; apt_install installs the packages of its arguments that are
# missing (MISSING lists them), updating the package lists once if the first try fails.
SUDO=()
if [ "$(id -u)" -ne 0 ]; then
    if ! command -v sudo >/dev/null 2>&1; then
        echo "$NAME: needs root (apt-get) and sudo is missing; run it as root" >&2
        exit 1
    fi
    SUDO=(sudo)
fi
APT=("${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -q -o DPkg::Lock::Timeout=600)

missing_packages() {
    MISSING=()
    for pkg in "$@"; do
        if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
            MISSING+=("$pkg")
        fi
    done
}

apt_install() {
    missing_packages "$@"
    [ ${#MISSING[@]} -eq 0 ] && return 0
    if ! "${APT[@]}" install -y --no-install-recommends "${MISSING[@]}"; then
        "${APT[@]}" update
        "${APT[@]}" install -y --no-install-recommends "${MISSING[@]}"
    fi
}
