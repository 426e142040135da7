#!/usr/bin/env bash
# Run a command in another Debian userspace on this machine's kernel (as root):
#   scripts/in-userspace.sh ROOTDIR COMMAND...     e.g. .cache/userspace/trixie/root bash
# ROOTDIR is a root filesystem made by scripts/setup-userspace.sh, or / for this machine's
# own userspace (the baseline of `make test-userspace`). COMMAND runs in the repository,
# bind-mounted at its own path.
#
# Everything happens in new mount and PID namespaces (unshare), so nothing leaks to the
# host: /proc is the new PID namespace's, /run and /tmp are fresh tmpfs (so `ip netns add`
# inside binds its namespaces under this /run/netns, which no one outside sees, and they
# go when the last process inside ends), /dev and /sys are the host's, and every process
# left inside is killed when COMMAND ends. In a root filesystem, the host's package-registry
# settings are visible read-only at their own paths (a company behind a TLS proxy needs
# them, as this machine does): pip's configuration files, the paths its settings name (CA
# bundle, constraints, find-links, file:// indexes with the files beside them),
# /etc/ssl/certs, /etc/resolv.conf and /etc/hosts; the proxy, pip and CA variables of the
# environment pass through, nothing else of it (and Python writes no bytecode into the
# repository: it is another Python's).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd -P)
if [ "${1:-}" != --binds ] && [ $# -lt 2 ]; then
    echo "usage: $0 ROOTDIR COMMAND... | $0 --binds" >&2
    exit 2
fi

# The host's pip settings: the configuration files pip reads ("exists: True" in `pip config
# debug`), then every absolute path and file:// URL among the values of `pip config list`
# (a local index's files sit beside its simple/ folder: its parent is bound).
host_binds() {
    local pip=${KPX_HOST_PIP:-$repo/.venv/bin/pip} value token
    echo /etc/ssl/certs
    echo /usr/local/share/ca-certificates
    echo /etc/resolv.conf
    echo /etc/hosts
    # A worktree's git directory lives in the main repository (tests/test_docs.py runs git).
    git -C "$repo" rev-parse --path-format=absolute --git-common-dir 2>/dev/null || true
    [ -x "$pip" ] || return 0
    "$pip" config debug 2>/dev/null | sed -n 's/^ *\(\/[^,]*\), exists: True$/\1/p'
    "$pip" config list 2>/dev/null | sed -n "s/^[^=]*='\(.*\)'$/\1/p" | while read -r value; do
        for token in $value; do
            case $token in
                file://*) dirname "${token#file://}" ;;
                /*) echo "$token" ;;
            esac
        done
    done
}

# --binds: print what would be bound (asking pip takes seconds: a caller running many
# commands asks once and passes the list on in KPX_USERSPACE_BINDS).
if [ "$1" = --binds ]; then
    host_binds | sort -u
    exit
fi
root=$(realpath "$1")
shift

if [ -z "${KPX_USERSPACE_INSIDE:-}" ]; then
    binds=${KPX_USERSPACE_BINDS:-}
    if [ "$root" = / ]; then
        binds=""
    elif [ -z "$binds" ]; then
        binds=$(host_binds | sort -u)
    fi
    # --kill-child: when unshare is killed (a timeout), the namespace's first process is too.
    exec env KPX_USERSPACE_INSIDE=1 KPX_USERSPACE_BINDS="$binds" \
        unshare --mount --pid --fork --kill-child --propagation private -- "$0" "$root" "$@"
fi

# Inside the new namespaces, as their PID 1.
unset KPX_USERSPACE_INSIDE
keep_env=()
for name in $(compgen -e); do
    case $name in
        PIP_* | KUBEPROXY_* | CI | TERM | SSL_CERT_FILE | SSL_CERT_DIR | REQUESTS_CA_BUNDLE | \
            CURL_CA_BUNDLE | http_proxy | https_proxy | no_proxy | HTTP_PROXY | HTTPS_PROXY | NO_PROXY)
            keep_env+=("$name=${!name}") ;;
    esac
done

if [ "$root" = / ]; then
    mount -t proc proc /proc
    mkdir -p /run/netns
    mount -t tmpfs -o mode=755 tmpfs /run/netns
    cd "$repo"
    "$@"
    exit
fi

# The root a mount point of its own: `ip netns exec` makes / a slave mount, which only a
# mount point can be.
mount --bind "$root" "$root"
mount -t proc proc "$root/proc"
mount --rbind /dev "$root/dev"
mount -t tmpfs -o mode=1777 tmpfs "$root/dev/shm"
mount --rbind /sys "$root/sys"
mount -t tmpfs -o mode=755 tmpfs "$root/run"
mount -t tmpfs -o mode=1777 tmpfs "$root/tmp"
mkdir -p "$root$repo"
mount --bind "$repo" "$root$repo"
bound=()
while read -r path; do
    [ -n "$path" ] && [ -e "$path" ] || continue
    case $path in "$repo" | "$repo"/*) continue ;; esac
    for outer in "${bound[@]}"; do
        case $path in "$outer"/*) continue 2 ;; esac  # already visible through $outer
    done
    source=$(realpath "$path")
    target=$root$path
    if [ -d "$source" ]; then
        mkdir -p "$target"
    elif [ ! -e "$target" ]; then
        mkdir -p "$(dirname "$target")"
        rm -f "$target"  # a dangling link (resolv.conf into /run) cannot be mounted over
        touch "$target"
    fi
    mount --bind -o ro "$source" "$target"
    bound+=("$path")
done <<< "$KPX_USERSPACE_BINDS"
unset KPX_USERSPACE_BINDS

chroot "$root" /usr/bin/env -i \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    HOME=/root LANG=C.UTF-8 PYTHONDONTWRITEBYTECODE=1 "${keep_env[@]}" \
    /bin/sh -c 'cd "$0" && exec "$@"' "$repo" "$@"
