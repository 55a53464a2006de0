"""The admission list: ``DIR/admitted/<fingerprint>.pub``, one file per volunteer key."""

from __future__ import annotations

from pathlib import Path

from cryptography.hazmat.primitives.asymmetric import ec

from robust import keys

ADMITTED = "admitted"


def admit(folder: str | Path, public_file: str | Path) -> str:
    """Copy a volunteer's ``node.pub`` into the list; return its fingerprint."""
    path = Path(public_file)
    if not path.is_file():
        raise ValueError(f"{path} not found: the volunteer's `robust node keygen DIR` writes DIR/node.pub")
    try:
        key = keys.load_public(path.read_bytes())
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    fp = keys.fingerprint(key)
    target = Path(folder) / ADMITTED
    target.mkdir(parents=True, exist_ok=True)
    (target / f"{fp}.pub").write_bytes(keys.public_bytes(key) + b"\n")
    return fp


def admitted(folder: str | Path) -> dict[str, ec.EllipticCurvePublicKey]:
    """Fingerprint -> public key of every admitted volunteer."""
    out = {}
    for path in sorted((Path(folder) / ADMITTED).glob("*.pub")):
        key = keys.load_public(path.read_bytes())
        out[keys.fingerprint(key)] = key
    return out
