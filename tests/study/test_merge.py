"""`deltalens study merge`: a study assembled from pieces run apart. The known answer: the published tiny
claims-6/7 study (docs/, 3 seeds) cut into its seed-0 piece and its seeds-1-2 piece (as two sittings would have
written them) merges back into exactly the published checks and verdicts."""

from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path

from support import run_cli

from deltalens.study.verify import compare, verify

PUBLISHED = Path(__file__).resolve().parents[2] / "docs" / "tiny-claims67-scaled-2026-12-06"


def _published(name: str = PUBLISHED.name) -> dict:
    with gzip.open(PUBLISHED.parent / name / "analysis.json.gz") as f:
        return json.loads(f.read())


def piece(doc: dict, seeds: list[int] | None = None, groups: set[str] | None = None) -> dict:
    """What a study of these seeds (or run groups) alone would have written: its runs, the base, and each
    section's entries of its runs (its sparsity and population pass: of its own first runs, when it has them)."""
    d = copy.deepcopy(doc)
    st = d["study"]
    st["runs"] = [r for r in st["runs"] if (seeds is None or r["seed"] in seeds)
                  and (groups is None or r["group"] in groups)]
    labels = {r["label"] for r in st["runs"]}
    if seeds is not None:
        st["config"]["seeds"] = list(seeds)
    if groups is not None:
        st["config"]["methods"] = [m for m in st["config"]["methods"] if m in groups]
        if "es" not in groups:  # a study without es runs has no claim-6/7 runs either
            st["config"]["population_sizes"], st["config"]["two_point"] = [], False
    for t, ev in st["data"]["evaluations"].items():
        st["data"]["evaluations"][t] = {k: v for k, v in ev.items() if k == "base" or k in labels}
    st["data"]["entropy"] = {k: v for k, v in st["data"]["entropy"].items() if k == "base" or k in labels}
    st["data"]["sparsity"] = {k: v for k, v in st["data"]["sparsity"].items() if k in labels}
    for sec in ("diff", "evals", "training", "diversity", "sparsify"):
        d[sec] = {k: v for k, v in d[sec].items() if k == "base" or k in labels}
    d["models"] = [m for m in d["models"] if m["label"] in labels]
    st["flops"]["runs"] = {k: v for k, v in st["flops"]["runs"].items() if k in labels}
    return d


def _write(path: Path, doc: dict) -> Path:
    path.mkdir(parents=True)
    (path / "analysis.json").write_text(json.dumps(doc))
    return path


def test_two_sittings_merge_into_the_published_study(tmp_path):
    doc = _published()
    a, b = _write(tmp_path / "a", piece(doc, [0])), _write(tmp_path / "b", piece(doc, [1, 2]))
    r = run_cli(["study", "merge", str(a), str(b), "--out", str(tmp_path / "m")])
    assert r.exit_code == 0, r.output
    merged = json.loads((tmp_path / "m" / "analysis.json").read_text())
    derived = [c for cl in merged["study"]["claims"] for c in cl["checks"]]
    rows = compare([c for cl in doc["study"]["claims"] for c in cl["checks"]], derived)
    assert len(rows) == 17 and all(r["status"] == "identical" for r in rows), [r for r in rows if r["fields"]]
    assert [cl["verdict"] for cl in merged["study"]["claims"]] == [cl["verdict"] for cl in doc["study"]["claims"]]
    assert merged["study"]["config"]["seeds"] == [0, 1, 2]
    assert [r["label"] for r in merged["study"]["runs"]] == [r["label"] for r in doc["study"]["runs"]]
    # both sittings evaluated the same base (same machine, same sampling seeds): counted once
    assert merged["study"]["base"]["sampling_seeds"] == 3 and merged["study"]["base"] == doc["study"]["base"]
    assert [p["base"] for p in merged["study"]["merged"]["pieces"]] == [
        "pooled", "equal to an earlier piece's: counted once"]
    assert merged["study"]["flops"]["groups"] == doc["study"]["flops"]["groups"]
    for name in ("report.html", "verdicts.csv", "verdicts.md"):
        assert (tmp_path / "m" / name).is_file()
    # the published study predates recorded run configs: said, not silently passed
    assert any("hyperparameters not recorded" in n for n in merged["study"]["merged"]["notes"])
    assert verify(tmp_path / "m")["ok"]


