"""`deltalens study`: every claim gets checks and a verdict by the stated rule, the document validates, and a
killed study continues without redoing finished runs or measurements."""

from __future__ import annotations

import json

import pytest
from deltalens.reports.common import fmt_g
from support import run_cli, tiny_spec

from deltalens.schema import validate
from deltalens.study import run as study_run
from deltalens.study.config import StudyConfig

SMALL = {"methods": ("es", "grpo"), "seeds": (0, 1), "budget": 4096, "limit": 6, "samples": 4, "ks": (1, 4),
         "base_seeds": 2, "sparsity": (0.9,), "sparsify_samples": 2, "diversity_members": 2, "diversity_prompts": 2,
         "entropy_prompts": 3, "resamples": 100}


def test_study_resumes_after_a_kill_and_redoes_nothing(tmp_path, monkeypatch):
    cfg = StudyConfig(model=tiny_spec(), **SMALL)
    out = tmp_path / "study"
    real = study_run.train_grpo
    calls = []

    def killed(*args, **kw):  # the study dies while training the first GRPO run
        calls.append(kw.get("resume"))
        raise KeyboardInterrupt

    monkeypatch.setattr(study_run, "train_grpo", killed)
    with pytest.raises(KeyboardInterrupt):
        study_run.run_study(cfg, out, log=lambda s: None)
    es_final = out / "runs" / "es-s0" / "checkpoints" / "final" / "model.safetensors"
    mtime = es_final.stat().st_mtime_ns
    monkeypatch.setattr(study_run, "train_grpo", real)
    logs = []
    doc = study_run.run_study(cfg, out, log=logs.append)
    assert es_final.stat().st_mtime_ns == mtime  # finished runs are not retrained
    assert "es-s0: done" in logs and "es-s1: done" in logs
    validate(doc)
    # runs are named relative to the study directory: the report reads the same wherever the study moved
    assert [r["dir"] for r in doc["study"]["runs"]][:2] == ["runs/es-s0", "runs/es-s1"]
    assert {m["label"]: m["path"] for m in doc["models"]}["grpo-s1"] == "runs/grpo-s1"
    assert str(tmp_path) not in (out / "report.html").read_text()
    assert doc["diversity"]["es-s0"]["model"] == "runs/es-s0"
    assert doc["diversity"]["es-s0"]["centre"].startswith("runs/es-s0/checkpoints/")
    assert str(tmp_path) not in json.dumps(doc)  # analysis.json names no path of this machine
    claims = {c["id"]: c for c in doc["study"]["claims"]}
    assert {1, 2, 3, 4, 6, 7} <= set(claims)
    for c in claims.values():
        assert c["verdict"] in ("reproduced", "contradicted", "mixed", "unclear") and c["checks"]
        for ch in c["checks"]:
            lo, hi = ch["ci_low"], ch["ci_high"]
            assert lo is None or lo <= ch["estimate"] + 1e-9 <= hi + 2e-9 or ch["metric"] == "gain retained"
    assert (out / "report.html").exists() and (out / "verdicts.csv").read_text().startswith("claim,check")
    md = (out / "verdicts.md").read_text()
    assert md.startswith(f"Study of `{tiny_spec()}` on `arith`") and "| model | Pass@1 |" in md
    assert "es:maj@4" in doc["study"]["effects"] and "es:maj@1" not in doc["study"]["effects"]  # Maj@1 = Pass@1
    assert sum(x.startswith("| **") for x in md.splitlines()) == len(claims)  # one bold row per claim
    assert all(c["check"].replace("|", "\\|") in md for cl in claims.values() for c in cl["checks"])
    # claim 1's checks carry each training seed's effect; their mean is the estimate, and both tables show them
    ch = claims[1]["checks"][0]
    assert len(ch["per_seed"]) == 2 and sum(ch["per_seed"]) / 2 == pytest.approx(ch["estimate"])
    assert f"| {ch['check']} | {fmt_g(ch['estimate'])} | {fmt_g(ch['per_seed'][0])}, " in md
    assert "<th>Per training seed</th>" in (out / "report.html").read_text()
    # a rerun measures nothing again: every result comes from the cache
    logs.clear()
    study_run.run_study(cfg, out, log=logs.append)
    assert not [x for x in logs if x.startswith("cached:") is False and ("training" in x or "resuming" in x)]
    assert sum(x.startswith("cached:") for x in logs) >= 10
    # the settings the runs depend on are pinned
    other = StudyConfig(model=tiny_spec(), **{**SMALL, "budget": 8192})
    with pytest.raises(Exception, match="other settings"):
        study_run.run_study(other, out, log=lambda s: None)


def test_cli_refuses_bad_settings_before_work(tmp_path):
    r = run_cli(["study", "tiny", "--out", tmp_path / "s", "--methods", "es,nope"])
    assert r.exit_code == 2 and "--methods must be among" in r.output and not (tmp_path / "s").exists()
    r = run_cli(["study", "tiny", "--out", tmp_path / "s", "--ks", "1,64", "--samples", "32"])
    assert r.exit_code == 2 and "--ks must lie in" in r.output
    assert json.dumps(StudyConfig().to_dict())  # serialisable
