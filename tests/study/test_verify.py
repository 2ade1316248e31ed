"""`deltalens study verify`: a study's checks re-derived from its analysis.json alone, and compared with what it
states. The published tiny claims-6/7 study (docs/, 17 checks: claim 1 at two K, claim 6's Fieller shares, claim
7's differences and its paired-reward correlation) is the known answer: it must re-derive exactly, and a
change to one stated number or to one per-problem count must show up as exactly the checks it touches."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from support import run_cli

from deltalens.errors import DeltalensError
from deltalens.study.verify import compare, verify

PUBLISHED = Path(__file__).resolve().parents[2] / "docs" / "tiny-claims67-scaled-2026-12-06"


def _doc() -> dict:
    with gzip.open(PUBLISHED / "analysis.json.gz") as f:
        return json.loads(f.read())


def _check(doc, name_start: str) -> dict:
    return next(c for cl in doc["study"]["claims"] for c in cl["checks"] if c["check"].startswith(name_start))


def test_the_published_study_rederives_exactly(tmp_path):
    r = run_cli(["study", "verify", str(PUBLISHED), "--json", str(tmp_path / "v.json")])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "17 of 17 checks re-derived identically" in text and "verified:" in text
    res = json.loads((tmp_path / "v.json").read_text())
    assert res["ok"] and res["differing"] == [] and all(c["stated"] == c["derived"] for c in res["claims"])
    assert {c["id"] for c in res["claims"]} >= {1, 6, 7}


def test_a_changed_number_and_a_changed_count_are_named(tmp_path):
    doc = _doc()
    n8 = _check(doc, "es N=8")
    n8["estimate"] += 0.01  # a stated number nobody derived
    rows = doc["study"]["data"]["evaluations"]["0.6"]["es-n16-s1"]
    i = next(i for i, r in enumerate(rows) if 0 < r["correct"] < r["n"])
    rows[i]["correct"] -= 1  # one sample of one problem of the es-n16 run, seed 1
    claim6 = next(cl for cl in doc["study"]["claims"] if cl["id"] == 6)
    stated_verdict = claim6["verdict"]
    claim6["verdict"] = "contradicted" if stated_verdict != "contradicted" else "reproduced"
    (tmp_path / "analysis.json").write_text(json.dumps(doc))

    r = run_cli(["study", "verify", str(tmp_path), "--json", str(tmp_path / "v.json")])
    assert r.exit_code == 1, r.output
    text = " ".join(r.output.split())
    assert "NOT verified" in text and f"claim 6: stated {claim6['verdict']}, derived {stated_verdict}" in text
    res = json.loads((tmp_path / "v.json").read_text())
    differing = {d["check"]: d for d in res["differing"]}
    # the changed statement: only its estimate
    assert list(differing[n8["check"]]["fields"]) == ["estimate"]
    assert differing[n8["check"]]["fields"]["estimate"]["derived"] == pytest.approx(n8["estimate"] - 0.01)
    # the changed count moves every check computed from the es-n16 runs' Pass@1 (and, through Holm, p values)
    touched = [c for c in differing if c.startswith("es N=16") or "minus es-n16" in c]
    assert touched and all("estimate" in differing[c]["fields"] for c in touched if "Pass@1" in c or "N=16" in c)
    # nothing derived from other data moved its estimate
    assert not [c for c, d in differing.items() if "estimate" in d["fields"] and c not in touched
                and c != n8["check"]]


def test_an_incomplete_or_foreign_document_is_refused_in_one_line(tmp_path):
    doc = _doc()
    del doc["study"]["data"]
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "analysis.json").write_text(json.dumps(doc))
    (tmp_path / "b.json").write_text(json.dumps({"schema_version": 1}))
    for target, message in ((tmp_path / "a", "no study.data"), (tmp_path / "b.json", "not a study's analysis"),
                            (tmp_path / "none", "no analysis.json")):
        r = run_cli(["study", "verify", str(target)])
        lines = [ln for ln in r.output.splitlines() if ln.strip()]
        assert r.exit_code == 2 and len(lines) == 1 and message in lines[0], r.output
    with pytest.raises(DeltalensError, match="cannot be re-derived"):
        verify(tmp_path / "a")


def test_compare_on_known_rows():
    stated = [{"claim": 1, "check": "a", "estimate": 0.5, "ci_low": None},
              {"claim": 1, "check": "b", "estimate": 0.1},
              {"claim": 2, "check": "gone", "estimate": 1.0}]
    derived = [{"claim": 1, "check": "a", "estimate": 0.5 * (1 + 1e-12), "ci_low": float("nan"), "new": True},
               {"claim": 1, "check": "b", "estimate": 0.1 + 1e-6},
               {"claim": 3, "check": "extra", "estimate": 2.0}]
    rows = {r["check"]: r for r in compare(stated, derived)}
    # a float agreeing to 1e-9 and an undefined number (null in JSON, NaN derived) are the same; a field the
    # document predates is listed, not counted
    assert rows["a"]["status"] == "identical" and rows["a"]["added"] == ["new"]
    assert rows["b"]["status"] == "differs" and list(rows["b"]["fields"]) == ["estimate"]
    assert rows["gone"]["status"] == "not re-derived" and rows["extra"]["status"] == "not stated"
    # a name stated twice is two checks: the second is not hidden behind the first
    twice = compare([stated[1], {**stated[1], "estimate": 0.2}], [stated[1], stated[1]])
    assert [r["status"] for r in twice] == ["identical", "differs"]


def test_a_piece_without_first_run_measures_verifies(tmp_path):
    """A piece run with --no-first-run-measures states claims 3, 9 and 10 as not run; the verification derives
    the verdict table by the study's own rule, so it agrees (it read them as missing before)."""
    from deltalens.study.run import study_checks, study_claims
    from deltalens.study.runs import by_group
    from deltalens.study.verify import config_of, inputs_of

    doc = _doc()
    doc["study"]["config"]["first_run_measures"] = False
    doc["study"]["data"]["sparsity"], doc["diversity"], doc["sparsify"] = {}, {}, {}
    cfg = config_of(doc["study"])
    groups = by_group(doc["study"]["runs"])
    checks, _, _ = study_checks(cfg, groups, inputs_of(doc, cfg, groups)[0])
    doc["study"]["claims"] = json.loads(json.dumps(study_claims(cfg, checks), default=float))
    assert {cl["id"]: cl["verdict"] for cl in doc["study"]["claims"]}[3] == "not run"
    (tmp_path / "analysis.json").write_text(json.dumps(doc))
    res = verify(tmp_path)
    assert res["ok"] and res["checks"] == res["identical"] == len(checks)
