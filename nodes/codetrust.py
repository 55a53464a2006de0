"""Code a coordinator ships to volunteers, run only once the volunteer accepted its hash.

A coordinator whose model or data set is the user's own code (setting ``code``) ships that
folder the Flower way: inside the Flower App bundle (FAB) it submits, which every SuperNode
receives and installs before it runs a task. Flower checks a FAB only against platform
signatures; a volunteer needs more: to see what it is asked to run, and to run only that.

So a volunteer's SuperNode starts its ClientApp processes through a gate (``DIR/bin/
flwr-clientapp``, first on the SuperNode's ``PATH``): before Flower installs a bundle, the
gate computes its SHA-256 (:func:`bundle_sha256`: the sorted file names and contents, not the
zip's bytes) and installs it only if the bundle ships no code and names robust's own
ClientApp, or if the volunteer trusts that hash (``DIR/trusted-code``, written by ``robust node
join --trust-code SHA256`` or by answering its prompt). Otherwise the task fails with the
reason, the bundle is never unpacked, and the gate leaves ``DIR/code-requests/SHA256.json``
(its files and sizes) for ``robust node join`` to show the volunteer, once per hash.

The coordinator prints the same hash when it starts (:func:`app_sha256`).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import sys
import tomllib
import zipfile
from collections.abc import Callable
from pathlib import Path

TRUSTED, REQUESTS, GATE_DIR = "trusted-code", "code-requests", "bin"
OWN_CLIENTAPP = "nodes.volunteer.thin_app:app"  # robust's own ClientApp, hands tasks to the warm trainer
SHA = re.compile(r"[0-9a-f]{64}")
# In a ClientApp process the gate started: the code bundle it admitted and installed for this
# task, if it ships code ({"sha": ..., "path": its folder}); the ClientApp hands such a task to
# that bundle's warm trainer (``nodes.volunteer.bundles``).
INSTALLED: dict[str, str] = {}


def bundle_sha256(fab: bytes) -> tuple[str, dict[str, int], str]:
    """``(SHA-256, {file: size}, the ClientApp it names)`` of a Flower App bundle: the hash of
    every file's name and content (Flower's own metadata, ``.info/``, left out), so the same
    folder gives the same hash whenever and wherever it is built. ``ValueError`` if ``fab``
    is not a bundle."""
    try:
        with zipfile.ZipFile(io.BytesIO(fab)) as z:
            files = {i.filename: z.read(i) for i in z.infolist() if not i.is_dir() and not i.filename.startswith(".info/")}
        clientapp = tomllib.loads(files["pyproject.toml"].decode())["tool"]["flwr"]["app"]["components"]["clientapp"]
    except (zipfile.BadZipFile, KeyError, UnicodeDecodeError, tomllib.TOMLDecodeError, TypeError) as err:
        raise ValueError(f"not a Flower App bundle ({type(err).__name__}: {err})") from None
    return _digest(files), {name: len(content) for name, content in sorted(files.items())}, str(clientapp)


def _digest(files: dict[str, bytes]) -> str:
    h = hashlib.sha256(b"robust-code-bundle/v1\n")
    for name in sorted(files):
        h.update(f"{name}\n{hashlib.sha256(files[name]).hexdigest()}\n".encode())
    return h.hexdigest()


def folder_sha256(folder: Path) -> str:
    """The bundle hash of the files an installed bundle's ``folder`` holds (:func:`bundle_sha256`
    of the bundle it was unpacked from, while no file of it changed); the bytecode Python
    caches beside imported modules (``__pycache__``) is not the bundle's."""
    return _digest({path.relative_to(folder).as_posix(): path.read_bytes() for path in sorted(folder.rglob("*"))
                    if path.is_file() and "__pycache__" not in path.relative_to(folder).parts})


def ships_code(files: dict[str, int], clientapp: str) -> bool:
    """Whether a bundle runs anything but the volunteer's installed robust: files beside its
    ``pyproject.toml``, or another ClientApp."""
    return set(files) != {"pyproject.toml"} or clientapp != OWN_CLIENTAPP


def app_sha256(app: Path) -> str:
    """The bundle hash of the Flower App folder ``app`` (what volunteers will be asked to trust)."""
    from flwr.cli.build import build_fab_from_disk

    return bundle_sha256(build_fab_from_disk(app))[0]


def trusted(folder: Path) -> set[str]:
    """The bundle hashes the volunteer in ``folder`` accepted."""
    path = folder / TRUSTED
    return set(SHA.findall(path.read_text())) if path.exists() else set()


def trust(folder: Path, sha: str) -> None:
    """Accept bundle ``sha`` for the volunteer in ``folder``; ``ValueError`` if it is not a SHA-256."""
    sha = sha.strip().lower()
    if not SHA.fullmatch(sha):
        raise ValueError(f"--trust-code {sha[:80]!r}: write the 64 hex digits of the code bundle's SHA-256 "
                         "(the coordinator prints it as it starts; this node prints it when it is asked to run it)")
    if sha not in trusted(folder):
        with open(folder / TRUSTED, "a") as out:
            out.write(sha + "\n")


