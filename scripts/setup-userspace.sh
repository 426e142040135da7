#!/usr/bin/env bash
# Set-up for `make test-userspace` (as root, on Debian): everything `make setup` installs,
# mmdebstrap, then for each Debian suite named (trixie, sid, ...) a root filesystem built
# from Debian's packages in .cache/userspace/<suite>/root with the packages the kernel
# tests drive, and in it the project's virtual environment, made with that root's Python:
#   scripts/setup-userspace.sh SUITE...
# A root is rebuilt only when its inputs change (suite, mirror, packages, the host's apt
# proxy settings: .cache/userspace/<suite>/inputs); to take a moving suite's newer packages
# (sid), delete .cache/userspace/<suite>. The venv (/opt/kubeproxy-venv in the root) is made
# by scripts/setup.sh run inside with scripts/in-userspace.sh, so it gets the same packages
# as .venv, from the registry this machine's pip settings name.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=$(realpath -m "${KPX_USERSPACE_CACHE:-.cache/userspace}")
MIRROR=${KPX_DEBIAN_MIRROR:-http://deb.debian.org/debian}
VENV_INSIDE=/opt/kubeproxy-venv
# What scripts/setup.sh installs, Python with venv, and what the tests call beyond it
# (modprobe: tests/vm/guest.py; git: tests/test_docs.py; util-linux's nsenter is in minbase).
PACKAGES="nftables libnftables1 iptables conntrack ipset iproute2 socat curl procps \
ca-certificates python3 python3-venv kmod git"

./scripts/setup.sh
./scripts/ensure-apt.sh setup-userspace mmdebstrap

# One build at a time: two would write the same root.
mkdir -p "$CACHE"
exec 9> "$CACHE/.lock"
flock 9

# The host's apt proxy and date checks, so the root is fetched the way this machine's apt
# fetches (mmdebstrap does not read the host's apt.conf.d).
host_aptopts() {
    apt-config dump 2>/dev/null | grep -E '^Acquire::(https?::Proxy|https?::CaInfo|Check-Valid-Until|Check-Date) ' || true
}

for suite in "$@"; do
    dir="$CACHE/$suite"
    inputs=$(printf 'suite %s\nmirror %s\npackages %s\n%s\n' "$suite" "$MIRROR" "$PACKAGES" "$(host_aptopts)")
    if [ "$(cat "$dir/inputs" 2>/dev/null)" != "$inputs" ] || [ ! -x "$dir/root/usr/bin/python3" ]; then
        echo "setup-userspace: $suite: building the root filesystem"
        rm -rf "$dir"
        mkdir -p "$dir"
        host_aptopts > "$dir/apt.conf"
        started=$(date +%s)
        # Documentation, manual pages and translations are never read there.
        mmdebstrap --quiet --variant=minbase --include="${PACKAGES// /,}" \
            --aptopt="$dir/apt.conf" \
            --dpkgopt='path-exclude=/usr/share/man/*' \
            --dpkgopt='path-exclude=/usr/share/doc/*' \
            --dpkgopt='path-exclude=/usr/share/locale/*' \
            "$suite" "$dir/root.tmp" "$MIRROR"
        mv "$dir/root.tmp" "$dir/root"
        echo "$inputs" > "$dir/inputs"
        echo "setup-userspace: $suite: root built in $(($(date +%s) - started)) s" \
            "($(du -sh "$dir/root" | cut -f1))"
    fi
    # The venv's editable install names this repository's path: a moved repository gets
    # a new venv.
    if [ "$(cat "$dir/root$VENV_INSIDE/.repo" 2>/dev/null)" != "$(pwd -P)" ]; then
        rm -rf "${dir:?}/root$VENV_INSIDE"
    fi
    started=$(date +%s)
    ./scripts/in-userspace.sh "$dir/root" env VENV=$VENV_INSIDE PYTHON=/usr/bin/python3 \
        ./scripts/setup.sh
    pwd -P > "$dir/root$VENV_INSIDE/.repo"
    echo "setup-userspace: $suite: venv ready in $(($(date +%s) - started)) s"
done
