"""What ``robust coordinator start`` checks before any process starts, in a process of its own:
``python -m nodes.coordinator.precheck FOLDER`` (the settings' overrides pickled on its
standard input; the answer pickled on its standard output).

The settings (whose checks build the rules), the checkpoint and the round log are checked by
building the coordinator, as the ServerApp will; its engine holds the model two or three times
(1,133 MB at 100M parameters) and its checks import PyTorch (another 200 MB or so), which the
supervisor, which then only follows the run for days, never needs (:func:`checked`: 44 MB).
"""

from __future__ import annotations

import contextlib
import pickle
import subprocess
import sys
from pathlib import Path

from ..settings import SETTINGS_FILE, Settings
from .admission import scan
from .disk import Projection


def checked(folder: Path, overrides: dict) -> tuple[Settings, int, Projection]:
    """The run's settings (with ``overrides``, written to the folder; the rules' quorum kept in
    them), the rounds it has done and what the rest will store; a ``ValueError`` saying what to
    do when the folder cannot run. Warnings go to our standard error."""
    done = subprocess.run([sys.executable, "-m", __name__, str(folder)], input=pickle.dumps(overrides),
                          stdout=subprocess.PIPE, check=False)
    if done.returncode != 0 or not done.stdout:
        raise RuntimeError(f"checking {folder} failed (exit {done.returncode}): see the lines above")
    ok, answer = pickle.loads(done.stdout)  # noqa: S301 - our own child's answer
    if not ok:
        raise ValueError(answer)
    return answer


def _check(folder: Path, overrides: dict) -> tuple[Settings, int, Projection]:
    settings = Settings.read(folder).replace(**overrides)
    (folder / SETTINGS_FILE).write_text(settings.to_toml())
    found, _ = scan(folder)  # the Coordinator below warns of each file it skips
    if not found:
        raise ValueError(f"no volunteer is admitted yet: `robust coordinator admit {folder} NODE.pub` first")
    from .coordinator import Coordinator

    coordinator = Coordinator(folder)
    settings.quorum_needed  # noqa: B018 - kept in the settings handed back
    return settings, coordinator.round, coordinator.disk()


def main() -> None:
    overrides = pickle.loads(sys.stdin.buffer.read())  # noqa: S301 - from our own parent
    answer = sys.stdout.buffer
    with contextlib.redirect_stdout(sys.stderr):  # only the answer on our standard output
        try:
            result = True, _check(Path(sys.argv[1]), overrides)
        except ValueError as err:  # what to do, said by the parent
            result = False, str(err)
    answer.write(pickle.dumps(result))


if __name__ == "__main__":
    main()
