"""The study's verdict table fits an 80-column terminal without cutting any claim's text (issue #31)."""

from __future__ import annotations

import io
import json
from pathlib import Path

from rich.console import Console

from cli.study import show

FIXTURE = Path(__file__).parents[1] / "fixtures" / "analysis_study.json"


def test_verdict_table_fits_80_columns_and_keeps_every_word():
    doc = json.loads(FIXTURE.read_text())
    doc["study"]["config"].setdefault("task", "add:digits=1-2,terms=2,shots=2")
    buf = io.StringIO()
    show(doc, Path("study"), console=Console(file=buf, width=80))
    lines = buf.getvalue().splitlines()
    assert max(len(x) for x in lines) <= 80
    # the check column (first cell of each body line), joined: every claim title and check reads whole in it
    cells = [x.split("│")[1] for x in lines if x.startswith("│")]
    column = " ".join(" ".join(cells).split())
    for cl in doc["study"]["claims"]:
        assert " ".join(f"({cl['id']}) {cl['title']}".split()) in column, cl["title"]
        for ch in cl["checks"]:
            assert " ".join(ch["check"].split()) in column, ch["check"]


def test_a_one_seed_interval_reads_undefined_not_nan():
    doc = json.loads(FIXTURE.read_text())
    doc["study"]["config"].setdefault("task", "add:digits=1-2,terms=2,shots=2")
    check = doc["study"]["claims"][0]["checks"][0]
    check.update(estimate=3.0, ci_low=float("nan"), ci_high=float("nan"))  # stats.seed_interval of one seed
    buf = io.StringIO()
    show(doc, Path("study"), console=Console(file=buf, width=120))
    text = buf.getvalue()
    assert "nan" not in text.lower()
    row = next(x for x in text.splitlines() if check["check"].split()[0] in x and "3" in x)
    assert "undefined" in row, row
