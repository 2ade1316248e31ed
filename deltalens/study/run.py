"""`deltalens study`: the paper's question on one model and task, with statistics that carry a verdict.

    deltalens study smollm2 --methods es,grpo,es-grpo --seeds 0,1,2 --budget 2e6 --out studies/smollm2

`run_study` is four steps, each in its own module:

    plan       the runs (`deltalens.study.runs`: every method x seed at one FLOP-matched budget, plus the
               runs claims 6 and 7 need when asked) and the task graph (`deltalens.study.plan`): each
               training run, evaluation (the base at several sampling seeds, every run, at each
               temperature), the weight diff, each sparsity sweep (`deltalens.study.sparsity`), entropy
               and the population pass (`deltalens.study.diversity`) a `Task` with its dependencies,
               declared resources and outputs
    execute    an executor runs the graph (`deltalens.study.executor`): in this process by default, on Ray
               with --ray (`deltalens.study.ray_executor`); every task is resumable (a rerun skips finished
               runs, resumes killed ones, and finds every measurement in DIR/cache)
    analyse    every claim of arXiv 2608.27351 as directional checks with intervals (`deltalens.study.checks`,
               numbered as the paper numbers them, ours from 8: `deltalens.study.claims`), Holm-adjusted over
               all the study's checks, each bootstrap bound with its Monte Carlo SE
               (`deltalens.analysis.multiplicity`); one base for every table, figure and verdict: the mean
               over the base's sampling seeds, per problem (`study.base`)
    write      DIR/analysis.json (valid against the schema, with the verdict table and every per-problem
               result the verdicts use under `study`), DIR/report.html, DIR/verdicts.csv, DIR/verdicts.md

DIR/study.json pins the settings the runs depend on (a rerun may add seeds or methods, not change them).
Everything a study can be refused for is checked before DIR is created or that file written
(`validate_study`), so a refused study never blocks its own corrected retry.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from deltalens.analysis import stats
from deltalens.analysis.document import analysis_document, model_entry
from deltalens.analysis.report import training_section, weights_hash  # noqa: F401  (weights_hash: callers use it)
from deltalens.errors import DeltalensError
from deltalens.io.atomic import atomic_path, pin_json, write_json_atomic
from deltalens.io.outputs import Output, check_outputs
from deltalens.io.runs import RunDir
from deltalens.study import measures
from deltalens.study.checks import (  # noqa: F401  (re-exported: `from deltalens.study.run import ...`)
    EMBED_HEAD,
    NORM_ATTN,
    adjust,
    claim_verdict,
    distance_checks,
    effects_summary,
    entropy_checks,
    evaluation_checks,
    pair_checks,
    two_point_pairs,
)
from deltalens.study.claims import CLAIMS, FIRST_RUN_NOT_RUN, SEED_SPREAD, claims_of, temperature_text  # noqa: F401
from deltalens.study.cluster import executor_for
from deltalens.study.config import StudyConfig
from deltalens.study.diversity import JS_ESTIMATOR, diversity_checks
from deltalens.study.executor import Executor, cost_summary
from deltalens.study.flops import study_flops
from deltalens.study.measures import Measures, per_problem, read_result, uses_vllm  # noqa: F401
from deltalens.study.plan import study_tasks, t_key
from deltalens.study.runs import TWO_POINT, by_group, preset_of, run_plan, shown, study_budget
from deltalens.study.sparsity import sparsity_analysis
from deltalens.tasks import get_task
from deltalens.training.launch import check_start
from deltalens.training.run import make_task
from deltalens.training.tracking import require

Log = Callable[[str], None]
BASE_DEFINITION = ("the mean over the base's sampling seeds, per problem (Pass@K and Maj@K of each seed's "
                   "evaluation averaged): every table, figure and verdict compares with it")


def run_graph(tasks, out: Path, executor: Executor, log: Log) -> dict:
    """Run the study's task graph: training first, then everything that reads the runs."""
    return executor.run(tasks, out, log)


train_runs = run_graph  # the name callers and tests stop a study at: past every up-front check, before any work


