"""Identities: a node's EC P-384 key pair, its fingerprint, and signatures over its replies.

One key does two jobs. Flower's SuperNode authentication wants an EC key on a NIST curve in
OpenSSH format; the same key signs every update the node sends, so the coordinator checks
*what* was sent, not only *who* connected. A node's identity everywhere (canonical order,
seeds, reputations) is the fingerprint of its public key: stable across restarts, unlike
Flower's node ids.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from .seeds import derive

CURVE = ec.SECP384R1()
PRIVATE_FILE, PUBLIC_FILE = "node.key", "node.pub"
_ORDER = int("ffffffffffffffffffffffffffffffffffffffffffffffffc7634d81f4372ddf581a0db248b0a77aecec196accc52973", 16)


def generate(seed: object | None = None) -> ec.EllipticCurvePrivateKey:
    """A fresh key, or (for throwaway demo keys only) one derived from ``seed``."""
    if seed is None:
        return ec.generate_private_key(CURVE)
    secret = int.from_bytes(hashlib.sha512(repr(("key", seed, derive(seed))).encode()).digest(), "big")
    return ec.derive_private_key(secret % (_ORDER - 1) + 1, CURVE)


def public_bytes(key: ec.EllipticCurvePublicKey) -> bytes:
    """The OpenSSH one-line form (what ``NODE.pub`` holds and Flower registers)."""
    return key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)


def fingerprint(key: ec.EllipticCurvePublicKey) -> str:
    """The node's identity: SHA-256 of its public key's DER form, hex."""
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


def write_identity(folder: str | Path, key: ec.EllipticCurvePrivateKey) -> Path:
    """Save ``node.key`` (owner-only) and ``node.pub`` in ``folder``; return the public file."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    private = folder / PRIVATE_FILE
    if private.exists():
        raise ValueError(f"{private} already exists: use another folder, or delete it to make a new identity")
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(pem)
    public = folder / PUBLIC_FILE
    public.write_bytes(public_bytes(key.public_key()) + b"\n")
    return public


def load_private(folder_or_file: str | Path) -> ec.EllipticCurvePrivateKey:
    """A node's private key from its identity folder (or the ``node.key`` file itself)."""
    path = Path(folder_or_file)
    path = path / PRIVATE_FILE if path.is_dir() else path
    try:
        key = serialization.load_ssh_private_key(path.read_bytes(), None)
    except FileNotFoundError:
        raise ValueError(f"no key at {path}: make one with `robust node keygen DIR`") from None
    except (ValueError, UnsupportedAlgorithm) as err:
        raise ValueError(f"{path} is not an OpenSSH private key ({err}): make one with `robust node keygen DIR`") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name != CURVE.name:
        raise ValueError(f"{path} is not an EC P-384 key: make one with `robust node keygen DIR`")
    return key


def load_public(data: bytes) -> ec.EllipticCurvePublicKey:
    """A public key from its OpenSSH line (``NODE.pub``'s content); ``ValueError`` if it is not one."""
    try:
        key = serialization.load_ssh_public_key(data.strip())
    except (ValueError, UnsupportedAlgorithm) as err:
        raise ValueError(f"not an OpenSSH public key ({err})") from None
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != CURVE.name:
        raise ValueError("not an EC P-384 public key (made by `robust node keygen`)")
    return key


def sign(key: ec.EllipticCurvePrivateKey, payload: bytes) -> bytes:
    return key.sign(payload, ec.ECDSA(hashes.SHA384()))


def verify(key: ec.EllipticCurvePublicKey, signature: bytes, payload: bytes) -> bool:
    try:
        key.verify(signature, payload, ec.ECDSA(hashes.SHA384()))
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True