def _with_configs(doc: dict, change: dict | None = None) -> dict:
    """Each run's config.json as a study records it since 2026-12-06 (a chain-like nested stage included)."""
    for r in doc["study"]["runs"]:
        r["config"] = {"method": "es", "alpha": 1e-3, "population": 32, "seed": r["seed"], "eval_every": 10,
                       "deltalens_version": "0.1.0", "gradient_checkpointing": False,
                       "keep_optimizer_states": False,
                       "stages": [{"dir": f"runs/{r['label']}/es", "config": {"seed": r["seed"], "sigma": 1e-3,
                                                                               "model": f"runs/{r['label']}"}}]}
        if change and r["seed"] > 0:
            r["config"].update(change)
    return doc


def test_runs_trained_at_other_settings_are_refused(tmp_path):
    doc = _published()
    a = _write(tmp_path / "a", _with_configs(piece(doc, [0])))
    # seeds, logging, versions and the stages' own paths differ between sittings: the same setting
    b = _with_configs(piece(doc, [1, 2]), {"eval_every": 0, "deltalens_version": "0.2.0",
                                           "gradient_checkpointing": True, "keep_optimizer_states": True})
    r = run_cli(["study", "merge", str(a), str(_write(tmp_path / "b", b)), "--out", str(tmp_path / "m")])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "m" / "analysis.json").read_text())["study"]["merged"]["notes"] == []
    # a preset that changed between sittings
    c = _with_configs(piece(doc, [1, 2]), {"alpha": 2e-3})
    r = run_cli(["study", "merge", str(a), str(_write(tmp_path / "c", c)), "--out", str(tmp_path / "m2")])
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and "trained with other settings than es-s0 (alpha: 0.002 vs 0.001" \
        in " ".join(r.output.split()), r.output
    assert not (tmp_path / "m2").exists()


def test_a_first_piece_without_configs_hides_no_difference_between_later_ones(tmp_path):
    """Three sittings: the first published before configs were recorded, the second by a version without a
    field (another deltalens version), the third with it. The later two are compared with each other: a field
    recorded in one only is named in a note, a changed setting refused."""
    doc = _published()
    a = _write(tmp_path / "a", piece(doc, [0]))
    b = _write(tmp_path / "b", _with_configs(piece(doc, [1])))
    c = _with_configs(piece(doc, [2]), {"shared_prefix": True})
    r = run_cli(["study", "merge", str(a), str(b), str(_write(tmp_path / "c", c)), "--out", str(tmp_path / "m")])
    assert r.exit_code == 0, r.output
    notes = json.loads((tmp_path / "m" / "analysis.json").read_text())["study"]["merged"]["notes"]
    assert any("es-s0 vs es-s1: hyperparameters not recorded" in n for n in notes), notes
    assert any("es-s2 vs es-s1: fields recorded in one config only" in n and n.endswith("shared_prefix")
               for n in notes), notes
    d = _with_configs(piece(doc, [2]), {"alpha": 2e-3})
    r = run_cli(["study", "merge", str(a), str(b), str(_write(tmp_path / "d", d)), "--out", str(tmp_path / "m2")])
    assert r.exit_code == 2 and "es-s2" in r.output and "(alpha: 0.002 vs 0.001" in " ".join(r.output.split()), r.output
    # the reference lacks a field that two later pieces record differently: compared between them, refused
    a = _write(tmp_path / "a2", _with_configs(piece(doc, [0])))
    b = _write(tmp_path / "b2", _with_configs(piece(doc, [1]), {"shared_prefix": True}))
    c = _write(tmp_path / "c2", _with_configs(piece(doc, [2]), {"shared_prefix": False}))
    r = run_cli(["study", "merge", str(a), str(b), str(c), "--out", str(tmp_path / "m3")])
    assert r.exit_code == 2 and "es-s2" in r.output and "than es-s1 (shared_prefix: False vs True" \
        in " ".join(r.output.split()), r.output
    assert not (tmp_path / "m3").exists()
    # inside a chain's stages alike: a field one stage config lacks is a note, a changed one a refusal
    for name, change, ok in (("e", {"shared_prefix": True}, True), ("f", {"sigma": 2e-3}, False)):
        e = _with_configs(piece(doc, [2]))
        for run in e["study"]["runs"]:
            run["config"]["stages"][0]["config"].update(change)
        r = run_cli(["study", "merge", str(tmp_path / "a2"), str(b), str(_write(tmp_path / name, e)),
                     "--out", str(tmp_path / f"m-{name}")])
        if ok:
            notes = json.loads((tmp_path / "m-e" / "analysis.json").read_text())["study"]["merged"]["notes"]
            assert any(n.startswith("es-s2 vs es-s0: fields recorded in one config only")
                       and "stages.0.config.shared_prefix" in n for n in notes), notes
        else:
            assert r.exit_code == 2 and "(stages.0.config.sigma: 0.002 vs 0.001" in " ".join(r.output.split()), r.output


