"""What the field lab hands the coordinator it deploys: the scenario's deadline, as the simulated
clock that predicts the run has it (a ``late = "carry"`` cell is late at the same point in both)."""

from __future__ import annotations

from evaluation.bench.cell import cell_settings
from evaluation.bench.scenario import cells, load_scenario
from evaluation.field.lab.lab import DEADLINE, deployment

SCENARIO = """[scenario]
dataset = "digits"
model = "mlp"
nodes = 4
byzantine = 0
rounds = 2
seeds = [0]
aggregators = ["mean"]
attacks = ["none"]
late = "carry"
deadline = [0, 15]
target-accuracy = 0.5
"""


def test_the_lab_deploys_the_scenarios_deadline(tmp_path):
    path = tmp_path / "field.toml"
    path.write_text(SCENARIO)
    waits = sorted(cell_settings(c, **deployment(c)).deadline for c in cells(load_scenario(str(path), [], "field")))
    assert waits == [15.0, DEADLINE]  # none given: only a broken node is late
