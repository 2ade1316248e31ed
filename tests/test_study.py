"""`deltalens study`: every claim gets checks and a verdict by the stated rule, the document validates, and a
killed study continues without redoing finished runs or measurements."""

from __future__ import annotations

import dataclasses
import json

import pytest
from deltalens.reports.common import check_label, fmt_g
from support import run_cli, tiny_spec

from deltalens.errors import DeltalensError
from deltalens.schema import validate
from deltalens.study import run as study_run
from deltalens.study.config import StudyConfig
from deltalens.training import methods

SMALL = {"methods": ("es", "grpo"), "seeds": (0, 1), "budget": 4096, "limit": 6, "samples": 4, "k": (1, 4),
         "base_seeds": 2, "sparsity": (0.9,), "sparsify_samples": 2, "diversity_members": 2, "diversity_prompts": 2,
         "entropy_prompts": 3, "resamples": 100}


def test_study_resumes_after_a_kill_and_redoes_nothing(tmp_path, monkeypatch):
    cfg = StudyConfig(model=tiny_spec(), **SMALL)
    out = tmp_path / "study"
    grpo = methods.get("grpo")
    calls = []

    def killed(*args, **kw):  # the study dies while training the first GRPO run
        calls.append(kw.get("resume"))
        raise KeyboardInterrupt

    monkeypatch.setitem(methods.REGISTRY, "grpo", dataclasses.replace(grpo, train=killed))
    with pytest.raises(KeyboardInterrupt):
        study_run.run_study(cfg, out, log=lambda s: None)
    es_final = out / "runs" / "es-s0" / "checkpoints" / "final" / "model.safetensors"
    mtime = es_final.stat().st_mtime_ns
    monkeypatch.setitem(methods.REGISTRY, "grpo", grpo)
    logs = []
    doc = study_run.run_study(cfg, out, log=logs.append)
    assert es_final.stat().st_mtime_ns == mtime  # finished runs are not retrained
    assert "es-s0: done" in logs and "es-s1: done" in logs
    validate(doc)
    # runs are named relative to the study directory: the report reads the same wherever the study moved
    assert [r["dir"] for r in doc["study"]["runs"]][:2] == ["runs/es-s0", "runs/es-s1"]
    # each run's config.json, so a merge of studies run apart can compare their hyperparameters
    assert [(r["config"]["method"], r["config"]["seed"]) for r in doc["study"]["runs"]][:3] == [
        ("es", 0), ("es", 1), ("grpo", 0)]
    assert {m["label"]: m["path"] for m in doc["models"]}["grpo-s1"] == "runs/grpo-s1"
    assert str(tmp_path) not in (out / "report.html").read_text()
    assert doc["diversity"]["es-s0"]["model"] == "runs/es-s0"
    assert doc["diversity"]["es-s0"]["centre"].startswith("runs/es-s0/checkpoints/")
    assert str(tmp_path) not in json.dumps(doc)  # analysis.json names no path of this machine
    claims = {c["id"]: c for c in doc["study"]["claims"]}
    # numbered as the paper numbers them; 6 and 7 need runs this study did not make; ours from 8
    assert {1, 2, 3, 4, 8, 9, 10} <= set(claims) and 5 not in claims
    assert {i: (claims[i]["verdict"], claims[i]["checks"], claims[i]["note"]) for i in (6, 7)} == {
        6: ("not run", [], "not run (use --population-sizes 4,8,16)"), 7: ("not run", [], "not run (use --two-point)")}
    assert [claims[i]["ours"] for i in (1, 8, 9, 10)] == [False, True, True, True]
    claims = {i: c for i, c in claims.items() if c["checks"]}
    for c in claims.values():
        assert c["verdict"] in ("reproduced", "contradicted", "mixed", "unclear") and c["checks"]
        for ch in c["checks"]:
            lo, hi = ch["ci_low"], ch["ci_high"]
            assert lo is None or lo <= ch["estimate"] + 1e-9 <= hi + 2e-9 or ch["metric"] == "gain retained"
    assert (out / "report.html").exists() and (out / "verdicts.csv").read_text().startswith("claim,check")
    md = (out / "verdicts.md").read_text()
    assert md.startswith(f"Study of `{tiny_spec()}` on `arith`") and "| model | Pass@1 |" in md
    assert "es:maj@4" in doc["study"]["effects"] and "es:maj@1" not in doc["study"]["effects"]  # Maj@1 = Pass@1
    assert sum(x.startswith("| **") for x in md.splitlines()) == len(doc["study"]["claims"])  # a bold row per claim
    assert "| not run (use --two-point) |" in md
    assert all(c["check"].replace("|", "\\|") in md for cl in claims.values() for c in cl["checks"])
    # claim 1's checks carry each training seed's effect; their mean is the estimate, and both tables show them
    ch = claims[1]["checks"][0]
    assert len(ch["per_seed"]) == 2 and sum(ch["per_seed"]) / 2 == pytest.approx(ch["estimate"])
    assert f"| {ch['check']} | {fmt_g(ch['estimate'])} | {fmt_g(ch['per_seed'][0])}, " in md
    assert "<th>Per training seed</th>" in (out / "report.html").read_text()
    # the problems-lost share row states ES's own count per run in both tables
    share = [c for c in claims[1]["checks"] if "lost_es" in c]
    assert share and all(f"es lost {', '.join(map(str, c['lost_es']))} problem" in check_label(c) for c in share)
    assert all(check_label(c) in md and check_label(c) in (out / "report.html").read_text() for c in share)
    _one_base(doc)
    _verdict_from_the_document(json.loads((out / "analysis.json").read_text()), cfg)
    # and every check and verdict, re-derived from analysis.json alone by `deltalens study verify`
    from deltalens.study.verify import verify

    res = verify(out)
    n = sum(len(c["checks"]) for c in doc["study"]["claims"])
    assert res["ok"] and res["checks"] == res["identical"] == n, res["differing"]
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
    assert r.exit_code == 2 and "--k must lie in" in r.output
    assert json.dumps(StudyConfig().to_dict())  # serialisable
    r = run_cli(["study", "tiny", "--out", tmp_path / "s", "--temperature", "1", "--temperatures", "0.6,1"])
    assert r.exit_code == 2 and "give --temperature or --temperatures, not both" in r.output
    r = run_cli(["study", "tiny", "--out", tmp_path / "s", "--k", "1,64", "--samples", "32"])
    assert r.exit_code == 2 and "--k must lie in" in r.output  # --ks is the old name of --k
    r = run_cli(["study", "tiny", "--out", tmp_path / "s", "--cpus-per-run", "2"])
    assert r.exit_code == 2 and "--ray" in r.output and not (tmp_path / "s").exists()  # only with --ray


