"""`deltalens study --es-options name=value,...`: the study's ES settings over the preset (claim 6 across models
needs one reference N: SmolLM2's preset has N = 16, tiny's and the paper's 32). Every ES run of the plan takes
them (es, es-n<N> and es-2pt but their own N, ES->GRPO's ES stage), GRPO does not, the default budget follows
them, DIR/study.json pins them, and bad names or values are refused in one line before anything is written. The same
for `--grpo-options` (every GRPO run: grpo and ES->GRPO's GRPO stage), which `study merge` compares between the
pieces with GRPO runs only."""

from __future__ import annotations

import json
import re

import pytest
from support import run_cli

from deltalens.errors import DeltalensError
from deltalens.study.config import StudyConfig
from deltalens.study.run import _check_study_file
from deltalens.study.runs import preset_population, run_plan, study_budget, two_point_reference
from deltalens.training.es.config import ESConfig


def plan(tmp_path, **given):
    cfg = StudyConfig.resolve(given={"model": "smollm2", "task": "arith", "seeds": "0", **given})
    return cfg, {r["label"]: r for r in run_plan(cfg, tmp_path)}


def test_every_es_run_takes_them_and_grpo_does_not(tmp_path):
    base_cfg, base = plan(tmp_path, population_sizes="4", two_point=True)
    cfg, runs = plan(tmp_path, population_sizes="4", two_point=True, es_options="population=32,alpha=5e-4")
    smollm2 = ESConfig.preset("smollm2")
    assert smollm2.population == 16 and preset_population(base_cfg) == 16 and preset_population(cfg) == 32
    es = runs["es-s0"]["configs"]["es"]
    assert (es.population, es.alpha, es.sigma) == (32, 5e-4, smollm2.sigma)  # the rest stays the preset's
    assert base["es-s0"]["configs"]["es"].population == 16
    # the extra runs keep their own N, the other settings come from --es-options
    assert [(runs[k]["configs"]["es"].population, runs[k]["configs"]["es"].alpha) for k in ("es-n4-s0", "es-2pt-s0")] \
        == [(4, 5e-4), (2, 5e-4)]
    # claim 7's reference: es at N = 16 under the preset, an es-n16 group once N is 32
    assert two_point_reference(base_cfg) == "es" and two_point_reference(cfg) == "es-n16" and "es-n16-s0" in runs
    chain_es = runs["es-grpo-s0"]["configs"]["es"]
    assert (chain_es.population, chain_es.alpha) == (32, 5e-4)
    # the default budget is 20 iterations of the study's ES: N = 32 costs twice N = 16's, so GRPO gets twice
    # the steps; nothing else of GRPO's changes
    assert study_budget(cfg) == pytest.approx(2 * study_budget(base_cfg))
    grpo, grpo0 = runs["grpo-s0"]["configs"]["grpo"], base["grpo-s0"]["configs"]["grpo"]
    assert grpo.steps == 2 * grpo0.steps
    assert {k: v for k, v in grpo.to_dict().items() if k not in ("steps", "budget")} \
        == {k: v for k, v in grpo0.to_dict().items() if k not in ("steps", "budget")}
    assert es.iterations == 20


def test_study_runs_keep_only_their_latest_checkpoint_unless_asked(tmp_path):
    """The study reads each run's final weights only, so its runs prune older checkpoints (ES on qwen2.5-0.5b
    writes 2.4 GB every 10 iterations); --keep-checkpoints keeps them all."""
    for given, keep in (({}, False), ({"keep_checkpoints": True}, True)):
        _, runs = plan(tmp_path, population_sizes="4", **given)
        kept = {label: {m: c.keep_checkpoints for m, c in r["configs"].items()} for label, r in runs.items()}
        assert kept == {"es-s0": {"es": keep}, "grpo-s0": {"grpo": keep}, "es-grpo-s0": {"es": keep, "grpo": keep},
                        "es-n4-s0": {"es": keep}}