def test_a_study_merged_from_its_methods_run_apart(tmp_path):
    """The published 3-seed tiny study (claims 1-10, 48 checks) as two sittings by method: the ES runs (with
    claims 6/7's extra runs) and the GRPO and ES->GRPO runs; its checks and verdicts come back exactly."""
    doc = _published("tiny-study-2026-12-03")
    es = {r["group"] for r in doc["study"]["runs"] if r["method"] == "es" and r["group"] != "es-grpo"}
    a = _write(tmp_path / "es", piece(doc, groups=es))
    b = _write(tmp_path / "grpo", piece(doc, groups={"grpo", "es-grpo"}))
    r = run_cli(["study", "merge", str(a), str(b), "--out", str(tmp_path / "m")])
    assert r.exit_code == 0, r.output
    merged = json.loads((tmp_path / "m" / "analysis.json").read_text())
    rows = compare([c for cl in doc["study"]["claims"] for c in cl["checks"]],
                   [c for cl in merged["study"]["claims"] for c in cl["checks"]])
    assert len(rows) == 48 and all(r["status"] == "identical" for r in rows), [r for r in rows if r["fields"]]
    assert [cl["verdict"] for cl in merged["study"]["claims"]] == [cl["verdict"] for cl in doc["study"]["claims"]]
    # the ES-only settings come from the ES piece; the GRPO piece could not have them
    assert merged["study"]["config"]["population_sizes"] == [4, 8, 16] and merged["study"]["config"]["two_point"]


def test_a_piece_without_first_run_measures(tmp_path):
    """A piece run with --no-first-run-measures: its own verdicts say claims 3, 9 and 10 were not measured there;
    merged with the piece that has them, they are back; merged without it, refused in one line."""
    from deltalens.study.claims import FIRST_RUN_NOT_RUN, claims_of

    table = {c["id"]: c for c in claims_of([], ran=set(), not_run=FIRST_RUN_NOT_RUN)}
    assert {c: table[c]["verdict"] for c in (3, 9, 10)} == {3: "not run", 9: "not run", 10: "not run"}
    assert "--no-first-run-measures" in table[3]["note"] and table[9]["ours"] and not table[3]["ours"]
    doc = _published()
    a, b = piece(doc, [0]), piece(doc, [1, 2])
    b["study"]["config"]["first_run_measures"] = False  # as such a piece writes it: no sparsity, no population
    assert b["study"]["data"]["sparsity"] == {} and b["diversity"] == {}
    r = run_cli(["study", "merge", str(_write(tmp_path / "a", a)), str(_write(tmp_path / "b", b)), "--out",
                 str(tmp_path / "m")])
    assert r.exit_code == 0, r.output
    merged = json.loads((tmp_path / "m" / "analysis.json").read_text())
    assert {3, 9, 10} <= {cl["id"] for cl in merged["study"]["claims"] if cl["checks"]}
    a["study"]["config"]["first_run_measures"], a["study"]["data"]["sparsity"], a["diversity"] = False, {}, {}
    r = run_cli(["study", "merge", str(_write(tmp_path / "a2", a)), str(tmp_path / "b"), "--out", str(tmp_path / "m2")])
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and "no sparsity sweep of es-s0" in " ".join(r.output.split())


