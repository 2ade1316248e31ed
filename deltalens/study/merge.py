"""`deltalens study merge STUDY... --out DIR`: one study from pieces run apart (other sessions, other machines).

A study on a CPU does not fit one sitting: the SmolLM2 study takes ~2.5 h per training seed on a 2-core
machine, and nothing outside the repository survives between sessions. Every input of a study's checks is
in its analysis.json (`deltalens.study.verify`), so the checks of the whole follow from the pieces'
documents: run `deltalens study MODEL --seeds 1 --out A` in one sitting, `--seeds 2 --out B` in another (or
one method each), commit each analysis.json, and merge. Nothing is trained or evaluated here; the verdicts
are derived by the study's own function (`deltalens.study.run.study_checks`), Holm over every check of the
merged study.

What a merge requires and takes, piece by piece (documents in the order given):

    settings    every setting of `study.config` equal (model, task, budget and preset as resolved, limit,
                samples, K, temperatures, sparsities, population sizes, two-point, α rule, ES options,
                backend, compute dtype, resamples, margin, ...) except the seeds, the methods, the base's
                sampling seeds and where the pieces ran (--ray and its companions, --report-to); one
                method's own settings (METHOD_ONLY: the ES runs', --grpo-options) between the pieces that
                train such runs only, so a piece of GRPO runs merges with one of ES runs at
                --population-sizes
    runs        the union; a label in two pieces is refused (one run, one result)
    base        the distinct base evaluations, pooled: a piece's base evaluations that all equal earlier
                ones row for row at every temperature (same machine, same sampling seeds) are counted once,
                ones that all differ (another machine's kernels) are further sampling seeds of the same
                base (`study.base.sampling_seeds` counts them); a piece with some of each is refused (run
                the pieces with the same --base-seeds); the base's entropy, its held-out results and
                `evals.base` are the first piece's
    seed-0 work the sparsity sweep (claim 3) and the population pass (claims 9, 10) measure each method's
                first run (lowest seed) in the merged study, from the piece that has it; a piece whose own
                first run is another measured it too, and that measurement is left out (said in
                `study.merged`)
    hyper-      the runs of one group trained at one setting: each run's config.json as the study records it
    parameters  (`study.runs[].config`, since 2026-12-06) equal across pieces but for fields that do not
                change what it trains (RUN_FREE: the seed, logging, checkpoints, batching, device); a piece
                older than that records none, and the merge says so in `study.merged.notes`
    per run     evaluations, diff, entropy, training curves, held-out results, FLOP figures, paired rewards
    time        `study.seconds`: the pieces' sum

`study.merged` records the pieces (file, runs, whether their base was pooled) and what was left out.
"""

from __future__ import annotations

import json
from pathlib import Path

from deltalens.analysis.delta import rel_l2_ratios
from deltalens.analysis.document import analysis_document
from deltalens.errors import DeltalensError
from deltalens.study.config import StudyConfig
from deltalens.study.flops import flops_summary
from deltalens.study.plan import t_key
from deltalens.study.run import BASE_DEFINITION, base_section, mean_curve, study_checks, study_section
from deltalens.study.runs import TWO_POINT, by_group
from deltalens.study.scale import read_study
from deltalens.study.verify import config_of, inputs_of

# settings that may differ between pieces: what they ran and where, not how anything was measured
FREE = ("seeds", "methods", "base_seeds", "first_run_measures", "ray", "cpus_per_run", "gpus_per_run", "ray_files",
        "report_to", "keep_checkpoints")
# a run's config.json fields that do not change what it trains: the seed (differs by design), logging,
# checkpointing (and which checkpoints and optimizer states are kept), validation passes, how the work is
# batched or where it runs, whether GRPO recomputes activations in backward (the qwen2.5 preset's since
# 2026-12-07), the version string. ES's `shared_prefix` is not among them: it changes bf16 completions at near-ties, so
# pieces that both record it must agree, and a piece recorded before it existed (2026-12-06) is merged with a
# note naming it
RUN_FREE = ("seed", "eval_every", "eval_limit", "checkpoint_every", "save_every", "save_steps", "save_pt",
            "keep_optimizer_states", "keep_checkpoints", "report_to", "logging_steps", "noise_threads",
            "population_batch", "max_micro_batch", "gradient_checkpointing", "backend", "device", "deltalens_version")


