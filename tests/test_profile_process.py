"""A process at a compute profile (``robust.profile_process``): where the coordinator's
``referee-profile`` runs its recomputations."""

from __future__ import annotations

import os

import pytest

from robust import profiles
from robust.profile_process import Remote, here, runner
from robust.profiles import Profile


def test_a_remote_runs_at_its_level_raises_its_errors_here_and_outlives_its_process():
    level = Profile.parse("cpu:isa=default")
    if level.refusal():
        pytest.skip(level.refusal())
    remote = runner(level)
    assert isinstance(remote, Remote) and runner(Profile.parse("cpu")) is here
    try:
        assert remote(profiles.effective) == "DEFAULT" != here(profiles.effective)
        with pytest.raises(ValueError, match="isa must be one of"):  # its exception, raised here
            remote(profiles.check, "cpu:isa=sse")
        with pytest.raises(RuntimeError, match="cpu:isa=default,threads=1 ended while computing _exit"):
            remote(os._exit, 3)  # the process dies mid-call
        assert remote(profiles.effective) == "DEFAULT"  # a fresh one
    finally:
        remote.close()
    assert remote.proc is None
