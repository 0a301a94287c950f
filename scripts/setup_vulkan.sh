#!/usr/bin/env bash
# A CPU Vulkan device for ManiSkill/SAPIEN, which needs one even for state observations.
#
# Debian bookworm's own lavapipe (Mesa 22.3) is too old for SAPIEN ("Failed to find a supported
# physical device"); Mesa 25's lavapipe from bookworm-backports works. Rather than upgrading the
# system's Mesa, this unpacks only that driver into $LAVAPIPE_DIR (default /opt/lavapipe) with an
# ICD json naming it; envs/maniskill.py points VK_ICD_FILENAMES at that json by itself when the
# folder exists (and the user has not chosen a Vulkan driver). The Vulkan loader and the driver's
# runtime libraries come from bookworm itself; `ldd -r` checks that every symbol resolves.
# Other distributions get their own mesa-vulkan-drivers, which must be Mesa 25 or newer.
# Machines with an NVIDIA GPU are left alone: its driver brings Vulkan.
# Runs as root (or through sudo); safe to re-run.
set -euo pipefail

DEST=${LAVAPIPE_DIR:-/opt/lavapipe}
ICD="$DEST/lvp_icd.json"
LIB="$DEST/libvulkan_lvp.so"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup_vulkan: NVIDIA GPU found, using its Vulkan driver"
    exit 0
fi
if [ -f "$ICD" ] && [ -f "$LIB" ] && ! ldd -r "$LIB" 2>&1 | grep -q -e "not found" -e "undefined symbol"; then
    echo "setup_vulkan: lavapipe already in $DEST"
    exit 0
fi

NAME=setup_vulkan
. "$(dirname "$0")/apt.sh"

. /etc/os-release
if [ "${VERSION_CODENAME:-}" != "bookworm" ]; then
    "${APT[@]}" update
    "${APT[@]}" install -y --no-install-recommends libvulkan1 mesa-vulkan-drivers
    echo "setup_vulkan: installed ${PRETTY_NAME:-this system}'s mesa-vulkan-drivers" \
         "$(dpkg-query -W -f='${Version}' mesa-vulkan-drivers); SAPIEN needs Mesa >= 25"
    exit 0
fi

# A private apt state for bookworm-backports, so that the system's sources stay as they are.
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/lists/partial" "$WORK/archives/partial" "$WORK/debs" "$WORK/root"
echo "deb http://deb.debian.org/debian bookworm-backports main" > "$WORK/sources.list"
BPO=(-o Dir::Etc::SourceList="$WORK/sources.list" -o Dir::Etc::SourceParts=/dev/null
     -o Dir::State::Lists="$WORK/lists" -o Dir::Cache="$WORK" -o Dir::Cache::archives="$WORK/archives"
     -o APT::Sandbox::User=root)
"${APT[@]}" "${BPO[@]}" update
(cd "$WORK/debs" && "${APT[@]}" "${BPO[@]}" download mesa-vulkan-drivers)
DEB=$(ls "$WORK"/debs/mesa-vulkan-drivers_*.deb)
VERSION=$(dpkg-deb -f "$DEB" Version)
if [ "${VERSION%%.*}" -lt 25 ]; then
    echo "setup_vulkan: bookworm-backports has mesa-vulkan-drivers $VERSION; SAPIEN needs >= 25" >&2
    exit 1
fi

# The driver's runtime libraries by name from bookworm (its version floors are for the other
# drivers in the package; lavapipe resolves against bookworm's, which ldd -r checks below).
DEPS=$(dpkg-deb -f "$DEB" Depends | tr ',' '\n' | sed -e 's/(.*)//' -e 's/|.*//' -e 's/ //g' | grep -v '^$')
"${APT[@]}" update
# shellcheck disable=SC2086
"${APT[@]}" install -y --no-install-recommends --no-upgrade $DEPS

dpkg-deb -x "$DEB" "$WORK/root"
"${SUDO[@]}" mkdir -p "$DEST"
"${SUDO[@]}" install -m 644 "$(find "$WORK/root" -name libvulkan_lvp.so | head -n 1)" "$LIB"
if ldd -r "$LIB" 2>&1 | grep -e "not found" -e "undefined symbol"; then
    echo "setup_vulkan: $LIB has unresolved libraries or symbols (above)" >&2
    exit 1
fi
printf '{\n  "file_format_version": "1.0.0",\n  "ICD": {"library_path": "%s", "api_version": "%s"}\n}\n' \
    "$LIB" "$(sed -n 's/.*"api_version": *"\([^"]*\)".*/\1/p' "$WORK/root/usr/share/vulkan/icd.d/lvp_icd.json")" \
    | "${SUDO[@]}" tee "$ICD" >/dev/null
echo "$VERSION" | "${SUDO[@]}" tee "$DEST/VERSION" >/dev/null
echo "setup_vulkan: Mesa $VERSION lavapipe in $DEST (ICD $ICD)"