def pending(folder: Path) -> dict[str, dict]:
    """The bundles the gate refused so far: ``{sha: {"files": {name: size}, "clientapp": ...}}``."""
    out = {}
    for path in sorted((folder / REQUESTS).glob("*.json")):
        try:
            out[path.stem] = json.loads(path.read_text())
        except (OSError, ValueError):  # being written: seen at the next look
            continue
    return out


def admit_bundle(folder: Path, fab: bytes) -> str:
    """The SHA-256 of ``fab`` if the volunteer in ``folder`` may install it and it ships code,
    ``""`` if it ships none; else leave a request for ``robust node join`` and raise
    ``PermissionError`` saying how to accept it."""
    sha, files, clientapp = bundle_sha256(fab)
    if not ships_code(files, clientapp):
        return ""
    if sha in trusted(folder):
        return sha
    requests = folder / REQUESTS
    requests.mkdir(exist_ok=True)
    (requests / f"{sha}.json").write_text(json.dumps({"files": files, "clientapp": clientapp}))
    raise PermissionError(f"this volunteer has not accepted the code bundle {sha} ({len(files)} files, ClientApp "
                          f"{clientapp}): it runs only after `robust node join ... --trust-code {sha}`")


def check_installed(folder: Path, sha: str, path: Path) -> None:
    """Return if the volunteer in ``folder`` trusts bundle ``sha`` and ``path`` holds its files
    (run before anything of it is imported); else ``ValueError`` saying which."""
    if sha not in trusted(folder):
        raise ValueError(f"this volunteer has not accepted the code bundle {sha}")
    found = folder_sha256(path) if path.is_dir() else "no folder"
    if found != sha:
        raise ValueError(f"{path} does not hold the code bundle {sha} (its files hash to {found}): "
                         "its next task installs it again")


def install_gate(folder: Path) -> Path:
    """Write the volunteer's ``flwr-clientapp`` gate into ``folder/bin``; return that folder
    (to put first on the SuperNode's ``PATH``). The gate also has Flower assemble pulled arrays
    with one allocation (``nodes.inflate``)."""
    bin_dir = folder / GATE_DIR
    bin_dir.mkdir(exist_ok=True)
    gate = bin_dir / "flwr-clientapp"
    gate.write_text(f"#!{sys.executable}\nimport sys\nfrom pathlib import Path\nfrom nodes.codetrust import run_gated\n"
                    f"from nodes.inflate import lean\nfrom nodes.volunteer.runtime_watch import Watch\n"
                    f"FOLDER = {str(folder.resolve())!r}\nlean()\n"
                    f"sys.exit(run_gated(FOLDER, Watch(Path(FOLDER)).run))\n")
    gate.chmod(0o755)
    return bin_dir


def run_gated(folder: str, run: Callable[..., None]) -> int:
    """Flower's ``flwr-clientapp``, with every bundle passed through :func:`admit_bundle`
    before Flower installs it (a refused one makes the task fail, with the reason); run by
    ``run(run_clientapp, **its arguments)`` (the volunteer's gate passes
    ``nodes.volunteer.runtime_watch.Watch.run``: a reply the runtime refuses is logged).

    Its command line is Flower's (``flwr.supernode.cli.flwr_clientapp``), parsed here with
    Flower's own arguments: importing that module imports its package, hence the SuperNode's
    whole command (SQLAlchemy, Alembic, FastAPI), 0.6 s of CPU and 33 MB in every task's
    process that a ClientApp never uses."""
    from flwr.common.args import add_args_flwr_app_common, try_obtain_flwr_app_token
    from flwr.supercore.constant import SUPERNODE_DEFAULT_CLIENT_ADDRESS
    from flwr.supercore.tls import validate_and_resolve_root_certificates
    from flwr.supernode.runtime import run_clientapp

    install = run_clientapp.install_from_fab

    def gated(fab_file: bytes | Path, *args, **kwargs) -> Path:
        sha = admit_bundle(Path(folder), fab_file.read_bytes() if isinstance(fab_file, Path) else fab_file)
        path = install(fab_file, *args, **kwargs)
        if sha:
            INSTALLED.update(sha=sha, path=str(path))
        return path

    run_clientapp.install_from_fab = gated
    parser = argparse.ArgumentParser(description="Run a Flower ClientApp (a volunteer's, gated)")
    parser.add_argument("--runtime-api-address", default=SUPERNODE_DEFAULT_CLIENT_ADDRESS)
    add_args_flwr_app_common(parser=parser)
    args = parser.parse_args()
    arguments = dict(
        runtime_api_address=args.runtime_api_address, token=try_obtain_flwr_app_token(args),
        insecure=args.insecure, certificates=validate_and_resolve_root_certificates(args.root_certificates, args.insecure),
        parent_pid=args.parent_pid, runtime_dependency_install=args.runtime_dependency_install)
    run(run_clientapp, **arguments)
    return 0
