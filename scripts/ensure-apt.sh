#!/usr/bin/env bash
# Install the named Debian packages that are missing (as root), without recommends:
# scripts/ensure-apt.sh WHO PACKAGE...   (WHO prefixes the messages: setup, setup-kernels)
set -euo pipefail
who=$1
shift
missing=""
for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing="$missing $pkg"
done
if [ -n "$missing" ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "$who: need root to install:$missing" >&2
        exit 1
    fi
    echo "$who: installing apt packages:$missing"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi
