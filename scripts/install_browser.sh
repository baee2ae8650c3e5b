#!/usr/bin/env bash
# Opt-in: installs a headless browser for the schedule page's browser test (tests/show/test_page.py,
# skipped without one). Unlike scripts/setup.sh, this changes the machine outside the project:
# it installs Debian's `chromium` package system-wide with apt-get (on a bare Debian 13 about 130
# packages, 350 MB). Without --yes (or CAPTUREPASS_INSTALL_BROWSER=1) it only says what it would do.
#   bash scripts/install_browser.sh          # tells what it would install; installs nothing
#   bash scripts/install_browser.sh --yes    # installs it (as root, or with passwordless sudo)
set -euo pipefail
yes=${CAPTUREPASS_INSTALL_BROWSER:-0}
for arg in "$@"; do
  case "$arg" in
    --yes|-y) yes=1 ;;
    -h|--help) sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "install_browser: unknown argument $arg (use --yes to install)" >&2; exit 2 ;;
  esac
done
for name in chromium chromium-browser google-chrome google-chrome-stable; do
  if command -v "$name" >/dev/null 2>&1; then
    echo "install_browser: $(command -v "$name") is already installed; nothing to do"
    exit 0
  fi
done
echo "install_browser: no chromium found. The browser test of the schedule page needs one."
echo "  It would install Debian's 'chromium' package and its dependencies system-wide:"
echo "  apt-get update; apt-get install -y chromium   (on a bare Debian 13: about 130 packages, 350 MB)"
if [ "$yes" != 1 ]; then
  echo "install_browser: nothing installed. Run 'bash scripts/install_browser.sh --yes' (or set"
  echo "  CAPTUREPASS_INSTALL_BROWSER=1) to install it; without it the browser test is skipped."
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_browser: no apt-get on this machine: install chromium with its package manager" >&2
  exit 1
fi
sudo=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    sudo="sudo -n"
  else
    echo "install_browser: not root and no passwordless sudo: run it as root" >&2
    exit 1
  fi
fi
log=$(mktemp /tmp/capturepass-browser-install.XXXXXX.log)
echo "install_browser: installing (apt-get's output: $log)"
if ! { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium; } >"$log" 2>&1; then
  tail -n 20 "$log" >&2
  echo "install_browser: apt-get failed (see $log)" >&2
  exit 1
fi
echo "install_browser: installed $(command -v chromium || echo chromium)"
