#!/usr/bin/env bash
# Installs Debian's prometheus package (prometheus and promtool) when either program is missing; run as root.
# Idempotent: does nothing when both are on PATH. It leaves the package's own service stopped and disabled
# (tests/deploy/test_monitoring.py starts its own prometheus on a free port with a config of its own).
set -euo pipefail

if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
    exit 0
fi
# policy-rc.d exit 101 tells invoke-rc.d not to start the services a package installs (inside containers too).
policy=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && created_policy=1
fi
trap 'if [ "$created_policy" = 1 ]; then rm -f "$policy"; fi' EXIT
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
if command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
    systemctl disable --now prometheus >/dev/null 2>&1 || true
fi
prometheus --version 2>&1 | head -n 1