def test_temperatures_and_the_verdict_temperature():
    assert StudyConfig().eval_temperatures == (0.6,) and StudyConfig().verdict_temperature == 0.6
    assert StudyConfig(temperature=1.0).eval_temperatures == (1.0,)
    assert StudyConfig(temperatures=(1.0, 0.6)).verdict_temperature == 0.6  # the paper's, when evaluated
    assert StudyConfig(temperatures=(1.0, 0.8)).verdict_temperature == 1.0  # else the first
    with pytest.raises(Exception, match="not both"):
        StudyConfig(temperature=0.6, temperatures=(0.6,))


def test_the_task_graph_declares_its_work():
    """Every run, evaluation (each temperature), sparsity and diversity pass is a task with its dependencies,
    resources and outputs; the extra runs of claims 6 and 7 appear only when asked for."""
    import pickle
    from pathlib import Path

    from deltalens.study.executor import check_graph
    from deltalens.study.plan import study_tasks

    cfg = StudyConfig(model="tiny", methods=("es", "grpo"), seeds=(0, 1), base_seeds=2, temperatures=(0.6, 1.0),
                      ray="auto", cpus_per_run=2, gpus_per_run=0.5)
    plan = study_run.run_plan(cfg, Path("s"))
    tasks = {t.key: t for t in check_graph(study_tasks(cfg, plan))}
    assert [k for k in tasks if k.startswith("train:")] == ["train:es-s0", "train:es-s1", "train:grpo-s0",
                                                            "train:grpo-s1"]
    assert {k for k in tasks if k.startswith("eval:base")} == {f"eval:base:s{s}:t{t}" for s in (0, 1)
                                                               for t in ("0.6", "1")}
    assert tasks["eval:grpo-s1:t1"].deps == ("train:grpo-s1",) and tasks["train:es-s0"].outputs == ("runs/es-s0",)
    assert tasks["sparsity:es-s0"].deps == ("train:es-s0",) and "diversity:es-s0" in tasks
    assert set(tasks["diff"].deps) == {f"train:{r['label']}" for r in plan}
    assert {(t.cpus, t.gpus) for t in tasks.values()} == {(2.0, 0.5)}
    pickle.dumps(list(tasks.values()))  # a Ray worker gets them by reference
    # a piece of a study whose first seeds ran elsewhere: no sparsity sweep, no population pass
    piece = StudyConfig(model="tiny", methods=("es", "grpo"), seeds=(1,), first_run_measures=False)
    keys = {t.key for t in study_tasks(piece, study_run.run_plan(piece, Path("s")))}
    assert not [k for k in keys if k.startswith(("sparsity:", "diversity:"))]
    assert {"train:es-s1", "eval:es-s1:t0.6", "entropy:es-s1", "diff"} <= keys
    more = StudyConfig(model="tiny", methods=("es",), seeds=(0,), population_sizes=(8, 4), two_point=True)
    runs = {r["label"]: r for r in study_run.run_plan(more, Path("s"))}
    assert list(runs) == ["es-s0", "es-n4-s0", "es-n8-s0", "es-n16-s0", "es-2pt-s0"]  # es-n16: claim 7's reference
    es, n4, two = (runs[k]["configs"]["es"] for k in ("es-s0", "es-n4-s0", "es-2pt-s0"))
    assert (n4.population, two.population, two.antithetic) == (4, 2, True)
    # FLOP-matched: every run spends (at most one iteration less than) the same units
    per = {k: r["configs"]["es"].prompts_per_iteration * 2 * r["configs"]["es"].population for k, r in runs.items()}
    units = {k: r["total"] * per[k] for k, r in runs.items()}
    budget = study_run.study_budget(more)
    assert all(0 <= budget - u < per[k] for k, u in units.items()), units  # floor(budget / units per iteration)
    assert es.population > n4.population



