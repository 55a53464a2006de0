"""Events noted beside a run (``nodes.coordinator.events``), as the dashboard lists them."""

from __future__ import annotations

from nodes.coordinator import events
from nodes.coordinator.admission import short
from nodes.dashboard.view import RunView
from nodes.settings import Settings

from .federation_kit import fingerprint, make_federation


def test_the_dashboard_lists_the_events_noted_beside_a_run_and_passes_over_broken_lines(tmp_path):
    coord, nodes = make_federation(tmp_path, 2, Settings(rounds=1))
    fp = fingerprint(nodes[1])
    events.note(coord, "link-down:node=2,after=4,seconds=6 began", fp, at=100.0)
    with open(coord / events.EVENTS, "a") as out:
        out.write('{"time": "soon"}\nnot json\n{"time": 1, "what": "<b>cut short')  # broken, and a half-written line
    view = RunView(coord)
    assert view.docs()["status"]["events"] == [{"time": 100.0, "node": short(fp),
                                                 "what": "link-down:node=2,after=4,seconds=6 began"}]
    events.note(coord, "link-down:node=2,after=4,seconds=6 ended", fp)  # the view is rebuilt when the file grows
    assert [e["what"] for e in view.docs()["status"]["events"]][-1].endswith("ended")