# paths that name where a run's pieces lie (a chain's stage directories, the stage it starts from): they
# differ between studies by design; inside a chain's stages, `model` is such a path too
RUN_PATHS = ("dir", "init_from", "out")


def _settings(config, depth: int = 0, path: str = "") -> dict:
    """A run's config without RUN_FREE and RUN_PATHS fields, at every depth, flattened to {path: value}: a
    chain's stages as `stages.0.config.sigma`, so that a field one version records inside a stage and another
    does not is a field recorded in one config only, as at the top level, not a different `stages` list.
    Lists of plain values (`params`) stay one value."""
    if isinstance(config, dict):
        drop = {*RUN_FREE, *RUN_PATHS, *(("model",) if depth else ())}
        items = [(k, v) for k, v in config.items() if k not in drop]
    elif isinstance(config, list) and any(isinstance(v, (dict, list)) for v in config):
        items = list(enumerate(config))
    else:
        return {path: config}
    out = {}
    for k, v in items:
        out.update(_settings(v, depth + 1, f"{path}.{k}" if path else str(k)))
    return out


def run_settings(runs: list[dict], by_label: dict) -> list[str]:
    """Refuse runs of one group trained with other hyperparameters in different pieces (a preset changed
    between sittings): each run's recorded config.json (`study.runs[].config`, since 2026-12-06) against every
    earlier recorded run of the group from another piece, fields in RUN_FREE aside, so neither a first piece
    without configs nor one without a field hides a difference between two later pieces. Returns notes on
    what could not be compared, each run named against the group's first run that recorded a config."""
    notes = []
    for rs in by_group(runs).values():
        # each recorded run's settings, flattened once, in the group's order (labels are unique)
        flat = {r["label"]: _settings(r["config"]) for r in rs if isinstance(r.get("config"), dict)}
        ref = next((r for r in rs if r["label"] in flat), rs[0])
        for i, r in enumerate(rs):
            if r is ref or by_label[r["label"]] is by_label[ref["label"]]:
                continue  # one piece: one study's plan
            if r["label"] not in flat or ref["label"] not in flat:
                notes.append(f"{r['label']} vs {ref['label']}: hyperparameters not recorded in "
                             f"{by_label[(r if r['label'] not in flat else ref)['label']]['file']} (a study before "
                             "2026-12-06): only the study settings were compared")
                continue
            sb = flat[r["label"]]
            for q in rs[:i]:
                if q["label"] not in flat or by_label[q["label"]] is by_label[r["label"]]:
                    continue
                sa = flat[q["label"]]
                diff = sorted(k for k in set(sa) & set(sb) if sa[k] != sb[k])
                if diff:
                    k = diff[0]
                    raise DeltalensError(f"{r['label']} ({by_label[r['label']]['file']}) trained with other "
                                         f"settings than {q['label']} ({k}: {sb[k]!r} vs {sa[k]!r}"
                                         f"{f' and {len(diff) - 1} more' if len(diff) > 1 else ''}); a merged "
                                         "group must be one method at one setting")
            missing = sorted(set(flat[ref["label"]]) ^ set(sb))
            if missing:
                notes.append(f"{r['label']} vs {ref['label']}: fields recorded in one config only (another "
                             f"deltalens version), not compared: {', '.join(missing)}")
    return notes


def _order(cfg: StudyConfig, runs: list[dict]) -> list[dict]:
    """The runs as `run_plan` orders them: groups (the methods, es-n<N>, es-2pt), then seeds."""
    rank = {g: i for i, g in enumerate([*cfg.methods, *(f"es-n{n}" for n in sorted(cfg.population_sizes)),
                                        TWO_POINT])}
    return sorted(runs, key=lambda r: (rank.get(r["group"], len(rank)), r["seed"]))


# settings of one method's runs only: compared between the pieces that train such runs (claim 6/7's extra runs
# exist only beside the es runs; --es-options also sets ES->GRPO's ES stage, --grpo-options its GRPO
# stage), taken from them
METHOD_ONLY = {"population_sizes": ("es",), "two_point": ("es",), "population_alpha": ("es",),
               "es_options": ("es", "es-grpo", "grpo-es"), "grpo_options": ("grpo", "es-grpo", "grpo-es")}


