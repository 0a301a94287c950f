#!/usr/bin/env bash
# A headless browser for the tests: Debian's Chromium and its WebDriver (tests/test_report.py
# opens an eval report in it, plays a video and keeps a screenshot). Users need none of it: the
# report is a plain HTML file. Installs only the missing packages; safe to re-run.
set -euo pipefail

PACKAGES=(chromium chromium-driver)
if ! command -v apt-get >/dev/null 2>&1; then
    echo "setup_browser: no apt-get; install Chromium and its WebDriver (tests/test_report.py needs them)" >&2
    exit 1
fi
NAME=setup_browser
. "$(dirname "$0")/apt.sh"
apt_install "${PACKAGES[@]}"
echo "setup_browser: chromium and chromedriver installed${MISSING[*]:+ (now: ${MISSING[*]})}"
