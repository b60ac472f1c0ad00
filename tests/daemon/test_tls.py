"""gRPC TLS and mutual TLS by configuration, with a throwaway CA made for each test run."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hlb.cli import main
from hlb.daemon.config import load_settings
from hlb.daemon.errors import ConfigError
from hlb.daemon.serve.tls import channel_credentials, check_key_pair
from hlb.sim.kafka_local import free_port
from hlb.v1 import scheduler_pb2 as api
from hlb.v1 import scheduler_pb2_grpc as api_grpc
from tests.daemon.background import BackgroundDaemon

NOW = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


@dataclass(frozen=True)
class Pem:
    cert: Path
    key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_ca(directory: Path, name: str) -> tuple[Pem, ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(_name(name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(NOW)
        .not_valid_after(NOW + datetime.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                key_encipherment=False, data_encipherment=False, key_agreement=False,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    return _write(directory, name, key, cert), key, cert


def make_leaf(
    directory: Path,
    name: str,
    ca: tuple[Pem, ec.EllipticCurvePrivateKey, x509.Certificate],
    usage: x509.ObjectIdentifier,
) -> Pem:
    _, ca_key, ca_cert = ca
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(NOW)
        .not_valid_after(NOW + datetime.timedelta(days=3650))
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if usage == ExtendedKeyUsageOID.SERVER_AUTH:
        sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return _write(directory, name, key, builder.sign(ca_key, hashes.SHA256()))


def _write(directory: Path, name: str, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> Pem:
    pem = Pem(directory / f"{name}.crt", directory / f"{name}.key")
    pem.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem.key.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return pem


@dataclass(frozen=True)
class Pki:
    ca: Pem
    server: Pem
    client: Pem
    other_ca: Pem
    stranger: Pem  # a client certificate from another CA


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    ca = make_ca(directory, "hlb-test-ca")
    other = make_ca(directory, "other-ca")
    return Pki(
        ca=ca[0],
        server=make_leaf(directory, "server", ca, ExtendedKeyUsageOID.SERVER_AUTH),
        client=make_leaf(directory, "client", ca, ExtendedKeyUsageOID.CLIENT_AUTH),
        other_ca=other[0],
        stranger=make_leaf(directory, "stranger", other, ExtendedKeyUsageOID.CLIENT_AUTH),
    )


def serve_tls(pki: Pki, mutual: bool) -> BackgroundDaemon:
    tls: dict[str, object] = {"cert_file": pki.server.cert, "key_file": pki.server.key}
    if mutual:
        tls |= {"client_ca_file": pki.ca.cert, "require_client_cert": True}
    settings = load_settings(None, bus="memory", grpc={"listen": f"127.0.0.1:{free_port()}", "tls": tls})
    return BackgroundDaemon(settings)


def health(channel: grpc.Channel) -> int:
    """The daemon's overall health status; raises grpc.RpcError when the call fails."""
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    return int(reply.status)


def refused(channel: grpc.Channel) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as failure:
        health(channel)
    code: grpc.StatusCode = failure.value.code()
    return code


@pytest.fixture(scope="module")
def tls_daemon(pki: Pki) -> Iterator[BackgroundDaemon]:
    with serve_tls(pki, mutual=False) as running:
        yield running


@pytest.fixture(scope="module")
def mtls_daemon(pki: Pki) -> Iterator[BackgroundDaemon]:
    with serve_tls(pki, mutual=True) as running:
        yield running


def test_a_client_trusting_the_ca_is_served_over_tls(pki: Pki, tls_daemon: BackgroundDaemon) -> None:
    with grpc.secure_channel(tls_daemon.target, channel_credentials(pki.ca.cert)) as channel:
        assert health(channel) == health_pb2.HealthCheckResponse.SERVING
        state = api_grpc.SchedulerStub(channel).GetClusterState(api.GetClusterStateRequest(), timeout=5)
    assert state.policy == "gnn"  # the default