def merged_config(cfgs: list[StudyConfig], names: list[str], base_seeds: int) -> StudyConfig:
    """The merged study's settings, or a one-line refusal naming the first setting two pieces differ in.
    Settings in METHOD_ONLY are compared between the pieces whose methods use them (a GRPO-only piece cannot
    have population sizes) and taken from the first such piece."""
    dicts = [c.to_dict() for c in cfgs]
    merged = dict(dicts[0])
    for key in sorted({k for d in dicts for k in d} - set(FREE)):
        users = [i for i, c in enumerate(cfgs) if key not in METHOD_ONLY or set(c.methods) & set(METHOD_ONLY[key])]
        if not users:
            continue
        ref = users[0]
        for i in users[1:]:
            if dicts[i].get(key) != dicts[ref].get(key):
                raise DeltalensError(f"{names[i]} is a study with other settings than {names[ref]} ({key}: "
                                     f"{dicts[i].get(key)!r} vs {dicts[ref].get(key)!r}); only seeds and methods "
                                     "may differ")
        merged[key] = dicts[ref].get(key)
    methods = list(dict.fromkeys(m for c in cfgs for m in c.methods))
    seeds = sorted({s for c in cfgs for s in c.seeds})
    return StudyConfig.from_dict({**merged, "methods": methods, "seeds": seeds, "base_seeds": base_seeds,
                                  "first_run_measures": True}, source="the merged settings")


