"""A deployment's certificates: its own CA, the KV plane's worker certificate, the gateway's.

``pdserve certs --out DIR`` writes::

    DIR/ca.crt        the deployment's CA (self-signed); every peer trusts only it
    DIR/ca.key        its key: keep it off the cluster, it signs new certificates
    DIR/worker.crt    the KV plane's certificate, shared by every prefill and decode worker:
    DIR/worker.key      server and client auth, SAN DNS:pdserve-kv (peers dial node addresses
                        unknown when it is made, so they check this name, not the address)
    DIR/gateway.crt   the gateway's HTTPS and gRPC certificate, SANs: the --gateway-host
    DIR/gateway.key     names and addresses (default localhost and 127.0.0.1)

Keys are P-256 ECDSA, written 0600, made with ``cryptography`` (no OpenSSL shell-out).
Rotating a certificate: ``pdserve certs --out NEW --ca-dir OLD`` issues new ones from the
same CA; replace the Secret's files and restart the workers (old and new verify alike).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pdserve.messages.kv_plane_tls import KV_PEER_NAME

DEFAULT_DAYS = 365


@dataclass(frozen=True)
class Issued:
    """A certificate and its key, PEM-encoded."""

    cert_pem: bytes
    key_pem: bytes

    def write(self, directory: Path, name: str) -> None:
        (directory / f"{name}.crt").write_bytes(self.cert_pem)
        key_path = directory / f"{name}.key"
        key_path.touch(mode=0o600, exist_ok=True)
        os.chmod(key_path, 0o600)
        key_path.write_bytes(self.key_pem)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def make_ca(common_name: str = "pdserve deployment CA", days: int = DEFAULT_DAYS) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - datetime.timedelta(minutes=5))
        .not_valid_after(_now() + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return Issued(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def issue(
    ca: Issued,
    common_name: str,
    names: list[str],
    days: int = DEFAULT_DAYS,
    valid_from: datetime.datetime | None = None,
) -> Issued:
    """A certificate signed by ``ca`` for ``names`` (DNS names or IP addresses), good for
    TLS server and client auth, valid ``days`` from ``valid_from`` (default: now)."""
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey), "pdserve's CAs are ECDSA"
    key = ec.generate_private_key(ec.SECP256R1())
    alt_names: list[x509.GeneralName] = []
    for name in names:
        try:
            alt_names.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alt_names.append(x509.DNSName(name))
    start = (valid_from or _now()) - datetime.timedelta(minutes=5)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return Issued(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def write_certificates(
    out: Path, gateway_hosts: list[str], days: int = DEFAULT_DAYS, ca: Issued | None = None
) -> Path:
    """The files in this module's doc under ``out`` (a new CA unless ``ca`` is given)."""
    out.mkdir(parents=True, exist_ok=True)
    ca = ca or make_ca(days=days)
    ca.write(out, "ca")
    issue(ca, KV_PEER_NAME, [KV_PEER_NAME], days).write(out, "worker")
    issue(ca, "pdserve gateway", gateway_hosts, days).write(out, "gateway")
    return out


def load_issued(directory: Path, name: str) -> Issued:
    return Issued(
        (directory / f"{name}.crt").read_bytes(), (directory / f"{name}.key").read_bytes()
    )