def test_plaintext_is_refused_on_a_tls_port(tls_daemon: BackgroundDaemon) -> None:
    with grpc.insecure_channel(tls_daemon.target) as channel:
        assert refused(channel) == grpc.StatusCode.UNAVAILABLE


def test_a_client_trusting_another_ca_does_not_connect(pki: Pki, tls_daemon: BackgroundDaemon) -> None:
    with grpc.secure_channel(tls_daemon.target, channel_credentials(pki.other_ca.cert)) as channel:
        assert refused(channel) == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_serves_a_client_with_a_certificate_from_the_ca(pki: Pki, mtls_daemon: BackgroundDaemon) -> None:
    credentials = channel_credentials(pki.ca.cert, pki.client.cert, pki.client.key)
    with grpc.secure_channel(mtls_daemon.target, credentials) as channel:
        assert health(channel) == health_pb2.HealthCheckResponse.SERVING


def test_mutual_tls_rejects_a_client_without_a_certificate(pki: Pki, mtls_daemon: BackgroundDaemon) -> None:
    with grpc.secure_channel(mtls_daemon.target, channel_credentials(pki.ca.cert)) as channel:
        assert refused(channel) == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_rejects_a_certificate_from_another_ca(pki: Pki, mtls_daemon: BackgroundDaemon) -> None:
    credentials = channel_credentials(pki.ca.cert, pki.stranger.cert, pki.stranger.key)
    with grpc.secure_channel(mtls_daemon.target, credentials) as channel:
        assert refused(channel) == grpc.StatusCode.UNAVAILABLE


def test_hlb_place_speaks_mutual_tls_with_its_flags(
    pki: Pki, mtls_daemon: BackgroundDaemon, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["place", "--target", mtls_daemon.target, "--timeout", "5", "--id", "tls-task", "--json"]
    tls = ["--tls-ca", str(pki.ca.cert), "--tls-cert", str(pki.client.cert), "--tls-key", str(pki.client.key)]
    assert main([*base, *tls]) == 0
    # No devices are known, so the task waits; what matters is that the call got through.
    assert '"task_id": "tls-task"' in capsys.readouterr().out
    assert main([*base[:-3], "--get", "tls-task", "--tls-ca", str(pki.ca.cert)]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err
    assert main([*base[:-3], "--get", "tls-task"]) == 1  # plaintext
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_hlb_place_names_a_missing_key_file(pki: Pki, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="--tls-cert and --tls-key must be given together"):
        main(["place", "--get", "x", "--tls-cert", str(pki.client.cert)])


def test_a_key_that_does_not_match_the_certificate_is_a_config_error(pki: Pki) -> None:
    with pytest.raises(ConfigError, match=r"grpc.tls: cannot use certificate .*server.crt with key .*client.key"):
        check_key_pair(pki.server.cert, pki.client.key, "grpc.tls")
    settings = load_settings(
        None,
        bus="memory",
        grpc={"listen": "127.0.0.1:0", "tls": {"cert_file": pki.server.cert, "key_file": pki.client.key}},
    )
    with pytest.raises(ConfigError, match=r"grpc\.tls"), BackgroundDaemon(settings):
        pass


@pytest.mark.parametrize(
    ("tls", "message"),
    [
        ({"cert_file": "CERT"}, "cert_file and key_file must be set together"),
        ({"cert_file": "CERT", "key_file": "KEY", "require_client_cert": True}, "require_client_cert needs client_ca"),
        ({"client_ca_file": "CERT"}, "need cert_file and key_file"),
        ({"cert_file": "/no/such/file.crt", "key_file": "KEY"}, "grpc.tls.cert_file: Path does not point to a file"),
    ],
)
def test_inconsistent_tls_settings_fail_to_load(pki: Pki, tls: dict[str, object], message: str) -> None:
    paths = {"CERT": str(pki.server.cert), "KEY": str(pki.server.key)}
    resolved = {key: paths.get(value, value) if isinstance(value, str) else value for key, value in tls.items()}
    with pytest.raises(ConfigError, match=message):
        load_settings(None, grpc={"tls": resolved})