def merge(paths) -> tuple[dict, list[dict]]:
    """The merged study's analysis document and its checks (module docstring)."""
    if len(paths) < 2:
        raise DeltalensError("give at least two studies to merge")
    loaded = [read_study(p) for p in paths]
    files = [str(f) for f, _ in loaded]
    if len({str(Path(f).resolve()) for f in files}) < len(files):
        raise DeltalensError("a study is given twice")
    docs = [d for _, d in loaded]
    cfgs = [config_of(d["study"], f) for f, d in zip(files, docs)]
    pieces = []
    for f, doc, cfg in zip(files, docs, cfgs):
        runs = doc["study"].get("runs")
        if not isinstance(runs, list) or not runs:
            raise DeltalensError(f"{f}: the study lists no runs")
        groups = by_group(runs)
        inputs, task_spec = inputs_of(doc, cfg, groups, f)
        pieces.append({"file": f, "doc": doc, "cfg": cfg, "runs": runs, "inputs": inputs, "task_spec": task_spec})

    by_label: dict[str, dict] = {}  # each run's piece
    for p in pieces:
        for r in p["runs"]:
            if r["label"] in by_label:
                raise DeltalensError(f"{r['label']} is in both {by_label[r['label']]['file']} and {p['file']}: a run "
                                     "may be merged once")
            by_label[r["label"]] = p

    # the base: distinct evaluations pooled (same rows at every temperature = the same evaluations)
    temps = [t_key(t) for t in cfgs[0].eval_temperatures]
    pooled, seen = [], set()
    for p in pieces:
        n = len(p["inputs"]["evaluations"][temps[0]]["base"])
        # one key per sampling seed: its rows at every temperature
        keys = [json.dumps([p["inputs"]["evaluations"][t]["base"][i] for t in temps], sort_keys=True)
                for i in range(n)]
        known = [k in seen for k in keys]
        if any(known) and not all(known):  # a part counted twice, or a mean curve that is not the pooled one's
            raise DeltalensError(f"{p['file']}: some of its base evaluations equal an earlier piece's and some do "
                                 "not; run the pieces with the same --base-seeds (on one machine their base "
                                 "evaluations are then equal and counted once)")
        p["base_pooled"] = not any(known)
        if p["base_pooled"]:
            seen.update(keys)
            pooled.append(p)
    n_base = sum(len(p["inputs"]["evaluations"][temps[0]]["base"]) for p in pooled)
    cfg = merged_config(cfgs, files, n_base)
    runs = _order(cfg, [r for p in pieces for r in p["runs"]])
    groups = by_group(runs)
    notes = run_settings(runs, by_label)

    def section(name: str) -> dict:
        """Each run's entry of the document section `name`, from its piece."""
        return {r["label"]: by_label[r["label"]]["doc"][name][r["label"]] for r in runs
                if r["label"] in (by_label[r["label"]]["doc"].get(name) or {})}

    evaluations = {t: {"base": [ev for p in pooled for ev in p["inputs"]["evaluations"][t]["base"]],
                       **{r["label"]: by_label[r["label"]]["inputs"]["evaluations"][t][r["label"]] for r in runs}}
                   for t in temps}
    first = {m: groups[m][0]["label"] for m in ("es", "grpo") if m in groups}
    left_out = []
    sparsity, diversity = {}, {}
    for m, label in first.items():
        src = by_label[label]["inputs"]
        if label not in src["sparsity"]:
            raise DeltalensError(f"{by_label[label]['file']}: no sparsity sweep of {label}, the merged study's "
                                 f"first {m} run (run with --no-first-run-measures?): the piece with each method's "
                                 "lowest seed must have measured it")
        sparsity[label] = src["sparsity"][label]
        if m == "es":
            if label not in src["diversity"]:
                raise DeltalensError(f"{by_label[label]['file']}: no population pass around {label}, the merged "
                                     "study's first es run (run with --no-first-run-measures?)")
            diversity[label] = src["diversity"][label]
    for p in pieces:
        left_out += [f"{p['file']}: sparsity of {k}" for k in p["inputs"]["sparsity"] if k not in sparsity]
        left_out += [f"{p['file']}: population pass around {k}" for k in p["inputs"]["diversity"]
                     if k not in diversity]
    entropy = {"base": pieces[0]["inputs"]["entropy"]["base"],
               **{r["label"]: by_label[r["label"]]["inputs"]["entropy"][r["label"]] for r in runs
                  if r["label"] in by_label[r["label"]]["inputs"]["entropy"]}}
    diff = section("diff")
    pairs = {k: v for p in pieces for k, v in p["inputs"]["pairs"].items()}
    inputs = {"evaluations": evaluations, "pairs": pairs, "diff": diff, "sparsity": sparsity, "entropy": entropy,
              "diversity": diversity}
    task_spec = next((p["task_spec"] for p in pieces if p["task_spec"]), None)
    checks, effects_at, sparsify_section = study_checks(cfg, groups, inputs, task_spec)

    vt = cfg.verdict_temperature
    curve = mean_curve([(p["doc"]["study"]["base"]["curve"], p["doc"]["study"]["base"]["sampling_seeds"])
                        for p in pooled])
    base = base_section(cfg, curve, n_base, effects_at[vt])
    rows = {t: {k: [ev["per_problem"] for ev in v] if k == "base" else v["per_problem"] for k, v in evs.items()}
            for t, evs in evaluations.items()}  # as the study writes them: the per-problem rows
    data = {"base_definition": BASE_DEFINITION, "temperature": vt, "evaluations": rows,
            "sparsity": sparsity, "entropy": entropy}
    flops = flops_summary({r["label"]: by_label[r["label"]]["doc"]["study"]["flops"]["runs"][r["label"]]
                           for r in runs}, runs, pieces[0]["doc"]["study"]["flops"]["tolerance"])
    seconds = [p["doc"]["study"].get("seconds") for p in pieces]
    study = study_section(cfg, checks, effects_at, base, runs, data, flops,
                          round(sum(seconds), 1) if all(isinstance(s, (int, float)) for s in seconds) else None)
    study["merged"] = {"pieces": [{"file": p["file"], "runs": [r["label"] for r in p["runs"]],
                                   "base": "pooled" if p["base_pooled"] else "equal to an earlier piece's: counted once"}
                                  for p in pieces],
                       "left_out": left_out, "notes": notes}

    held = pieces[0]["doc"].get("held_out") or {}
    held_out = {**({"base": held["base"]} if "base" in held else {}), **section("held_out")}
    evals = {"base": pieces[0]["doc"]["evals"]["base"], **section("evals")}
    models = [m for r in runs for m in by_label[r["label"]]["doc"]["models"] if m.get("label") == r["label"]]
    doc = analysis_document(cfg.model, models, diff=diff, ratios=rel_l2_ratios(diff), evals=evals,
                            sparsify=sparsify_section or None, diversity=diversity or None,
                            training=section("training") or None, held_out=held_out or None, study=study)
    return {k: v for k, v in doc.items() if v is not None}, checks