def test_a_base_evaluated_elsewhere_is_pooled(tmp_path):
    doc = _published()
    b = piece(doc, [1, 2])
    for t in b["study"]["data"]["evaluations"].values():  # another machine's kernels: other samples
        for ev in t["base"]:
            row = next(r for r in ev if 0 < r["correct"] < r["n"])
            row["correct"] -= 1
    a, b = _write(tmp_path / "a", piece(doc, [0])), _write(tmp_path / "b", b)
    r = run_cli(["study", "merge", str(a), str(b), "--out", str(tmp_path / "m")])
    assert r.exit_code == 0, r.output
    merged = json.loads((tmp_path / "m" / "analysis.json").read_text())
    assert merged["study"]["base"]["sampling_seeds"] == 6 and merged["study"]["config"]["base_seeds"] == 6
    assert [p["base"] for p in merged["study"]["merged"]["pieces"]] == ["pooled", "pooled"]
    assert len(merged["study"]["data"]["evaluations"]["0.6"]["base"]) == 6
    assert verify(tmp_path / "m")["ok"]
    # a piece whose base is partly an earlier piece's (its seed 0 equal, its seed 1 another machine's): refused
    mixed = piece(doc, [1, 2])
    for t in mixed["study"]["data"]["evaluations"].values():
        other = copy.deepcopy(t["base"][1])
        row = next(r for r in other if 0 < r["correct"] < r["n"])
        row["correct"] -= 1
        t["base"] = [t["base"][0], other]
    mixed["study"]["config"]["base_seeds"] = 2
    r = run_cli(["study", "merge", str(a), str(_write(tmp_path / "mixed", mixed)), "--out", str(tmp_path / "m3")])
    assert r.exit_code == 2 and "some of its base evaluations equal an earlier piece's" in " ".join(r.output.split())


def test_pieces_that_cannot_merge_are_refused_in_one_line(tmp_path):
    doc = _published()
    a = _write(tmp_path / "a", piece(doc, [0]))
    a2 = _write(tmp_path / "a2", piece(doc, [0]))
    other = piece(doc, [1, 2])
    other["study"]["config"]["limit"] = 200
    o = _write(tmp_path / "o", other)
    bad = piece(doc, [1, 2])
    bad["study"]["config"]["samples"] = 16  # K = 32 cannot be computed from 16 samples: the file is named
    bad = _write(tmp_path / "bad", bad)
    before = sorted(p.name for p in tmp_path.iterdir())
    for args, message in (([a, a2], "es-s0 is in both"), ([a, o], "other settings"), ([a], "at least two"),
                          ([a, a], "given twice"), ([a, bad], f"{bad / 'analysis.json'}: study.config: --k must")):
        r = run_cli(["study", "merge", *map(str, args), "--out", str(tmp_path / "m")])
        lines = [ln for ln in r.output.splitlines() if ln.strip()]
        assert r.exit_code == 2 and len(lines) == 1 and message in lines[0], r.output
    assert "limit: 200 vs 300" in run_cli(["study", "merge", str(a), str(o), "--out", str(tmp_path / "m")]).output
    # into an input's own directory: the output guard, before anything is read or written
    r = run_cli(["study", "merge", str(a), str(_write(tmp_path / "b", piece(doc, [1, 2]))), "--out", str(a)])
    assert r.exit_code == 2 and "error:" in r.output
    assert json.loads((a / "analysis.json").read_text()) == piece(doc, [0])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*before, "b"])
