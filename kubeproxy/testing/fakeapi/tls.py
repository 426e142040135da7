"""Certificates for an HTTPS :class:`~kubeproxy.testing.fakeapi.FakeAPIServer`.

:func:`make_certificates` makes a throw-away certificate authority, a server certificate
for the addresses a client will dial, and a client certificate (for kubeconfigs that
authenticate with one), with the ``openssl`` command (no Python package needed; EC P-256
keys, valid for two days). :meth:`Certificates.server_context` is the ``tls`` to give the
fake: with ``client_certificates=True`` it refuses a client without a certificate the
authority signed, as kube-apiserver with ``--client-ca-file`` does for x509 users.
"""

from __future__ import annotations

import ipaddress
import ssl
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Certificates", "make_certificates"]

_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]


@dataclass(frozen=True, slots=True)
class Certificates:
    """The files :func:`make_certificates` wrote (PEM)."""

    ca: Path
    server_certificate: Path
    server_key: Path
    client_certificate: Path
    client_key: Path

    def server_context(self, *, client_certificates: bool = False) -> ssl.SSLContext:
        """The fake's TLS context: its certificate, and (``client_certificates``) the
        demand for a client certificate the authority signed."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.server_certificate, self.server_key)
        if client_certificates:
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(self.ca)
        return context


def _openssl(*args: str) -> None:
    result = subprocess.run(["openssl", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {result.stderr.strip()[-300:]}")


def _signed(
    directory: Path, name: str, subject: str, extensions: str, ca: Path, ca_key: Path
) -> tuple[Path, Path]:
    key, request, certificate = (directory / f"{name}.{s}" for s in ("key", "csr", "crt"))
    extfile = directory / f"{name}.ext"
    extfile.write_text(extensions)
    _openssl("req", "-new", *_KEY, "-keyout", str(key), "-out", str(request), "-subj", subject)
    _openssl(
        "x509",
        "-req",
        "-in",
        str(request),
        "-CA",
        str(ca),
        "-CAkey",
        str(ca_key),
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        str(extfile),
        "-out",
        str(certificate),
    )
    return certificate, key


def make_certificates(
    directory: Path, hosts: Sequence[str] = ("127.0.0.1", "localhost")
) -> Certificates:
    """An authority, a server certificate for ``hosts`` (addresses or names) and a
    client certificate (``CN=system:kube-proxy``), written into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = directory / "ca.crt", directory / "ca.key"
    _openssl(
        "req",
        "-x509",
        *_KEY,
        "-keyout",
        str(ca_key),
        "-out",
        str(ca),
        "-days",
        "2",
        "-subj",
        "/CN=kubeproxy-fakeapi-ca",
    )
    names = []
    for host in hosts:
        try:
            ipaddress.ip_address(host)
            names.append(f"IP:{host}")
        except ValueError:
            names.append(f"DNS:{host}")
    server, server_key = _signed(
        directory,
        "server",
        "/CN=kubeproxy-fakeapi",
        f"subjectAltName={','.join(names)}\nextendedKeyUsage=serverAuth\n",
        ca,
        ca_key,
    )
    client, client_key = _signed(
        directory,
        "client",
        "/CN=system:kube-proxy/O=system:node-proxier",
        "extendedKeyUsage=clientAuth\n",
        ca,
        ca_key,
    )
    return Certificates(ca, server, server_key, client, client_key)
