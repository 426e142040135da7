#!/usr/bin/env bash
# Sets up a fresh Debian machine (as root) for running and testing kubeproxy:
# the kernel tools the backends drive, then a virtualenv with the package installed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
# openssl: the fake API server's certificates (kubeproxy/testing/fakeapi/tls.py).
APT_PACKAGES="nftables libnftables1 iptables conntrack ipset iproute2 socat curl procps openssl"

./scripts/ensure-apt.sh setup $APT_PACKAGES

# make image and the image's tests (tests/test_image_run.py, part of make test): podman
# with runc (the tests run the pod in a flow case's named network namespace, which docker
# cannot join; make image uses docker instead when its engine answers), and mmdebstrap for
# a base made from Debian's packages when no registry is reachable (images/README.md).
./scripts/ensure-apt.sh setup podman runc mmdebstrap

PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "setup: kubeproxy needs Python 3.11 or newer ($PYTHON is older)" >&2
    exit 1
fi
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.installed-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -e "$stamp" ]; then
    "$VENV/bin/pip" install -q --upgrade pip
    # node: the extras the binaries use (API client, pyroute2); dev: the tools.
    "$VENV/bin/pip" install -q -e '.[node,dev]'
    rm -f "$VENV"/.installed-*
    touch "$stamp"
fi
echo "setup: ready ($VENV)"
