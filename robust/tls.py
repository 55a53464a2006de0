"""The coordinator's TLS material: a private CA and a server certificate it signs.

Volunteers pin the CA (``--ca CA.crt``), so no public CA is involved and no certificate can be
swapped in by anyone else. Keys are EC P-384, certificates valid for ten years.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

CA_CERT, SERVER_CERT, SERVER_KEY = "ca.crt", "server.crt", "server.key"
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(pem)


def make_certificates(folder: str | Path, hosts: list[str] | tuple[str, ...] = ()) -> Path:
    """Write ``ca.crt``, ``server.crt`` and ``server.key`` in ``folder`` for ``hosts`` (plus
    loopback); return the CA certificate's path. The CA's own key is not kept: no further
    certificate can be signed by it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=5)
    until = now + dt.timedelta(days=3650)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca = (
        x509.CertificateBuilder().subject_name(_name("robust coordinator CA")).issuer_name(_name("robust coordinator CA"))
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now).not_valid_after(until)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(ca_key, hashes.SHA384())
    )
    names = list(dict.fromkeys([*DEFAULT_HOSTS, *hosts]))
    server_key = ec.generate_private_key(ec.SECP384R1())
    server = (
        x509.CertificateBuilder().subject_name(_name(names[0] if not hosts else hosts[0])).issuer_name(ca.subject)
        .public_key(server_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now).not_valid_after(until)
        .add_extension(x509.SubjectAlternativeName([_san(h) for h in names]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    (folder / CA_CERT).write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (folder / SERVER_CERT).write_bytes(server.public_bytes(serialization.Encoding.PEM))
    _write_key(folder / SERVER_KEY, server_key)
    return folder / CA_CERT
