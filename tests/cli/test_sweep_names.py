"""Grid values are user text: a sweep's run directories are sanitized names inside DIR/runs (never a path
that escapes --out), distinct points get distinct names, and the printed table never reads user text as
rich markup (a `[/...]` in a value was a MarkupError traceback)."""

from __future__ import annotations

import json
import re

import pytest
from support import run_cli, tiny_spec

from deltalens.errors import DeltalensError
from deltalens.study import sweep

SAFE = re.compile(r"[A-Za-z0-9._=-]+")
TINY_RUN = ["--iterations", "1", "--population", "2", "--prompts-per-iteration", "2", "--eval-every", "0",
            "--val-limit", "2", "--val-samples", "1", "--val-temperature", "0"]


def _dirs(grid: list[str], out, seeds=(0,)):
    runs = sweep.plan("es", sweep.parse_grid("es", grid), {"task": "arith"}, preset="tiny",
                      ev=sweep.Evaluation(seeds=seeds), out=out)
    return [r["dir"] for r in runs]


@pytest.mark.parametrize("value", ["*[/../../../../esc/]*", "../../x", "..", ".hidden", "a/b", "[bold]x[/]",
                                   "*" * 300, "é✓\t\n", "model.*", "a..b"])
def test_hostile_values_name_a_directory_inside_runs(tmp_path, value):
    out = tmp_path / "sw"
    (d,) = _dirs([f"params={value}"], out)
    name = d.name
    assert d.parent == out / "runs" and d.resolve().parent == (out / "runs").resolve()
    assert SAFE.fullmatch(name) and ".." not in name and not name.startswith(".") and len(name) <= 90, name


def test_plain_names_are_unchanged_and_distinct_values_never_share_a_directory(tmp_path):
    # the names earlier sweeps used stay the same (a rerun resumes them)
    assert sweep.point_name({"sigma": 0.003, "alpha": 0.0015}) == "sigma=0.003_alpha=0.0015"
    assert sweep.point_name({"learning_rate": 1e-05}) == "learning_rate=1e-05"
    # `:g` rounds to 6 digits: 0.0010000001 and 0.001 were one directory
    assert sweep.point_name({"sigma": 0.0010000001}) != sweep.point_name({"sigma": 0.001})
    # values that slug alike ('a/b' and 'a_b', 'a?b') differ by the hash of the exact value
    names = [d.name for d in _dirs(["params=a/b,a_b,a?b,a..b,a.b"], tmp_path / "sw")]
    assert len(set(names)) == 5, names
    # a value spelling out another's hashed name would share its directory: refused before anything is written
    hashed = sweep.point_name({"params": ("a/b",)})
    assert hashed.startswith("params=a_b-")
    with pytest.raises(DeltalensError, match=f"would share the run directory {hashed}"):
        sweep.plan("es", {"params": [("a/b",), (hashed.removeprefix("params="),)]}, {"task": "arith"},
                   preset="tiny", ev=sweep.Evaluation(), out=tmp_path / "sw2")
    assert not (tmp_path / "sw2").exists()


def test_a_link_in_runs_pointing_outside_is_refused(tmp_path):
    out, elsewhere = tmp_path / "sw", tmp_path / "elsewhere"
    (out / "runs").mkdir(parents=True)
    elsewhere.mkdir()
    (out / "runs" / "sigma=0.003-s0").symlink_to(elsewhere)
    with pytest.raises(DeltalensError, match="leads outside"):
        _dirs(["sigma=3e-3"], out)


def test_the_table_never_reads_user_text_as_markup(capsys):
    from deltalens.cli import sweep as cli_sweep

    point = {"name": "[/evil]", "pass_at_1": 0.5, "vs_base": 0.1, "vs_base_ci": [0.0, 0.2], "vs_best": 0.0,
             "vs_best_ci": [0.0, 0.0], "within_noise_of_best": True, "mean_reward": 0.4}
    doc = {"method": "es", "model": "[/]model[bold]", "task": "[red]t[/red]", "best": "[/evil]",
           "evaluation": {"problems": 2, "samples": 1, "temperature": 0.0}, "base": {"pass_at_1": 0.4},
           "points": [point]}
    cli_sweep.c.console.width = 300
    cli_sweep.show(doc, __import__("pathlib").Path("[/out]"))  # a MarkupError before
    err = capsys.readouterr()
    text = err.out + err.err
    assert "[/evil]" in text and "[/]model[bold]" in text and "[red]t[/red]" in text and "[/out]/sweep.json" in text


def test_sweep_with_a_path_like_grid_value_stays_inside_out(tmp_path):
    """The issue's case end to end: `params=*[/../../../../esc/]*` (a valid glob: any name with '/', '.',
    'e', 's' or 'c') trains and prints; nothing is written outside --out."""
    work = tmp_path / "a" / "b" / "c"
    work.mkdir(parents=True)
    out = work / "sw"
    r = run_cli(["sweep", "es", "--model", tiny_spec(), "--grid", "params=*[/../../../../esc/]*", *TINY_RUN,
                 "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "Traceback" not in r.output
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if not p.is_relative_to(out)) == \
        ["a", "a/b", "a/b/c"]
    (run,) = (out / "runs").iterdir()
    assert SAFE.fullmatch(run.name) and (run / "checkpoints" / "final").is_dir()
    doc = json.loads((out / "sweep.json").read_text())
    assert doc["points"][0]["values"] == {"params": ["*[/../../../../esc/]*"]}  # the exact value is kept
    assert doc["points"][0]["name"] + "-s0" == run.name and doc["points"][0]["name"] in r.output
