"""`deltalens sweep`: a grid trained and scored on validation only, intervals against base and best, a rerun
redoes nothing, and bad grids are refused before anything is written."""

from __future__ import annotations

import json

import pytest
from support import run_cli, tiny_spec

from deltalens.errors import DeltalensError
from deltalens.study import sweep

SMALL = ["--iterations", "2", "--population", "4", "--prompts-per-iteration", "4", "--eval-every", "0",
         "--val-limit", "8", "--val-samples", "2"]


def test_parse_grid_types_values_and_refuses_what_a_sweep_cannot_vary():
    assert sweep.parse_grid("es", ["sigma=3e-3,6e-3", "--population-batch=1,2"]) == {
        "sigma": [0.003, 0.006], "population_batch": [1, 2]}
    assert sweep.parse_grid("grpo", ["learning_rate=1e-5"]) == {"learning_rate": [1e-5]}
    assert sweep.parse_grid("grpo", ["lr=1e-5,2e-5", "--prompts=4"]) == {"learning_rate": [1e-5, 2e-5],
                                                                         "prompts_per_step": [4]}
    for bad, msg in ((["sigmaa=1"], "es has no option --sigmaa"), (["sigma"], "name=v1,v2"),
                     (["seed=0,1"], "use --seeds"), (["task=arith"], "fixed for a whole sweep"),
                     (["sigma=1,1"], "lists a value twice"), (["sigma=1", "sigma=2"], "twice"),
                     (["population=x"], "population must be an integer"), ([], "at least one --grid")):
        with pytest.raises(DeltalensError, match=msg):
            sweep.parse_grid("es", bad)


def test_point_names_are_stable_directory_names():
    assert sweep.point_name({"sigma": 0.003, "alpha": 0.0015}) == "sigma=0.003_alpha=0.0015"
    assert sweep.point_name({"antithetic": True, "population": 8}) == "antithetic=True_population=8"


def test_sweep_scores_on_validation_only_and_a_rerun_redoes_nothing(tmp_path, monkeypatch):
    splits = []
    real_evaluate = sweep.evaluate

    def spy(*args, **kw):  # every score the sweep computes (training's own evaluations are validation too)
        splits.append(kw.get("split"))
        return real_evaluate(*args, **kw)

    monkeypatch.setattr(sweep, "evaluate", spy)
    out = tmp_path / "sw"
    r = run_cli(["sweep", "es", "--model", tiny_spec(), "--grid", "sigma=3e-3,6e-3", "--alpha", "3e-2",
                 *SMALL, "--out", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "sweep.json").read_text())
    assert doc["evaluation"]["split"] == "validation" and doc["evaluation"]["problems"] == 8
    assert splits == ["validation"] * 3  # the base and two points, never the test split
    names = [p["name"] for p in doc["points"]]
    assert sorted(names) == ["sigma=0.003", "sigma=0.006"] and doc["best"] == names[0]
    by = {p["name"]: p for p in doc["points"]}
    # the footnote for "*" rows only when some row carries the mark
    marked = not all(p["within_noise_of_best"] for p in doc["points"])
    assert ("* the interval against the best excludes 0" in r.output) == marked
    # known answers: each score is what `deltalens eval` prints for that model on the same validation problems
    for spec, want in ((tiny_spec(), doc["base"]["pass_at_1"]),
                       (out / "runs" / "sigma=0.006-s0", by["sigma=0.006"]["pass_at_1"])):
        js = tmp_path / "eval.json"
        e = run_cli(["eval", spec, "--split", "validation", "--limit", "8", "--samples", "2", "--k", "1",
                     "--temperature", "0.6", "--json", js])
        assert e.exit_code == 0, e.output
        assert next(iter(json.loads(js.read_text())["evals"].values()))["pass_at_k"]["1"] == pytest.approx(want)
        js.unlink()
    assert by[names[1]]["within_noise_of_best"] == (by[names[1]]["vs_best_ci"][0] <= 0)
    for p in doc["points"]:
        lo, hi = p["vs_base_ci"]
        assert lo <= p["vs_base"] <= hi
        assert p["pass_at_1"] == pytest.approx(doc["base"]["pass_at_1"] + p["vs_base"])
    assert (out / "runs" / "sigma=0.006-s0" / "checkpoints" / "final").is_dir()
    md = (out / "sweep.md").read_text()
    assert "8 **validation** problems" in md and f"| **{doc['best']}** |" in md
    final = out / "runs" / "sigma=0.006-s0" / "checkpoints" / "final" / "model.safetensors"
    mtime = final.stat().st_mtime_ns
    r2 = run_cli(["sweep", "es", "--model", tiny_spec(), "--grid", "sigma=3e-3,6e-3", "--alpha", "3e-2",
                  *SMALL, "--out", str(out)])
    assert r2.exit_code == 0, r2.output
    assert final.stat().st_mtime_ns == mtime and r2.output.count(": done") == 2 and "training" not in r2.output
    assert json.loads((out / "sweep.json").read_text())["points"] == doc["points"]
    # what a point means is pinned: other fixed options under the same directory are refused
    r3 = run_cli(["sweep", "es", "--model", tiny_spec(), "--grid", "sigma=3e-3", "--alpha", "1e-2", *SMALL,
                  "--out", str(out)])
    assert r3.exit_code == 2 and "a sweep with other settings (fixed differ)" in r3.output


def test_bad_sweeps_exit_2_before_writing(tmp_path):
    out = tmp_path / "sw"
    cases = [
        (["--grid", "sigma=1e-3", "--seed", "1"], "No such option: --seed"),
        (["--grid", "sigma=1e-3", "--sigma", "2e-3"], "--sigma given both as a fixed option and in --grid"),
        (["--grid", "sigma=-1"], "sigma"),
        (["--grid", "sigma=1e-3", "--val-temperature", "0"], "use --val-samples 1"),
        (["--grid", "sigma=1e-3", "--val-limit", "1"], "at least 2 validation problems"),
        (["--grid", "sigma=1e-3", "--seeds", "0,x"], "seeds must be an integer"),
    ]
    for args, msg in cases:
        r = run_cli(["sweep", "es", "--model", tiny_spec(), *args, "--out", str(out)])
        assert r.exit_code == 2 and msg in r.output, (args, r.output)
        assert len(r.output.strip().splitlines()) == 1, r.output
        assert not out.exists()


def test_sweep_md_says_when_its_intervals_hold_no_seed_variation():
    """One training seed per point: the intervals are over problems only, and sweep.md says so; with two
    seeds they carry the seed spread and the note is absent."""
    from deltalens.reports.markdown import ONE_SEED_NOTE, sweep_markdown

    point = {"name": "a", "pass_at_1": 0.5, "vs_base": 0.1, "vs_base_ci": [0.0, 0.2], "vs_best": 0.0,
             "vs_best_ci": [0.0, 0.0], "within_noise_of_best": True}
    for seeds, noted in (([0], True), ([0, 1], False)):
        doc = {"method": "grpo", "model": "m", "task": "t", "evaluation": {"problems": 8, "samples": 2,
                                                                           "seeds": seeds}, "best": "a",
               "base": {"pass_at_1": 0.4}, "points": [point]}
        assert (ONE_SEED_NOTE in sweep_markdown(doc)) == noted
