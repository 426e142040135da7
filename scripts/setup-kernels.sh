#!/usr/bin/env bash
# Set-up for `make test-kernels` (as root, on Debian): everything `make setup` installs,
# then QEMU, busybox and kmod from Debian (what virtme-ng needs to boot a kernel with this
# machine's root filesystem shared read-only), virtme-ng into the venv, and each kernel of
# tests/vm/kernels.txt from Debian's packages, unpacked with dpkg -x into
# .cache/kernels/<label>/ (its modules stay there: virtme-ng links them into the guest, so
# the host's /lib/modules is never touched).
#
# The kernel packages are looked up with a private apt state under .cache/kernels/apt/
# (one sources list per suite), so no suite is added to this machine's apt sources.
# KPX_KERNELS="label ..." fetches only those kernels of the matrix (.ci/run boots two).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
CACHE=$(realpath -m "${KPX_KERNEL_CACHE:-.cache/kernels}")
MIRROR=${KPX_DEBIAN_MIRROR:-http://deb.debian.org/debian}
SECURITY=${KPX_DEBIAN_SECURITY:-http://deb.debian.org/debian-security}
APT_PACKAGES="qemu-system-x86 busybox-static kmod file"

./scripts/setup.sh

./scripts/ensure-apt.sh setup-kernels $APT_PACKAGES

stamp="$VENV/.kernels-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -e "$stamp" ]; then
    "$VENV/bin/pip" install -q -e '.[dev,kernels]'
    rm -f "$VENV"/.kernels-*
    touch "$stamp"
fi

apt_state() {  # the private apt options of one suite (its lists and cache under $CACHE/apt)
    local dir="$CACHE/apt/$1"
    echo "-o Dir::Etc::SourceList=$dir/sources.list -o Dir::Etc::SourceParts=$dir/none" \
        "-o Dir::State::Lists=$dir/lists -o Dir::Cache=$dir/cache -o Dir::State::status=$dir/status"
}

declare -A updated=()
mkdir -p "$CACHE"
grep -v '^\s*\(#\|$\)' tests/vm/kernels.txt | while read -r label suite pattern _scope; do
    if [ -n "${KPX_KERNELS:-}" ] && [[ " $KPX_KERNELS " != *" $label "* ]]; then
        continue
    fi
    dir="$CACHE/apt/$suite"
    if [ -z "${updated[$suite]:-}" ]; then
        mkdir -p "$dir/lists/partial" "$dir/cache/archives/partial" "$dir/none"
        touch "$dir/status"
        {
            echo "deb $MIRROR $suite main"
            # unstable has neither updates nor a security suite
            if [ "$suite" != sid ] && [ "$suite" != unstable ]; then
                echo "deb $MIRROR $suite-updates main"
                echo "deb $SECURITY $suite-security main"
            fi
        } > "$dir/sources.list"
        # shellcheck disable=SC2046
        apt-get $(apt_state "$suite") update -qq
        updated[$suite]=1
    fi
    # shellcheck disable=SC2046
    package=$(apt-cache $(apt_state "$suite") search --names-only "$pattern" \
        | cut -d' ' -f1 | grep -E "$pattern" | sort -V | tail -1)
    if [ -z "$package" ]; then
        echo "setup-kernels: no package matches $pattern in $suite" >&2
        exit 1
    fi
    target="$CACHE/$label"
    if [ "$(cat "$target/.package" 2>/dev/null)" = "$package" ]; then
        continue
    fi
    echo "setup-kernels: $label: fetching $package ($suite)"
    rm -rf "$target" "$dir/debs"
    mkdir -p "$dir/debs"
    # From Debian 14 on, linux-image-* is a small package that depends on the kernel
    # (linux-binary-*, its image in usr/lib/modules/VERSION/vmlinuz), its modules
    # (linux-modules-*) and their index files (linux-base-*); those come along.
    # shellcheck disable=SC2046
    parts=$(apt-cache $(apt_state "$suite") depends "$package" \
        | sed -n 's/^ *Depends: \(linux-\(binary\|modules\|base\)-[^ ]*\).*/\1/p' | sort -u)
    # shellcheck disable=SC2046,SC2086
    (cd "$dir/debs" && apt-get $(apt_state "$suite") -o APT::Sandbox::User=root \
        download -qq "$package" $parts)
    for deb in "$dir"/debs/*.deb; do
        dpkg -x "$deb" "$target"
    done
    # Debian 13 and newer ship modules under usr/lib (merged /usr); the guest and
    # tests/vm/matrix.py look under lib/, as on the root filesystem.
    if [ ! -e "$target/lib" ] && [ -d "$target/usr/lib/modules" ]; then
        ln -s usr/lib "$target/lib"
    fi
    rm -rf "$dir/debs" "$target/usr/share/doc"
    echo "$package" > "$target/.package"
done
echo "setup-kernels: ready ($CACHE)"