def run_study(cfg: StudyConfig, out: str | Path, *, log: Log = print, progress_factory=None,
              executor: Executor | None = None) -> dict:
    """Plan, execute, analyse, write DIR/analysis.json, DIR/report.html, DIR/verdicts.csv and .md."""
    out = Path(out)
    check_outputs([Output(out, "--out", directory=True)], models=[cfg.model])
    if (out / "study.json").exists():
        _check_study_file(cfg, out)  # another study's DIR is refused first (read only: the file exists)
    plan = validate_study(cfg, out)
    executor = executor or executor_for(cfg, progress_factory, log)
    out.mkdir(parents=True, exist_ok=True)
    _check_study_file(cfg, out)
    t0 = time.time()
    try:
        results = train_runs(study_tasks(cfg, plan), out, executor, log)
        summary = cost_summary(getattr(executor, "costs", ()))
        if summary:
            log(summary)
        doc, checks = analyse(cfg, out, plan, results, seconds=lambda: round(time.time() - t0, 1))
    finally:
        measures.close_all()  # a vLLM engine is a subprocess: never left running
    write_study(doc, checks, out)
    return doc


def _rows(ev: dict) -> list[dict]:
    """The per-problem results a verdict uses: samples, correct samples, Maj@k."""
    return [{"n": r["n"], "correct": r["correct"], "maj_at_k": r["maj_at_k"]} for r in ev["per_problem"]]


def study_base(cfg: StudyConfig, base_evals: list[dict], effects: dict) -> dict:
    """`study.base`: the one base of every table, figure and verdict (BASE_DEFINITION). Pass@K/Maj@K at the
    requested K are the verdicts' own base values (`effects`); the curve is the seeds' curves averaged."""
    return base_section(cfg, mean_curve([(ev["curve"], 1) for ev in base_evals]), len(base_evals), effects)


def mean_curve(curves: list[tuple[dict, int]]) -> dict:
    """The weighted mean of Pass@k/Maj@k curves ({"k", "pass", "maj"}, all at the same k), weights >= 1."""
    ks, total = curves[0][0]["k"], sum(w for _, w in curves)
    return {"k": ks, **{m: [sum(c[m][i] * w for c, w in curves) / total for i in range(len(ks))]
                        for m in ("pass", "maj")}}


def base_section(cfg: StudyConfig, curve: dict, sampling_seeds: int, effects: dict) -> dict:
    """`study.base` from the base's mean curve, its number of sampling seeds and the verdicts' effects."""
    first = next(iter({g for g, _, _ in effects}), None)
    pk = {str(k): effects[(first, "pass", k)]["base"] for k in cfg.k} if first else {}
    mk = {str(k): effects[(first, "maj", k)]["base"] for k in cfg.k if k > 1} if first else {}
    if "1" in pk:
        mk["1"] = pk["1"]  # Maj@1 = Pass@1
    return {"definition": BASE_DEFINITION, "sampling_seeds": sampling_seeds, "temperature": cfg.verdict_temperature,
            "pass_at_k": pk, "maj_at_k": mk, "curve": curve}


def study_claims(cfg: StudyConfig, checks: list[dict]) -> list[dict]:
    """The verdict table (`claims_of`): claims 6 and 7 "not run" without their runs, and 3, 9 and 10 in a piece
    run with --no-first-run-measures."""
    return claims_of(checks, ran={c["claim"] for c in checks},
                     not_run=None if cfg.first_run_measures else FIRST_RUN_NOT_RUN)


def study_section(cfg: StudyConfig, checks: list[dict], effects_at: dict, base: dict, runs: list[dict], data: dict,
                  flops: dict, seconds) -> dict:
    """analysis.json's `study`: settings (as resolved), rule, claims (verdict table), effects, the one base,
    the runs, the per-problem data the checks use, FLOP accounting and the time taken."""
    vt, temps = cfg.verdict_temperature, cfg.eval_temperatures
    study = {"config": {**cfg.to_dict(), "budget": study_budget(cfg), "preset": preset_of(cfg),
                        "temperature": vt, "temperatures": list(temps)},
             "rule": f"{stats.rule_text(cfg.noninferiority_margin)} {SEED_SPREAD} {temperature_text(temps, vt)}",
             "claims": study_claims(cfg, checks),
             "effects": effects_summary(effects_at[vt]),
             "base": base, "js_estimator": JS_ESTIMATOR, "runs": runs, "data": data, "flops": flops,
             "seconds": seconds}
    if len(temps) > 1:
        study["effects_at"] = {t_key(t): effects_summary(e) for t, e in effects_at.items()}
    return study