@pytest.mark.parametrize("field, spec, message", [
    ("es_options", "nope=1", "ES has no option --nope"),
    ("es_options", "seed=3", "the study sets --seed itself (use --seeds)"),
    ("es_options", "iterations=5", "the study sets --iterations itself (use --budget)"),
    ("es_options", "params=*norm*", "list-valued settings cannot be given here"),
    ("es_options", "population=lots", "population must be an integer"),
    ("es_options", "population", "must be name=value"),
    ("es_options", "sigma=1e-3,sigma=2e-3", "names sigma twice"),
    ("es_options", "keep_checkpoints=true", "the study sets --keep-checkpoints itself"),
    ("grpo_options", "nope=1", "--grpo-options nope: GRPO has no option --nope (see `deltalens train grpo --help`)"),
    ("grpo_options", "steps=5", "the study sets --steps itself (use --budget)"),
    ("grpo_options", "init_from=x", "the study sets --init-from itself"),
    ("grpo_options", "autocast=bf16,autocast=none", "--grpo-options names autocast twice"),
    ("grpo_options", "learning_rate=fast", "learning_rate must be a number"),
])
def test_bad_options_are_refused_in_one_line_before_work(tmp_path, field, spec, message):
    with pytest.raises(DeltalensError, match=re.escape(message)):
        StudyConfig.resolve(given={"model": "tiny", field: spec})
    r = run_cli(["study", "tiny", "--out", tmp_path / "s", f"--{field.replace('_', '-')}", spec])
    assert r.exit_code == 2 and message in r.output and not (tmp_path / "s").exists()


def test_a_value_es_refuses_is_refused_at_planning(tmp_path):
    cfg = StudyConfig.resolve(given={"model": "tiny", "es_options": "population=-4"})
    with pytest.raises(DeltalensError, match="population"):
        run_plan(cfg, tmp_path)


@pytest.mark.parametrize("field, spec, other, key", [
    ("es_options", "population=16", "population=8", "es_settings"),
    ("grpo_options", "autocast=bf16", "autocast=none", "grpo_settings"),
])
def test_they_are_pinned_and_an_older_study_without_them_still_matches(tmp_path, field, spec, other, key):
    out = tmp_path / "s"
    out.mkdir()
    (out / "study.json").write_text(json.dumps({"model": "tiny", "task": "arith", "budget": None, "preset": "auto",
                                                "chat_template": "auto"}))  # pinned before the options existed
    _check_study_file(StudyConfig.resolve(given={"model": "tiny"}), out)
    with pytest.raises(DeltalensError, match=f"other settings.*{key}"):
        _check_study_file(StudyConfig.resolve(given={"model": "tiny", field: spec}), out)
    (out / "study.json").unlink()
    _check_study_file(StudyConfig.resolve(given={"model": "tiny", field: spec}), out)
    _check_study_file(StudyConfig.resolve(given={"model": "tiny", field: spec}), out)
    for given in ({field: other}, {}):
        with pytest.raises(DeltalensError, match="other settings"):
            _check_study_file(StudyConfig.resolve(given={"model": "tiny", **given}), out)


def test_population_alpha_scaled_gives_the_extra_runs_alpha_times_n_over_the_reference_n(tmp_path):
    _, fixed = plan(tmp_path, population_sizes="4,8", two_point=True)
    _, runs = plan(tmp_path, population_sizes="4,8", two_point=True, population_alpha="scaled")
    alpha = ESConfig.preset("smollm2").alpha  # the smollm2 preset's N is 16: it is the reference N here
    assert {k: fixed[k]["configs"]["es"].alpha for k in ("es-s0", "es-n4-s0", "es-n8-s0", "es-2pt-s0")} \
        == dict.fromkeys(("es-s0", "es-n4-s0", "es-n8-s0", "es-2pt-s0"), alpha)
    got = {k: runs[k]["configs"]["es"].alpha for k in ("es-s0", "es-n4-s0", "es-n8-s0", "es-2pt-s0")}
    assert got == pytest.approx({"es-s0": alpha, "es-n4-s0": alpha / 4, "es-n8-s0": alpha / 2,
                                 "es-2pt-s0": alpha / 8})
    assert runs["es-grpo-s0"]["configs"]["es"].alpha == alpha  # only the extra runs change
    # every other setting, and the iterations the budget gives, are the fixed rule's
    for k in ("es-n4-s0", "es-2pt-s0"):
        a, b = runs[k]["configs"]["es"].to_dict(), fixed[k]["configs"]["es"].to_dict()
        assert {x for x in a if a[x] != b[x]} == {"alpha"} and runs[k]["total"] == fixed[k]["total"]
    # against --es-options' reference N = 32 and α: N = 16 (claim 7's es-n16) gets half of it
    _, runs32 = plan(tmp_path, two_point=True, population_alpha="scaled", es_options="population=32,alpha=4e-4")
    assert runs32["es-n16-s0"]["configs"]["es"].alpha == pytest.approx(2e-4)
    assert runs32["es-2pt-s0"]["configs"]["es"].alpha == pytest.approx(2.5e-5)


