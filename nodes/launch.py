"""Starting and talking to Flower's processes: SuperLink, SuperNode, and the ``flwr`` CLI; and
starting a volunteer's warm trainer (``nodes.volunteer.trainer``).

Every process gets a private ``FLWR_HOME`` in the coordinator's (or volunteer's) folder,
telemetry and update checks off, and dies with the process that started it (Linux
``PR_SET_PDEATHSIG``), so a killed coordinator leaves no SuperLink behind.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

from robust import tls

from .codetrust import OWN_CLIENTAPP, app_sha256, install_gate

APP_DIR, FLWR_HOME, LOGS, CODE_SHA = "app", "flwr-home", "logs", "code-bundle.sha256"
CONNECTION = "robust"
SUPEREXEC_POLL = "0.2"  # seconds
# glibc serves an allocation above this from its own mapping, given back to the kernel when freed.
# Its default threshold grows with what was freed (to 32 MB), so a model's per-layer tensors came
# from the heap and stayed resident after a task: a trainer held 831 MB after a task on a 56 MB
# model, 460 MB with the fixed threshold, its peak steady to the MB run after run (no slower).
# Every process robust starts gets it, unless the environment sets its own.
MALLOC_MMAP_THRESHOLD, MMAP_BYTES = "MALLOC_MMAP_THRESHOLD_", "131072"

APP_TOML = """\
# A Flower App whose components come from the installed `robust` package.
[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "{name}"
version = "1.0.0"
dependencies = []

[tool.flwr.app]
publisher = "robust"

[tool.flwr.app.components]
serverapp = "{serverapp}"
clientapp = "{clientapp}"

[tool.flwr.app.config]
state-dir = ""
{config}"""


def _bin(name: str) -> str:
    """A console script of this Python environment (``flower-superlink``, ``flwr``...)."""
    return str(Path(sys.executable).with_name(name))


def _server(name: str) -> list[str]:
    """The command of Flower's server ``name`` (``flower-superlink``, ``flower-supernode``), run
    with its reference cycles collected (``nodes.collect``: each request's body stays until
    then)."""
    return [sys.executable, "-m", "nodes.collect", _bin(name)]


def flwr_env(home: Path, first: Path | None = None) -> dict[str, str]:
    """The environment of Flower's processes. Flower starts its own helpers by name (the
    SuperLink ``flower-superexec``, the SuperNode ``flwr-clientapp``), so this environment's
    script folder goes first on ``PATH``: ``/path/venv/bin/robust`` works with no venv on it;
    before it, ``first`` (a volunteer's code gate, ``nodes.codetrust``). A SuperExec looks
    for a task to start every ``SUPEREXEC_POLL`` seconds (Flower's default, 1 s, is up to a
    second of every round's wait)."""
    path = os.pathsep.join([*([str(first)] if first else []), str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return {MALLOC_MMAP_THRESHOLD: MMAP_BYTES, **os.environ, "PATH": path, "FLWR_HOME": str(home),
            "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": SUPEREXEC_POLL}


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the process outlives a SIGKILLed parent
        pass


def spawn(args: list[str], home: Path, log: Path | int | None, own_group: bool = True, first: Path | None = None,
          wrap: list[str] = ()) -> subprocess.Popen:
    """Start ``args``, dying with us, in its own process group (or in ours, so that whoever
    signals our group reaches every process Flower starts under it); output to the file
    ``log``, or a pipe (``subprocess.PIPE``), or ours (``None``). ``wrap``: a prefix that runs
    the command elsewhere (the field lab's network namespace and CPU group)."""
    out = open(log, "ab") if isinstance(log, Path) else log  # noqa: SIM115 - the child keeps it open
    return subprocess.Popen([*wrap, *args], env=flwr_env(home, first), stdout=out,
                            stderr=None if out is None else subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=own_group, preexec_fn=_die_with_parent)


def _signal(proc: subprocess.Popen, sig: int) -> None:
    if os.getpgid(proc.pid) == proc.pid:
        os.killpg(proc.pid, sig)  # the process and everything it started
    else:
        proc.send_signal(sig)


def stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the process (its group, if it leads one), SIGKILL after ``grace`` seconds."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            _signal(proc, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


_terminated = False  # set by SIGTERM, for the waits that outlive a swallowed KeyboardInterrupt


def _interrupt(signum: int, frame: object) -> None:
    global _terminated
    _terminated = True
    raise KeyboardInterrupt


def stop_on_sigterm() -> None:
    """`kill`, systemd, docker stop: stop this process as Ctrl-C does (a ``KeyboardInterrupt``).

    Python ignores an exception raised while a finaliser runs ("Exception ignored in ..."), and a
    signal can arrive just then: a loop that waits calls :func:`raise_if_terminated` each turn, so
    a swallowed SIGTERM still stops it (found by CI: a field lab that went on after SIGTERM)."""
    signal.signal(signal.SIGTERM, _interrupt)


def raise_if_terminated() -> None:
    """Raise ``KeyboardInterrupt`` if this process was sent SIGTERM (see :func:`stop_on_sigterm`)."""
    if _terminated:
        raise KeyboardInterrupt


def free_port() -> int:
    """A port free now, drawn below the kernel's ephemeral range: a port from that range (what
    binding port 0 gives) can be taken by any process's outgoing connection between this check
    and the server's own bind, which happened to a SuperLink here ("address already in use")."""
    low = 32768
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    draw = random.SystemRandom()
    for _ in range(200 if low > 10_000 else 0):
        port = draw.randrange(10_000, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no room below the ephemeral range: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something listens on ``host:port`` (a running SuperLink, for us)."""
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def wait_for_tls(host: str, port: int, ca: Path, proc: subprocess.Popen, log: Path, timeout: float = 60.0) -> None:
    """Return once ``host:port`` completes a TLS handshake that verifies against ``ca``."""
    context = ssl.create_default_context(cafile=str(ca))
    context.check_hostname = False
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else []
            raise RuntimeError(f"the SuperLink exited with code {proc.returncode}; last lines of {log}:\n" + "\n".join(tail))
        try:
            with socket.create_connection((host, port), timeout=2) as raw, context.wrap_socket(raw):
                return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"the SuperLink did not answer on {host}:{port} within {timeout:.0f} s: see {log}")


# -- the coordinator side ------------------------------------------------------------------


def write_app(folder: Path, serverapp: str, clientapp: str, code: str = "", **config: int | str) -> None:
    """A Flower App folder naming installed components: its ``pyproject.toml``, and a copy of
    the user's ``code`` folder (shipped to volunteers, who run it only once they trust it)."""
    if folder.exists():
        shutil.rmtree(folder)  # a file the user removed from their code must not ship on
    if code:
        shutil.copytree(code, folder, ignore=shutil.ignore_patterns("__pycache__", ".*"))
    folder.mkdir(exist_ok=True)
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in config.items())
    name = "robust-" + folder.name.replace("_", "-")
    (folder / "pyproject.toml").write_text(APP_TOML.format(name=name, serverapp=serverapp, clientapp=clientapp, config=extra))


def prepare_coordinator(folder: Path, port: int, code: str = "") -> None:
    """Write the robust Flower App folder (with the user's ``code``) and the ``flwr`` CLI's
    connection to our SuperLink."""
    write_app(folder / APP_DIR, "nodes.coordinator.server_app:app", OWN_CLIENTAPP, code)
    (folder / CODE_SHA).unlink(missing_ok=True)
    if code:  # what volunteers are asked to trust, for the user to publish
        (folder / CODE_SHA).write_text(app_sha256(folder / APP_DIR) + "\n")
    home = folder / FLWR_HOME
    home.mkdir(exist_ok=True)
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
        f'address = "127.0.0.1:{port}"\nroot-certificates = "{(folder / "tls" / tls.CA_CERT).resolve()}"\n'
    )
    (folder / LOGS).mkdir(exist_ok=True)


def start_superlink(folder: Path, bind: str, port: int) -> subprocess.Popen:
    """The SuperLink, its state in memory: Flower's SQLite state answered "database is locked"
    to 5 of 20 volunteers pushing replies at once, losing them. Nothing is lost by keeping it
    in memory: the coordinator's checkpoint is the run's state, and keys are registered again
    at every start."""
    certs, log = folder / "tls", folder / LOGS / "superlink.log"
    proc = spawn([
        *_server("flower-superlink"), "--ssl-ca-certfile", str(certs / tls.CA_CERT),
        "--ssl-certfile", str(certs / tls.SERVER_CERT), "--ssl-keyfile", str(certs / tls.SERVER_KEY),
        "--enable-supernode-auth", "--disable-runtime-dependency-installation", "--host", bind, "--port", str(port),
    ], folder / FLWR_HOME, log)
    try:
        wait_for_tls("127.0.0.1", port, certs / tls.CA_CERT, proc, log)
    except BaseException:
        stop(proc)
        raise
    return proc


def flwr(folder: Path, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """Run the ``flwr`` CLI against our SuperLink."""
    return subprocess.run([_bin("flwr"), *args], env=flwr_env(folder / FLWR_HOME), capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def register(folder: Path, public_files: list[Path], at_once: int = 8) -> dict[Path, str]:
    """Register volunteers' keys with the SuperLink, ``at_once`` ``flwr`` processes at a time
    (each is a Python process of about 100 MB: hundreds at once would fill the machine); a key
    already registered is fine. Returns the files that failed, with Flower's message."""
    failed, waiting = {}, list(public_files)
    running: dict[Path, subprocess.Popen] = {}
    while waiting or running:
        while waiting and len(running) < at_once:
            path = waiting.pop(0)
            running[path] = subprocess.Popen([_bin("flwr"), "supernode", "register", str(path), "--format", "json"],
                                             env=flwr_env(folder / FLWR_HOME), stdout=subprocess.PIPE,
                                             stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
        path, proc = next(iter(running.items()))
        out, _ = proc.communicate(timeout=120)
        del running[path]
        if proc.returncode != 0 and "already" not in out.lower():
            failed[path] = out.strip().splitlines()[-1] if out.strip() else f"exit code {proc.returncode}"
    return failed


def submit_run(folder: Path, app: Path | None = None) -> str:
    """Start a ServerApp (default: the robust one) on our SuperLink; return Flower's run id."""
    state = str(folder.resolve()).replace("\\", "\\\\").replace('"', '\\"')
    done = flwr(folder, "run", str(app or folder / APP_DIR), CONNECTION, "--run-config", f'state-dir="{state}"', "--format", "json")
    try:
        return str(json.loads(done.stdout)["run-id"])
    except (ValueError, KeyError, TypeError):
        raise RuntimeError(f"`flwr run` failed: {(done.stdout + done.stderr).strip()[-2000:]}") from None


def run_status(folder: Path, run_id: str) -> tuple[str, str]:
    """Flower's ``(status, details)`` of the run, e.g. ``("finished:failed", "...")``."""
    done = flwr(folder, "ls", "--run-id", run_id, "--format", "json")
    try:
        run = json.loads(done.stdout)["runs"][0]
        return run["status"], run.get("status-details", "")
    except (ValueError, KeyError, IndexError, TypeError):
        return "unknown", (done.stdout + done.stderr).strip()[-500:]


def run_log(folder: Path, run_id: str) -> str:
    """The ServerApp's log, as Flower kept it."""
    done = flwr(folder, "log", run_id, CONNECTION, "--show")
    return done.stdout + done.stderr


# -- the volunteer side --------------------------------------------------------------------


def check_certificate(coordinator: str, ca: Path) -> str | None:
    """Raise ``ValueError`` if the coordinator at ``HOST:PORT`` answers with a certificate that
    does not verify against ``ca`` (for ``HOST``); return why it could not be asked (``None``
    when it verified): an unreachable coordinator is for the SuperNode to keep trying."""
    host, _, port = coordinator.rpartition(":")
    host = host.strip("[]")
    try:
        context = ssl.create_default_context(cafile=str(ca))
    except (ssl.SSLError, OSError) as err:
        raise ValueError(f"--ca {ca} is not a PEM certificate ({err}): ask the coordinator for its tls/ca.crt") from None
    try:
        with socket.create_connection((host, int(port)), timeout=5) as raw, context.wrap_socket(raw, server_hostname=host):
            return None
    except ssl.SSLCertVerificationError as err:
        raise ValueError(f"the coordinator's certificate does not verify against --ca {ca} ({err.verify_message}): "
                         "ask the coordinator for its tls/ca.crt, and reach it by a name or address it was made "
                         "for (robust coordinator init --host)") from None
    except (OSError, ValueError) as err:
        return f"{type(err).__name__}: {err}"

def start_supernode(folder: Path, coordinator: str, ca: Path, log: Path | int | None = None,
                    own_group: bool = True, wrap: list[str] = ()) -> subprocess.Popen:
    """A SuperNode for the volunteer whose folder (key, ``node.json``) is ``folder``; its
    ClientApps start through the volunteer's code gate (``nodes.codetrust``). ``log``: as
    :func:`spawn`'s."""
    config = f"folder={json.dumps(str(folder))}"
    home = folder / FLWR_HOME
    home.mkdir(parents=True, exist_ok=True)
    return spawn([
        *_server("flower-supernode"), "--superlink", coordinator, "--root-certificates", str(ca),
        "--auth-supernode-private-key", str(folder / "node.key"), "--node-config", config,
        "--port", str(free_port()),
    ], home, log, own_group, install_gate(folder), wrap)


def start_trainer(folder: Path, log: Path | None = None, own_group: bool = True, setup: dict | None = None,
                  wrap: list[str] = ()) -> subprocess.Popen:
    """The warm trainer of the volunteer whose folder (key, ``node.json``) is ``folder``: its
    SuperNode's ClientApps hand it their tasks. With ``setup`` (``robust node join``'s
    choices) it first checks them and prepares the node's data and ``node.json``."""
    args = [sys.executable, "-m", "nodes.volunteer.trainer", str(folder)]
    return spawn(args + (["--setup", json.dumps(setup)] if setup else []), folder / FLWR_HOME, log, own_group, wrap=wrap)


def start_node(folder: Path, coordinator: str, ca: Path, wrap: list[str] = ()) -> list[subprocess.Popen]:
    """A prepared volunteer's (``node.json`` written) warm trainer and SuperNode, logging to
    ``trainer.log`` and ``supernode.log`` in its folder: a bench's volunteer, without the
    supervisor that ``robust node join`` adds. ``wrap``: a prefix for both (a compute
    profile's environment, ``robust.profiles.Profile.prefix``)."""
    folder = folder.resolve()
    return [start_trainer(folder, folder / "trainer.log", wrap=wrap),
            start_supernode(folder, coordinator, ca.resolve(), folder / "supernode.log", wrap=wrap)]