def study_checks(cfg: StudyConfig, groups: dict[str, list[dict]], inputs: dict,
                 task_spec: str | None = None) -> tuple[list[dict], dict, dict]:
    """Every check of the study, Holm-adjusted, from its inputs alone (nothing read here: `analyse` gathers
    them from the study directory, `deltalens.study.verify` from a published analysis.json, so both derive
    the verdicts with this one function). `inputs`:

        evaluations  {t_key(T): {"base": [eval per sampling seed], label: eval}}, each eval at least
                     {"per_problem": [{"n", "correct", "maj_at_k"}]}
        pairs        {label: [(R+, R-) per iteration]} of the two-point runs (claim 7's correlation)
        diff         the weight diff per run (claims 2 and 4; read when es and grpo both ran)
        sparsity     {label: the sparsity task's result} of each method's first run (claim 3)
        entropy      {"base": [...], label: [...]} per prompt (claim 8)
        diversity    {label: the population pass} of the first es run (claims 9 and 10)

    Returns (checks, effects per temperature, the report's sparsify section per run)."""
    R = cfg.resamples
    vt, temps = cfg.verdict_temperature, cfg.eval_temperatures
    several = len(temps) > 1
    checks: list[dict] = []
    effects_at = {}
    for t in sorted(temps, key=lambda x: x != vt):  # the verdict temperature first
        evals = inputs["evaluations"][t_key(t)]
        evs = {g: [evals[r["label"]] for r in rs] for g, rs in groups.items()}
        new, eff = evaluation_checks(cfg, evals["base"], evs, R, at=f" at T={t:g}" if several else "",
                                     primary=t == vt)
        if several:
            for c in new:
                c.update(temperature=t, in_verdict=t == vt)
        checks += new
        effects_at[t] = eff
    if TWO_POINT in groups:  # claim 7's paired-reward correlation, from the two-point runs' metrics rows
        checks += pair_checks({r["label"]: inputs["pairs"][r["label"]] for r in groups[TWO_POINT]}, R)
    if "es" in groups and "grpo" in groups:
        checks += distance_checks(cfg, inputs["diff"], R)

    sparsify_section = {}
    for meth in ("es", "grpo"):  # absent: a piece run with --no-first-run-measures
        if meth in groups and groups[meth][0]["label"] in inputs["sparsity"]:
            label = groups[meth][0]["label"]
            a = sparsity_analysis(cfg, inputs["sparsity"][label], meth,
                                  task_spec if task_spec is not None else get_task(cfg.task).spec, R)
            sparsify_section[label] = a["section"]
            checks += a["checks"]

    ent = {meth: [inputs["entropy"][r["label"]] for r in groups[meth]] for meth in ("es", "grpo") if meth in groups}
    checks += entropy_checks(inputs["entropy"]["base"], ent, R)
    if "es" in groups and groups["es"][0]["label"] in inputs["diversity"]:
        checks += diversity_checks(inputs["diversity"][groups["es"][0]["label"]], R)
    adjust(checks)  # Holm over every check of the study: the verdicts are the adjusted ones
    return checks, effects_at, sparsify_section