def _one_base(doc):
    """Issue #34 item 2: every base number in the summary, the Pass@K figure and the verdict table is the one
    base definition, study.base (the mean over the base's sampling seeds, per problem)."""
    from deltalens.reports.common import Context
    from deltalens.reports.figures import fig_passk
    from deltalens.reports.tables import base_pass_at_k

    base = doc["study"]["base"]
    assert base["sampling_seeds"] == 2 and set(base["pass_at_k"]) == {"1", "4"}
    ctx = Context(doc)
    summary, seeds = base_pass_at_k(ctx)
    fig = fig_passk(ctx)
    trace = next(t for t in fig.data if t.get("legendgroup") == "base" and t.get("mode", "").startswith("lines")
                 and "Maj" not in t["name"] and "interval" not in t["name"])
    for k, v in base["pass_at_k"].items():
        assert summary[k] == v and seeds == 2  # the summary table's base row
        assert trace["y"][trace["x"].index(int(k))] == pytest.approx(v, abs=1e-12)  # the figure's base line
        for meth in ("es", "grpo"):
            assert doc["study"]["effects"][f"{meth}:pass@{k}"]["base"] == v  # the summary's changes
    checks = [c for cl in doc["study"]["claims"] for c in cl["checks"] if "base_value" in c]
    assert checks and all(c["base_value"] == base["pass_at_k"][c["metric"][5:]] for c in checks)  # verdicts
    # and the seed-0 evaluation is not it (the two sampling seeds differ)
    assert doc["evals"]["base"]["pass_at_k"] != base["pass_at_k"] or base["sampling_seeds"] == 1


def _verdict_from_the_document(doc, cfg):
    """Issue #34 item 3: a verdict re-derived from analysis.json alone (study.data's per-problem counts)."""
    from deltalens.analysis import stats
    from deltalens.evaluation.passk import pass_at_k

    data = doc["study"]["data"]["evaluations"]["0.6"]
    assert len(data["base"]) == 2 and all(len(rows) == 6 for rows in data["base"])
    table = {lab: [[pass_at_k(r["n"], r["correct"], 4) for r in rows]] for lab, rows in data.items() if lab != "base"}
    grpo = [table["grpo-s0"][0], table["grpo-s1"][0]]
    base = [[pass_at_k(r["n"], r["correct"], 4) for r in rows] for rows in data["base"]]
    e = stats.paired_effect(grpo, base, span=1.0, resamples=cfg.resamples)
    ch = next(c for cl in doc["study"]["claims"] for c in cl["checks"] if c["check"] == "grpo vs base, Pass@4")
    assert ch["estimate"] == pytest.approx(e["estimate"], abs=1e-12) and ch["per_seed"] == pytest.approx(e["per_seed"])
    assert [ch["ci_low"], ch["ci_high"]] == pytest.approx(e["ci"], abs=1e-12)  # the same seeded bootstrap
    sp = doc["study"]["data"]["sparsity"]["es-s0"]
    full, b = sum(sp["full"]) / len(sp["full"]), sum(sp["base"]) / len(sp["base"])
    assert doc["sparsify"]["es-s0"]["full_pass_at_k"]["1"] == pytest.approx(full)
    assert doc["sparsify"]["es-s0"]["base_pass_at_k"]["1"] == pytest.approx(b)
    assert set(sp["points"][0]) >= {"threshold", "random", "shrink"}
    assert len(doc["study"]["data"]["entropy"]["base"]) == 3 and "grpo-s1" in doc["study"]["data"]["entropy"]


def test_an_old_study_with_ks_resumes_its_directory(tmp_path):
    """`ks` is the old name of `k`: an old study's YAML gives the same study, and its DIR/study.json (the pinned
    settings: none of them renamed) matches it, so the rerun is not refused as "a study with other settings"."""
    from deltalens.study.run import _check_study_file

    old = StudyConfig.resolve(yaml={"ks": [4, 1], "samples": 4})
    new = StudyConfig.resolve(yaml={"k": [1, 4], "samples": 4})
    assert old == new and old.k == (1, 4)
    out = tmp_path / "s"
    out.mkdir()
    (out / "study.json").write_text(json.dumps({"model": "tiny", "task": "arith", "budget": None, "preset": "auto",
                                                "chat_template": "auto"}))  # as an older study pinned them
    _check_study_file(old, out)
    _check_study_file(new, out)
    with pytest.raises(DeltalensError, match="give k or ks"):
        StudyConfig.resolve(yaml={"ks": [1], "k": [1]})
