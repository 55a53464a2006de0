"""The admission list: ``DIR/admitted/<fingerprint>.pub``, one file per volunteer key.

Keys are written atomically (a round that reads the list never sees half a file) and read
with a size cap; a file that is not a key is skipped with a warning naming it, never the end
of a running federation. A node convicted of lying (``nodes.engine.spotcheck``) is banned: its key
moves to ``DIR/convicted/``, where the audit still finds it to check its signatures, and
``admit`` refuses it.
"""

from __future__ import annotations

from pathlib import Path

from cryptography.hazmat.primitives.asymmetric import ec

from robust import keys

from ..checkpoint import write_atomic

ADMITTED, CONVICTED = "admitted", "convicted"
def short(fp: str) -> str:
    """The node name shown to people: the first 12 hex digits of its fingerprint."""
    return fp[:12]


KEY_CAP = 4096  # bytes: an OpenSSH P-384 public key line takes about 230


def _read_key(path: Path) -> ec.EllipticCurvePublicKey:
    """The key in ``path``; ``ValueError`` naming the file and the fix."""
    try:
        size = path.stat().st_size
        if size > KEY_CAP:
            raise ValueError(f"{size} bytes, a public key takes at most {KEY_CAP}")
        return keys.load_public(path.read_bytes())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: {err}: use the node.pub that `robust node keygen` wrote") from None


def admit(folder: str | Path, public_file: str | Path) -> str:
    """Copy a volunteer's ``node.pub`` into the list; return its fingerprint."""
    path = Path(public_file)
    if not path.is_file():
        raise ValueError(f"{path} not found: the volunteer's `robust node keygen DIR` writes DIR/node.pub")
    key = _read_key(path)
    fp = keys.fingerprint(key)
    if (Path(folder) / CONVICTED / f"{fp}.pub").exists():
        raise ValueError(f"node {fp[:12]} was convicted of sending a fabricated update (see result.json, rounds.jsonl): "
                         "it is banned from this run")
    target = Path(folder) / ADMITTED
    target.mkdir(parents=True, exist_ok=True)
    write_atomic(target / f"{fp}.pub", lambda out: out.write(keys.public_bytes(key) + b"\n"))
    return fp


def scan(folder: str | Path, sub: str = ADMITTED) -> tuple[dict[str, tuple[Path, ec.EllipticCurvePublicKey]], list[str]]:
    """Fingerprint -> (file, public key) of every admitted volunteer (or, with ``sub``, every
    key in that list), and what is wrong with each file that holds no key (skipped)."""
    found, problems = {}, []
    for path in sorted((Path(folder) / sub).glob("*.pub")):
        try:
            key = _read_key(path)
        except ValueError as err:
            problems.append(f"skipped {err}")
            continue
        found[keys.fingerprint(key)] = (path, key)
    return found, problems


def ban(folder: str | Path, fp: str) -> None:
    """Move node ``fp``'s key out of the admission list into ``convicted/``."""
    source = Path(folder) / ADMITTED / f"{fp}.pub"
    target = Path(folder) / CONVICTED
    target.mkdir(exist_ok=True)
    if source.exists():
        source.replace(target / source.name)


def known_keys(folder: str | Path) -> dict[str, ec.EllipticCurvePublicKey]:
    """Every key that ever signed for this run: admitted and convicted (for the audit)."""
    return {fp: key for sub in (ADMITTED, CONVICTED) for fp, (_, key) in scan(folder, sub)[0].items()}