def analyse(cfg: StudyConfig, out: Path, plan: list[dict], results: dict, seconds=lambda: None) -> tuple[dict, list]:
    """The analysis document and the study's checks (Holm-adjusted) from the graph's results (module
    docstring); `seconds()`: the time the study took, recorded last."""
    groups = by_group(plan)
    vt, temps = cfg.verdict_temperature, cfg.eval_temperatures
    base_evals, run_evals = {}, {}
    for t in temps:
        base_evals[t] = [read_result(out, results[f"eval:base:s{s}:t{t_key(t)}"]) for s in range(cfg.base_seeds)]
        run_evals[t] = {r["label"]: read_result(out, results[f"eval:{r['label']}:t{t_key(t)}"]) for r in plan}
    diff_doc = read_result(out, results["diff"])
    diffs = diff_doc["diff"]
    first = {meth: groups[meth][0]["label"] for meth in ("es", "grpo") if meth in groups and cfg.first_run_measures}
    entropy = {"base": results["entropy:base"]["entropy"],
               **{r["label"]: results[f"entropy:{r['label']}"]["entropy"]
                  for m in ("es", "grpo") if m in groups for r in groups[m]}}
    inputs = {"evaluations": {t_key(t): {"base": base_evals[t], **run_evals[t]} for t in temps},
              "pairs": {r["label"]: two_point_pairs(r["label"], r["dir"]) for r in groups.get(TWO_POINT, [])},
              "diff": diffs,
              "sparsity": {label: results[f"sparsity:{label}"] for label in first.values()},
              "entropy": entropy,
              "diversity": {first["es"]: results[f"diversity:{first['es']}"]} if "es" in first else {}}
    checks, effects_at, sparsify_section = study_checks(cfg, groups, inputs, get_task(cfg.task).spec)
    effects = effects_at[vt]

    held_out = {}
    for name in cfg.held_out:
        for label in ["base", *(r["label"] for r in plan)]:
            held_out.setdefault(label, {})[name] = read_result(out, results[f"heldout:{name}:{label}"])["pass_at_k"]

    data = {"base_definition": BASE_DEFINITION, "temperature": vt,
            "evaluations": {t_key(t): {"base": [_rows(ev) for ev in base_evals[t]],
                                       **{lab: _rows(ev) for lab, ev in run_evals[t].items()}} for t in temps},
            "sparsity": inputs["sparsity"], "entropy": entropy}
    runs = [{"label": r["label"], "group": r["group"], "method": r["method"], "seed": r["seed"],
             "dir": shown(r["dir"], out), "total": r["total"], "config": RunDir(r["dir"]).config()} for r in plan]
    study = study_section(cfg, checks, effects_at, study_base(cfg, base_evals[vt], effects), runs, data,
                          study_flops(plan), seconds())
    evals = {"base": base_evals[vt][0], **run_evals[vt]}
    training = {r["label"]: training_section(r["label"], r["dir"]) for r in plan}
    doc = analysis_document(cfg.model, [model_entry(r["label"], str(r["dir"]), shown(r["dir"], out)) for r in plan],
                            diff=diffs, ratios=diff_doc["ratios"], evals=evals,
                            sparsify=sparsify_section or None, diversity=inputs["diversity"] or None,
                            training={k: v for k, v in training.items() if v}, held_out=held_out or None,
                            study=study)
    return {k: v for k, v in doc.items() if v is not None}, checks


def write_study(doc: dict, checks: list[dict], out: Path) -> None:
    """DIR/analysis.json, verdicts.csv, verdicts.md and report.html (each written atomically)."""
    from deltalens.reports import render_report
    from deltalens.reports.markdown import study_markdown

    write_json_atomic(doc, out / "analysis.json")
    with atomic_path(out / "verdicts.csv") as tmp:
        stats.table(checks).to_csv(tmp, index=False)
    with atomic_path(out / "verdicts.md") as tmp:
        tmp.write_text(study_markdown(doc))
    render_report(doc, out / "report.html")


def validate_study(cfg: StudyConfig, out: Path) -> list[dict]:
    """Refuse everything a study can be refused for before DIR is created or written (issue #36): DIR/study.json
    pins the settings a retry must repeat, so pinning a refused study would make its own corrected retry
    "a study with other settings". Checks the task (and held-out tasks) with their data, the preset and
    budget of every run (`run_plan`), the model (loaded once: a missing, corrupt or incomplete checkpoint is
    refused by `load_model`) and its chat template setting, and with --backend vllm that vLLM is there.
    Returns the run plan."""
    require(cfg.report_to)  # a missing tracker package
    plan = run_plan(cfg, out)
    make_task(next(iter(plan[0]["configs"].values())))  # every run trains on the study's one task
    for name in cfg.held_out:
        get_task(name).test()
    if uses_vllm(cfg):  # before loading the model: these read its config only
        from deltalens.generation.vllm import check_weight_loading, import_vllm

        import_vllm()  # a missing vLLM is said now, not after hours of training
        if {"es", "grpo"} & set(cfg.methods):  # the sparsity step loads state dicts into the base's engine
            check_weight_loading(cfg.model)
    check_start(cfg.model, [cfg.chat_template])  # each run then loads its own copy
    return plan


def _check_study_file(cfg: StudyConfig, out: Path) -> None:
    """DIR/study.json pins what the runs depend on: a rerun may add seeds or methods, not change these."""
    pinned = ("model", "task", "budget", "preset", "chat_template")
    settings = {k: getattr(cfg, k) for k in pinned}
    # options added later: pinned only when not their default, so studies pinned before them still match
    later = {"es_settings": (cfg.es_settings, {}), "grpo_settings": (cfg.grpo_settings, {}),
             "population_alpha": (cfg.population_alpha, "fixed")}
    settings.update({k: v for k, (v, default) in later.items() if v != default})
    diff = pin_json(settings, out / "study.json")
    if diff:
        raise DeltalensError(f"{out} is a study with other settings ({', '.join(f'{k}: {a!r} vs {b!r}' for k, (a, b) in sorted(diff.items()))}); "
                             "use another --out")
