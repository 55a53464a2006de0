"""The portable CPU profile's measurement (``python -m evaluation.portable``), small: two settings
every x86 CPU runs, the matmul and the MLP. Its hashes are never written here (they are the
CPU's): what is checked is that a setting gives the same SHA-256s in two fresh processes, that
``--against`` reports a run against its own output as equal everywhere, and that it reports a
machine whose hashes differ as different, computation by computation."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

from evaluation.microbench.portable_profile import compare, main, measure

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ["uncapped", "isa=default"]
COMPUTATIONS = ["matmul", "mlp"]


def hashes(result: dict) -> dict[str, dict[str, str]]:
    return {s["name"]: s["sha256"] for s in result["settings"]}


def test_a_setting_gives_its_bits_in_every_process_and_against_says_which_machines_agree(tmp_path):
    first = measure(SETTINGS, COMPUTATIONS, repeats=1, nodes=2)
    assert [s["name"] for s in first["settings"]] == SETTINGS
    for s in first["settings"]:
        assert s["stable"], s  # logged and not, in one process: the same bits
        assert sorted(s["sha256"]) == sorted(COMPUTATIONS) and all(len(h) == 64 for h in s["sha256"].values())
        assert sorted(s["ms"]) == ["matmul", "mlp"] and min(s["ms"].values()) > 0 and s["effective"]["aten"]
    assert first["settings"][0]["relative"] == {"mlp": 1.0, "matmul": 1.0}  # against itself
    assert first["settings"][1]["effective"]["aten"] == "DEFAULT"
    assert len({json.dumps(s["inputs"], sort_keys=True) for s in first["settings"]}) == 1  # one input everywhere
    assert sorted(n for group in first["same"]["mlp"] for n in group) == sorted(SETTINGS)

    here = tmp_path / "machine.json"
    here.write_text("a table first, as the command prints it\n" + json.dumps(first) + "\n")
    done = subprocess.run([sys.executable, "-m", "evaluation.portable", "--json", "--repeats", "1", "--nodes", "2",
                           "--settings", *SETTINGS, "--computations", *COMPUTATIONS, "--against", str(here)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    second = json.loads(done.stdout.splitlines()[-1])
    assert hashes(second) == hashes(first)  # each setting in two fresh processes
    against = second["against"]
    assert against["settings"] == {n: {c: "same" for c in COMPUTATIONS} for n in SETTINGS}
    assert against["exact"] == SETTINGS and against["caveats"] == [] and against["not_here"] == []
    assert against["levels"] == {}
    assert "bit-exact on both machines, every computation: uncapped, isa=default" in done.stderr

    other = copy.deepcopy(first)  # a machine on which isa=default's MLP came out otherwise
    sha = other["settings"][1]["sha256"]["mlp"]
    other["settings"][1]["sha256"]["mlp"] = ("0" if sha[0] != "0" else "1") + sha[1:]
    other["settings"].append({**other["settings"][0], "name": "isa=avx512"})  # a level only it ran
    del other["settings"][0]["sha256"]["matmul"]
    verdict = compare(second, other)
    assert verdict["settings"] == {"uncapped": {"matmul": "missing", "mlp": "same"},
                                   "isa=default": {"matmul": "same", "mlp": "different"}}
    assert verdict["exact"] == [] and verdict["not_here"] == ["isa=avx512"] and verdict["levels"] == {}
    other["settings"][1]["effective"] = {**other["settings"][1]["effective"], "mkl_cnr": ["AUTO"]}
    assert compare(second, other)["levels"] == {
        "isa=default": [f"mkl_cnr {second['settings'][1]['effective']['mkl_cnr']} / ['AUTO']"]}
    other["settings"][1]["inputs"] = {**other["settings"][1]["inputs"], "mlp": "0" * 64}
    other["nodes"] = 3
    assert compare(second, other)["caveats"] == ["isa=default: input mlp differs", "nodes: 2 here, 3 there"]


def test_a_wrong_file_or_setting_is_a_usage_error_before_anything_runs(tmp_path, capsys):
    assert main(["--against", str(tmp_path / "absent.json")]) == 2
    (tmp_path / "other.json").write_text('{"not": "a run"}\n')
    assert main(["--against", str(tmp_path / "other.json")]) == 2
    assert main(["--settings", "isa=sse9"]) == 2
    err = capsys.readouterr().err
    assert "absent.json: No such file" in err and "no output of `python -m evaluation.portable --json`" in err
    assert "settings ['isa=sse9'] unknown (choose among uncapped," in err
