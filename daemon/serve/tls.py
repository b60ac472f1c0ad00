"""gRPC TLS credentials from PEM files, for the server (``grpc.tls``) and for ``hlb place``.

Every file is read and checked with the standard library's ``ssl`` module first: grpc itself only
says "Failed to bind" or fails each handshake when a key does not match its certificate, while
this names the file and what is wrong with it.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc

from hlb.daemon.config import TlsSettings
from hlb.daemon.errors import ConfigError


def server_credentials(tls: TlsSettings) -> grpc.ServerCredentials:
    """Credentials for ``add_secure_port``: TLS, or mutual TLS when ``require_client_cert`` is set.

    With ``client_ca_file`` but without ``require_client_cert`` a client may connect without a
    certificate; one that presents a certificate must chain to the CA. Raises ``ConfigError``.
    """
    if tls.cert_file is None or tls.key_file is None:
        raise ConfigError("grpc.tls: cert_file and key_file are needed for TLS")
    check_key_pair(tls.cert_file, tls.key_file, "grpc.tls")
    ca = None
    if tls.client_ca_file is not None:
        check_ca(tls.client_ca_file, "grpc.tls.client_ca_file")
        ca = _read(tls.client_ca_file, "grpc.tls.client_ca_file")
    return grpc.ssl_server_credentials(
        [(_read(tls.key_file, "grpc.tls.key_file"), _read(tls.cert_file, "grpc.tls.cert_file"))],
        root_certificates=ca,
        require_client_auth=tls.require_client_cert,
    )


def channel_credentials(
    ca_file: Path | None = None, cert_file: Path | None = None, key_file: Path | None = None
) -> grpc.ChannelCredentials:
    """Client credentials: trust ``ca_file`` (the system's roots when None), present ``cert_file`` if given.

    Raises ``ConfigError`` naming the file that cannot be used.
    """
    if (cert_file is None) != (key_file is None):
        raise ConfigError("--tls-cert and --tls-key must be given together")
    ca = None
    if ca_file is not None:
        check_ca(ca_file, "--tls-ca")
        ca = _read(ca_file, "--tls-ca")
    key = chain = None
    if cert_file is not None and key_file is not None:
        check_key_pair(cert_file, key_file, "--tls-cert/--tls-key")
        key, chain = _read(key_file, "--tls-key"), _read(cert_file, "--tls-cert")
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=chain)


def check_key_pair(cert_file: Path, key_file: Path, what: str) -> None:
    """Raise ``ConfigError`` unless ``cert_file`` is a PEM certificate chain whose key is ``key_file``."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"{what}: cannot use certificate {cert_file} with key {key_file}: {_reason(exc)}") from None


def check_ca(ca_file: Path, what: str) -> None:
    """Raise ``ConfigError`` unless ``ca_file`` holds at least one PEM CA certificate."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_verify_locations(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"{what}: cannot use CA file {ca_file}: {_reason(exc)}") from None


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read {path}: {exc.strerror}") from None


def _reason(exc: OSError | ssl.SSLError) -> str:
    if isinstance(exc, ssl.SSLError):
        return exc.reason or str(exc)
    return exc.strerror or str(exc)