def test_population_alpha_is_refused_when_unknown_and_pinned_when_scaled(tmp_path):
    with pytest.raises(DeltalensError, match=r"^--population-alpha must be fixed or scaled \(got 'double'\)$"):
        StudyConfig.resolve(given={"model": "tiny", "population_alpha": "double"})
    fixed = StudyConfig.resolve(given={"model": "tiny", "population_sizes": "4"})
    scaled = StudyConfig.resolve(given={"model": "tiny", "population_sizes": "4", "population_alpha": "scaled"})
    _check_study_file(fixed, tmp_path)
    assert "population_alpha" not in json.loads((tmp_path / "study.json").read_text())  # older studies match
    with pytest.raises(DeltalensError, match=r"population_alpha: None vs 'scaled'"):
        _check_study_file(scaled, tmp_path)
    (tmp_path / "study.json").unlink()
    _check_study_file(scaled, tmp_path)
    _check_study_file(scaled, tmp_path)  # the same settings again: accepted
    with pytest.raises(DeltalensError, match=r"population_alpha: 'scaled' vs None"):
        _check_study_file(fixed, tmp_path)


def test_grpo_options_reach_every_grpo_run_and_no_es_run(tmp_path):
    """--grpo-options (e.g. the loss pass under bf16 autocast) set the grpo runs and ES->GRPO's GRPO stage over
    the preset; ES runs, the budget and every other GRPO setting stay as they were."""
    _, base = plan(tmp_path, population_sizes="4")
    cfg, runs = plan(tmp_path, population_sizes="4", grpo_options="autocast=bf16,learning_rate=2e-6")
    for label, stage in (("grpo-s0", "grpo"), ("es-grpo-s0", "grpo")):
        got, was = runs[label]["configs"][stage].to_dict(), base[label]["configs"][stage].to_dict()
        assert (got["autocast"], got["learning_rate"]) == ("bf16", 2e-6)
        assert {k for k in got if got[k] != was[k]} == {"autocast", "learning_rate"}
    for label in ("es-s0", "es-n4-s0"):
        assert runs[label]["configs"]["es"].to_dict() == base[label]["configs"]["es"].to_dict()
    assert runs["es-grpo-s0"]["configs"]["es"].to_dict() == base["es-grpo-s0"]["configs"]["es"].to_dict()
    assert study_budget(cfg) == study_budget(plan(tmp_path)[0])
    assert [r["total"] for r in runs.values()] == [r["total"] for r in base.values()]


def test_merge_compares_grpo_options_between_pieces_with_grpo_runs_only():
    from deltalens.study.merge import merged_config

    def cfg(methods, **given):
        return StudyConfig.resolve(given={"model": "tiny", "methods": methods, **given})

    es_piece, grpo_piece = cfg("es"), cfg("grpo", grpo_options="autocast=bf16")
    merged = merged_config([es_piece, grpo_piece], ["a", "b"], 3)
    assert merged.grpo_settings == {"autocast": "bf16"}  # taken from the piece that trains GRPO runs
    with pytest.raises(DeltalensError, match=r"^b is a study with other settings than a \(grpo_options: "):
        merged_config([cfg("grpo,es-grpo"), grpo_piece], ["a", "b"], 3)
    assert merged_config([grpo_piece, cfg("es-grpo", grpo_options="autocast=bf16")], ["a", "b"], 3).grpo_settings \
        == {"autocast": "bf16"}
