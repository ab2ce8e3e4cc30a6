#!/usr/bin/env bash
# The browser tests' headless Chromium and its driver (Debian's packages), installed when missing.
# apt needs root, or sudo without a password; without either this says so and the browser tests
# fail naming what to install.
set -uo pipefail
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
  exit 0
fi
SUDO=$([ "$(id -u)" = 0 ] || echo "sudo -n")
if ! { $SUDO apt-get update -q && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
      --no-install-recommends chromium chromium-driver >/dev/null; }; then
  echo "could not install chromium chromium-driver (apt needs root or sudo): the browser tests will fail" >&2
fi
exit 0
