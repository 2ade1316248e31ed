"""`deltalens study`: the paper's question on one model and task, with statistics that carry a verdict.

    deltalens study smollm2 --methods es,grpo,es-grpo --seeds 0,1,2 --budget 2e6 --out studies/smollm2

For every method and seed it trains a run at one FLOP-matched budget (`deltalens.training.budget`;
resumable: a rerun skips finished runs and resumes killed ones), then measures, each result cached by the
content hash of what it depends on (a rerun recomputes nothing that is done):

    evaluations  the base (several sampling seeds) and every run on the test split, the paper's settings
                 (32 samples, T = 0.6), per-problem Pass@k and Maj@k
    distances    the weight diff of every run (rel. L2 from init, top-100 coordinates by |Δ| and |Δ|/|θ0|)
    sparsity     each ES / GRPO run of the first seed thresholded at target sparsities (one global τ), with
                 two controls at equal sparsity: a random mask, and a uniform shrink of Δ to the same norm
                 (with --backend vllm all of them sampled on one engine of the base, weights swapped in)
    diversity    the population of the first ES run around its final weights (JS, corrected JS of success,
                 coverage against the centre)
    entropy      token entropy of every model along its own samples

and tests each claim of arXiv 2608.27351 as a set of directional checks with bootstrap intervals
(`deltalens.analysis.stats`; the rule is stated in the report), the verdicts Holm-adjusted over all the
study's checks, with each bootstrap bound's Monte Carlo SE (`deltalens.analysis.multiplicity`). Output: DIR/analysis.json (valid against
the schema, with the verdict table under `study`), DIR/report.html, DIR/verdicts.csv.

DIR/study.json pins the settings the runs depend on (a rerun may add seeds or methods, not change them).
Everything a study can be refused for is checked before DIR is created or that file written
(`validate_study`), so a refused study never blocks its own corrected retry.
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

from deltalens.analysis import multiplicity, stats
from deltalens.analysis.delta import diff_checkpoints
from deltalens.analysis.document import analysis_document, model_entry
from deltalens.analysis.report import Cache, training_section, weights_hash
from deltalens.errors import DeltalensError
from deltalens.evaluation import evaluate, evaluate_state_dict
from deltalens.evaluation.passk import pass_at_k
from deltalens.io.atomic import atomic_path, pin_json, write_json_atomic
from deltalens.io.models import load_model
from deltalens.io.outputs import Output, check_outputs
from deltalens.io.runs import RunDir
from deltalens.presets import auto_preset
from deltalens.study.config import StudyConfig
from deltalens.tasks import get_task
from deltalens.training.budget import es_units
from deltalens.training.chain import stage_configs, train_chain
from deltalens.training.es.config import ESConfig
from deltalens.training.es.train import train_es
from deltalens.training.grpo.config import GRPOConfig
from deltalens.training.grpo.train import train_grpo
from deltalens.training.launch import check_start, train_unless_finished
from deltalens.training.run import make_task
from deltalens.training.tracking import require

NORM_ATTN = ("norm", "attn_q", "attn_k", "attn_v", "attn_qkv", "attn_o", "attn_bias")
EMBED_HEAD = ("embed", "lm_head")
Log = Callable[[str], None]


# ----------------------------------------------------------------------------------------------- runs


def _shown(run_dir, out: Path) -> str:
    """A run directory as the study's documents show it: relative to the study directory, so that a
    report names the same runs wherever the study was run or moved (runs/es-s0)."""
    return Path(os.path.relpath(run_dir, out)).as_posix()


def _preset(cfg: StudyConfig) -> str:
    return auto_preset(cfg.model) if cfg.preset == "auto" else cfg.preset


def study_budget(cfg: StudyConfig) -> float:
    """The units every method gets: --budget, else 20 iterations of the model's ES preset."""
    if cfg.budget is not None:
        return float(cfg.budget)
    es = ESConfig.preset(_preset(cfg))
    return float(es_units(20, es.prompts_per_iteration, es.population))


def run_plan(cfg: StudyConfig, out: Path) -> list[dict]:
    """Every (method, seed) run: its directory and the configs it trains with (nothing is trained here)."""
    preset, budget = _preset(cfg), study_budget(cfg)
    common = {"model": cfg.model, "task": cfg.task, "chat_template": cfg.chat_template, "report_to": cfg.report_to}
    plan = []
    for method in cfg.methods:
        for seed in cfg.seeds:
            d = out / "runs" / f"{method}-s{seed}"
            if method == "es":
                es = ESConfig.resolve(preset=preset, given={**common, "seed": seed, "budget": budget})
                total, configs = es.iterations, {"es": es}
            elif method == "grpo":
                gr = GRPOConfig.resolve(preset=preset, given={**common, "seed": seed, "budget": budget})
                total, configs = gr.steps, {"grpo": gr}
            else:
                stages = method.split("-")
                es_s = ESConfig.resolve(preset=preset, given={**common, "seed": seed})
                gr_s = GRPOConfig.resolve(preset=preset, given={**common, "seed": seed})
                cfgs = stage_configs(d, stages, cfg.model, cfg.task, {"es": es_s, "grpo": gr_s}, {}, budget)
                total = sum(c.iterations if m == "es" else c.steps for m, c in zip(stages, cfgs))
                configs = {"es": es_s, "grpo": gr_s}
            plan.append({"method": method, "seed": seed, "label": f"{method}-s{seed}", "dir": d, "total": total,
                         "configs": configs})
    return plan


def train_runs(cfg: StudyConfig, plan: list[dict], log: Log, progress_factory=None) -> None:
    """Train what is not finished: new runs start, killed runs resume from their last checkpoint."""
    budget = study_budget(cfg)
    for r in plan:
        if r["method"] == "es":
            train = functools.partial(train_es, r["configs"]["es"], r["dir"])
        elif r["method"] == "grpo":
            train = functools.partial(train_grpo, r["configs"]["grpo"], r["dir"])
        else:
            train = functools.partial(train_chain, r["dir"], r["method"].split("-"), model=cfg.model, task=cfg.task,
                                      budget=budget, es_config=r["configs"]["es"], grpo_config=r["configs"]["grpo"])
        train_unless_finished(r["dir"], r["total"], r["label"], train, log=log, progress_factory=progress_factory)


# ------------------------------------------------------------------------------------------- measures


SPARSE = "sparse-weights:"  # Measures._engine's key while it computes with a loaded state dict


class Measures:
    """Cached measurements of the study's models (results keyed by content hash in DIR/cache)."""

    def __init__(self, cfg: StudyConfig, out: Path, log: Log, progress_factory=None):
        self.cfg, self.log, self.progress_factory = cfg, log, progress_factory
        self.cache = Cache(out / "cache")
        self.task = get_task(cfg.task)
        self.hashes: dict[str, str] = {}
        self._loaded: dict = {}
        self._sparse: dict = {}  # the base model the sparsity evaluations overwrite (evaluate_state_dict's cache)
        self._engine: tuple | None = None  # (spec, vLLM backend): one engine serves all seeds of one model

    def hash(self, spec: str) -> str:
        if spec not in self.hashes:
            self.hashes[spec] = weights_hash(spec)
        return self.hashes[spec]

    def model(self, spec: str):
        if spec not in self._loaded:
            self.close_engine()
            self._loaded.clear()  # one model in memory at a time
            self._sparse.clear()
            self._loaded[spec] = load_model(spec)
        return self._loaded[spec]

    def close_engine(self) -> None:
        if self._engine is not None:
            self._engine[1].close()
            self._engine = None

    def engine(self, spec: str):
        """The vLLM backend of `spec` (started once; the previous model's engine is closed first)."""
        from deltalens.generation import backend_for_spec

        if self._engine is None or self._engine[0] != spec:
            self.close_engine()
            self._loaded.clear()  # the HF copy is not needed while the engine samples
            self._sparse.clear()
            be, _, _ = backend_for_spec("vllm", spec, chat_template=self.cfg.chat_template)
            self._engine = (spec, be)
        return self._engine[1]

    def _backend_key(self) -> dict:
        # the backend is part of a cache key only when it is not HF, so HF results cached before it existed count
        return {"backend": self.cfg.backend} if self.cfg.backend != "hf" else {}

    def evaluation(self, spec: str, label: str, seed: int, samples: int | None = None, task=None) -> dict:
        cfg = self.cfg
        task = task or self.task
        samples = samples or cfg.samples
        ks = [k for k in cfg.ks if k <= samples] or [1]
        key = self.cache.key("study-eval", weights=self.hash(spec), task=task.spec, samples=samples, ks=ks,
                             temperature=cfg.temperature, limit=cfg.limit, seed=seed, chat=cfg.chat_template,
                             **self._backend_key())

        def compute():
            n = len(task.test(cfg.limit)) * samples
            prog = self.progress_factory(f"eval {label} on {task.spec} (seed {seed})", n) \
                if self.progress_factory else None
            if cfg.backend == "vllm":
                be = self.engine(spec)
                model, tok = None, be.tok
            else:
                (model, tok), be = self.model(spec), None
            return evaluate(model, tok, task, samples=samples, ks=ks, temperature=cfg.temperature,
                            limit=cfg.limit, seed=seed, progress=prog, chat_template=cfg.chat_template, backend=be)

        return self.cache.get_or_compute(key, compute, self.log)

    def state_dict_pass1(self, base: str, sd: dict, tag: str, seed: int = 0, label: str = "") -> list[float]:
        """Per-problem Pass@1 of `sd` applied onto the base architecture (sparsity evaluations). With
        --backend vllm every state dict is loaded into one engine of the base (`VLLMBackend.load_state_dict`),
        which then no longer serves the base's own evaluations (`self._engine` is marked)."""
        cfg = self.cfg
        key = self.cache.key("study-sparse-eval", weights=tag, task=self.task.spec, samples=cfg.sparsify_samples,
                             temperature=cfg.temperature, limit=cfg.limit, seed=seed, chat=cfg.chat_template,
                             **self._backend_key())

        def compute():
            n = len(self.task.test(cfg.limit)) * cfg.sparsify_samples
            prog = self.progress_factory(f"eval {label or tag.split(':')[0]} (Pass@1)", n) \
                if self.progress_factory else None
            be = None
            if cfg.backend == "vllm":
                marked = self._engine is not None and self._engine[0] == SPARSE + base
                be = self._engine[1] if marked else self.engine(base)
                self._engine = (SPARSE + base, be)  # its weights are no longer the base's
            elif not self._sparse:
                self._loaded.clear()  # one model in memory at a time
            # one base (HF model or engine) for the whole sweep: every call overwrites all its weights
            res = evaluate_state_dict(base, sd, self.task, samples=cfg.sparsify_samples, ks=[1],
                                      temperature=cfg.temperature, limit=cfg.limit, seed=seed, backend=be,
                                      model_cache=None if be else self._sparse, chat_template=cfg.chat_template,
                                      progress=prog)
            return {"pass1": [r["correct"] / r["n"] for r in res["per_problem"]]}

        return self.cache.get_or_compute(key, compute, self.log)["pass1"]

    def entropy(self, spec: str) -> list[float]:
        from deltalens.analysis.entropy import token_entropy

        cfg = self.cfg
        key = self.cache.key("study-entropy", weights=self.hash(spec), task=self.task.spec,
                             prompts=cfg.entropy_prompts, temperature=cfg.temperature, chat=cfg.chat_template)

        def compute():
            model, tok = self.model(spec)
            problems = self.task.test(cfg.entropy_prompts)
            return {"entropy": token_entropy(model, tok, problems, samples=4, temperature=cfg.temperature,
                                             max_new_tokens=self.task.max_new_tokens,
                                             chat_template=cfg.chat_template)}

        return self.cache.get_or_compute(key, compute, self.log)["entropy"]


def per_problem(ev: dict, metric: str, k: int) -> list[float]:
    """Per-problem Pass@k (unbiased estimator) or Maj@k from an evaluation's per_problem rows."""
    if metric == "pass":
        return [pass_at_k(r["n"], r["correct"], k) for r in ev["per_problem"]]
    return [r["maj_at_k"][str(k)] for r in ev["per_problem"]]


# ------------------------------------------------------------------------------------------- claims


def _check(claim: int, check: str, method: str, metric: str, est: float, ci, direction: int,
           null: float = 0.0, *, evidence=None, seed_spread: bool = True, **extra) -> dict:
    """One check. `evidence` (`multiplicity.Replicates`, `TStat` or `Fieller`; None: untestable) is what
    `_adjust` derives the p-value, the Holm-level interval and the Monte Carlo SEs from; `seed_spread`:
    whether its interval carries the spread over training seeds (claims 3 and 7 measure seed 0 only)."""
    return {"claim": claim, "check": check, "method": method, "metric": metric, "estimate": est,
            "ci_low": ci[0], "ci_high": ci[1], "direction": "+" if direction > 0 else "-", "null": null,
            "verdict": stats.verdict(ci, direction, null), "seed_spread": bool(seed_spread),
            "_evidence": evidence, **extra}


def _adjust(checks: list[dict]) -> list[dict]:
    """Holm across every check of the study (`multiplicity.judge`): each check keeps its unadjusted 95%
    interval (ci_low/ci_high, now from its evidence) with its bounds' Monte Carlo SEs and unadjusted verdict,
    and gets its p-value, Holm's adjusted p, the Holm-level interval, and `verdict`: Holm's. In place."""
    tests = [(c.pop("_evidence", None), float(c["null"]), 1 if c["direction"] == "+" else -1) for c in checks]
    for c, (ev, _, _), res in zip(checks, tests, multiplicity.judge(tests)):
        if ev is None:  # no evidence: the interval stays as it was (undefined), untestable
            res = {**res, "ci_low": c["ci_low"], "ci_high": c["ci_high"]}
        c.update(res)
    return checks


SEED_SPREAD = ("Seed spread: the checks of claims 1, 2, 4, 5 and 6 carry the spread over training seeds (a "
               "Student-t seed part in the bootstrap, or a t interval over per-seed values; none for a method "
               "trained with one seed); the checks of claims 3 and 7 measure the first seed's runs only "
               "(sparsity of es/grpo seed 0, the population of es seed 0), so their intervals are over test "
               "problems or prompts: what one run can tell, not what another seed would give.")


def _claim_verdict(checks: list[dict]) -> str:
    v = {c["verdict"] for c in checks}
    if v == {"reproduced"}:
        return "reproduced"
    if v == {"contradicted"}:
        return "contradicted"
    if "reproduced" in v or "contradicted" in v:
        return "mixed"
    return "unclear"


CLAIMS = {
    1: "GRPO raises Pass@1 but lowers Pass@16/32 and loses problems the base solved; ES raises Pass@1 and keeps "
       "Pass@16/32",
    2: "ES moves 40-44x farther from initialization than GRPO (rel. L2)",
    3: "most of the Pass@1 gain survives high sparsity (one global τ), more than at equal sparsity by a "
       "random mask or at equal norm by a uniform shrink",
    4: "ES's top changes sit in norm weights and attention, GRPO's in embeddings and the LM head",
    5: "ES->GRPO gives the best Pass@32 and keeps most of GRPO's Pass@1 gain",
    6: "GRPO collapses token entropy, ES does not",
    7: "the ES population is diverse (JS > 0) and its members cover more problems than the centre",
}


def _table_of(evs: list[dict], metric: str, k: int) -> list[list[float]]:
    return [per_problem(e, metric, k) for e in evs]


def _evaluation_checks(cfg: StudyConfig, base_evals: list[dict], run_evals: dict, by_method: dict,
                       R: int) -> tuple[list[dict], dict]:
    """Claims 1 and 5 from the evaluations: every method's effect on Pass@K/Maj@K against the base (the
    `effects` the summary shows; the claim-1 checks are those very effects, one base definition: the mean
    over the base's sampling seeds), GRPO's Pass@K checks, ES's Pass@1 (raises) and Pass@K>1 (keeps:
    non-inferiority at `cfg.noninferiority_margin`), problems lost (`stats.problems_lost`: GRPO's count per
    seed, and GRPO minus ES over the problems the base solves), and ES->GRPO against ES and GRPO."""
    checks: list[dict] = []
    effects = {}
    for meth, runs in by_method.items():
        evs = [run_evals[r["label"]] for r in runs]
        for metric, ks in (("pass", cfg.ks), ("maj", [k for k in cfg.ks if k > 1])):  # Maj@1 = Pass@1
            for k in ks:
                effects[(meth, metric, k)] = stats.paired_effect(_table_of(evs, metric, k),
                                                                 _table_of(base_evals, metric, k), span=1.0,
                                                                 resamples=R, replicates=True)
    margin = cfg.noninferiority_margin
    k_hi = [k for k in cfg.ks if k > 1]
    for meth, want in (("grpo", {1: +1, **{k: -1 for k in k_hi}}), ("es", {k: +1 for k in cfg.ks})):
        if meth in by_method:
            for k, d in want.items():
                e = effects[(meth, "pass", k)]
                keeps = meth == "es" and k > 1  # the paper's "keeps": not worse than the base by more than margin
                name = (f"{meth} vs base, Pass@{k}: keeps (non-inferior, margin {margin:g})" if keeps
                        else f"{meth} vs base, Pass@{k}")
                checks.append(_check(1, name, meth, f"pass@{k}", e["estimate"], e["ci"], d,
                                     null=-margin if keeps else 0.0, per_seed=e["per_seed"], base_value=e["base"],
                                     evidence=multiplicity.Replicates(e["replicates"]), seed_spread=e["seeds"] > 1))
    # problems lost: the narrowing itself, which a net Pass@K can hide
    base_rates = [[r["correct"] / r["n"] for r in ev["per_problem"]] for ev in base_evals]
    lost = {meth: stats.problems_lost(base_rates, [[r["correct"] for r in run_evals[x["label"]]["per_problem"]]
                                                   for x in by_method[meth]])
            for meth in ("grpo", "es") if meth in by_method}
    what = f"base solves >= {stats.LOST_BASE_AT_LEAST * 32:g}/32, the run <= {stats.LOST_METHOD_AT_MOST}/{cfg.samples}"
    if "grpo" in lost:
        g = lost["grpo"]
        counts = g["per_seed"]
        checks.append(_check(1, f"grpo: problems lost per run ({what})", "grpo", "problems lost",
                             sum(counts) / len(counts), stats.seed_interval(counts), +1, per_seed=counts,
                             eligible=int(g["eligible"].size), evidence=multiplicity.TStat.from_seeds(counts),
                             seed_spread=len(counts) > 1))
        if "es" in lost:
            n_elig = int(g["eligible"].size)
            name = f"problems lost, grpo minus es (share of the {n_elig} the base solves)"
            if n_elig >= 2:
                e = stats.paired_effect(g["lost"], lost["es"]["lost"], trained_base=True, span=1.0, resamples=R,
                                        replicates=True)
                checks.append(_check(1, name, "grpo", "problems lost share", e["estimate"], e["ci"], +1,
                                     per_seed=e["per_seed"], eligible=n_elig, lost_es=lost["es"]["per_seed"],
                                     evidence=multiplicity.Replicates(e["replicates"]),
                                     seed_spread=e["seeds"] > 1 or e["base_seeds"] > 1))
            else:  # fewer than 2 problems to compare on: untestable, shown as such
                checks.append(_check(1, name, "grpo", "problems lost share", math.nan, (math.nan, math.nan), +1,
                                     eligible=n_elig, lost_es=lost["es"]["per_seed"]))
    if "es-grpo" in by_method:
        kmax = max(cfg.ks)
        chain = [run_evals[r["label"]] for r in by_method["es-grpo"]]
        for other in ("es", "grpo"):
            if other in by_method:
                a = _table_of(chain, "pass", kmax)
                b = _table_of([run_evals[r["label"]] for r in by_method[other]], "pass", kmax)
                e = stats.paired_effect(a, b, trained_base=True, span=1.0, resamples=R, replicates=True)
                checks.append(_check(5, f"es-grpo vs {other}, Pass@{kmax}", "es-grpo", f"pass@{kmax}", e["estimate"],
                                     e["ci"], +1, per_seed=e["per_seed"], evidence=multiplicity.Replicates(e["replicates"]),
                                     seed_spread=e["seeds"] > 1 or e["base_seeds"] > 1))
        if "grpo" in by_method:
            a = _table_of(chain, "pass", 1)
            g = _table_of([run_evals[r["label"]] for r in by_method["grpo"]], "pass", 1)
            est, ev = multiplicity.fieller_share(a, g, _table_of(base_evals, "pass", 1))
            checks.append(_check(5, "es-grpo keeps GRPO's Pass@1 gain (share, Fieller)", "es-grpo",
                                 "pass@1 gain share", est, ev.interval(stats.LEVEL), +1, null=0.5, evidence=ev,
                                 seed_spread=len(a) > 1 or len(g) > 1))
    return checks, effects


def effects_summary(effects: dict) -> dict:
    """The study's `effects` (what the summary rows show): the same effects as the claim-1 checks."""
    return {f"{meth}:{metric}@{k}": {kk: effects[(meth, metric, k)][kk] for kk in ("estimate", "method", "base", "ci")}
            for (meth, metric, k) in effects}


def run_study(cfg: StudyConfig, out: str | Path, *, log: Log = print, progress_factory=None) -> dict:
    """Train, measure, test every claim, write DIR/analysis.json, DIR/report.html, DIR/verdicts.csv."""
    from deltalens.reports import render_report
    from deltalens.reports.markdown import study_markdown

    out = Path(out)
    check_outputs([Output(out, "--out", directory=True)], models=[cfg.model])
    if (out / "study.json").exists():
        _check_study_file(cfg, out)  # another study's DIR is refused first (read only: the file exists)
    plan = validate_study(cfg, out)
    out.mkdir(parents=True, exist_ok=True)
    _check_study_file(cfg, out)
    t0 = time.time()
    train_runs(cfg, plan, log, progress_factory)
    m = Measures(cfg, out, log, progress_factory)
    try:
        R = cfg.resamples
        by_method = {meth: [r for r in plan if r["method"] == meth] for meth in cfg.methods}

        # -- evaluations and claim 1 / 5
        log(f"evaluating the base ({cfg.base_seeds} sampling seeds) and {len(plan)} runs")
        base_evals = [m.evaluation(cfg.model, "base", s) for s in range(cfg.base_seeds)]
        run_evals = {r["label"]: m.evaluation(str(r["dir"]), r["label"], 0) for r in plan}
        m.close_engine()  # the remaining measurements run on HF
        checks: list[dict] = []

        new_checks, effects = _evaluation_checks(cfg, base_evals, run_evals, by_method, R)
        checks.extend(new_checks)

        # -- distances (claim 2) and where the changes sit (claim 4)
        log("diffing every run against the base")
        labels = [r["label"] for r in plan]
        dkey = m.cache.key("study-diff", base=m.hash(cfg.model), runs=[m.hash(str(r["dir"])) for r in plan], labels=labels)
        diff_doc = m.cache.get_or_compute(dkey, lambda: diff_checkpoints(
            cfg.model, [str(RunDir(r["dir"]).weights()) for r in plan], labels, progress=False), log)
        diffs = diff_doc["diff"]
        if "es" in by_method and "grpo" in by_method:
            pairs = [(f"es-s{s}", f"grpo-s{s}") for s in cfg.seeds]
            ratios = [diffs[a]["whole"]["rel_l2"] / diffs[b]["whole"]["rel_l2"] for a, b in pairs
                      if diffs[b]["whole"]["rel_l2"]]
            if ratios:
                ci = stats.seed_interval(ratios)
                est = sum(ratios) / len(ratios)
                ev = multiplicity.TStat.from_seeds(ratios)
                checks.append(_check(2, "rel. L2 from init, ES / GRPO (per seed): ES farther", "es/grpo", "rel_l2 ratio",
                                     est, ci, +1, null=1.0, per_seed=ratios, evidence=ev, seed_spread=len(ratios) > 1))
                checks.append(_check(2, "the same ratio: at least the paper's 40x", "es/grpo", "rel_l2 ratio", est, ci,
                                     +1, null=40.0, paper_range_in_ci=bool(ci[0] <= 44 and ci[1] >= 40), evidence=ev,
                                     seed_spread=len(ratios) > 1))
            for rank in ("abs", "rel"):
                def share(label, groups, rank=rank):
                    comp = diffs[label]["topk"][rank]["composition"]
                    total = sum(comp.values())
                    return sum(comp.get(g, 0) for g in groups) / total if total else 0.0

                for groups, name, who in ((NORM_ATTN, "norm + attention", "es"), (EMBED_HEAD, "embed + lm_head", "grpo")):
                    other = "grpo" if who == "es" else "es"
                    vals = [share(f"{who}-s{s}", groups) - share(f"{other}-s{s}", groups) for s in cfg.seeds]
                    ci = stats.seed_interval(vals)
                    checks.append(_check(4, f"top-100 by {'|Δ|' if rank == 'abs' else '|Δ|/|θ0|'}: share in {name}, "
                                            f"{who} minus {other}", who, f"top-100 {rank} share", sum(vals) / len(vals),
                                         ci, +1, per_seed=vals, evidence=multiplicity.TStat.from_seeds(vals),
                                         seed_spread=len(vals) > 1))

        # -- sparsity with controls (claim 3), first seed of ES and GRPO
        sparsify_section = {}
        for meth in ("es", "grpo"):
            if meth not in by_method:
                continue
            r0 = by_method[meth][0]
            res = _sparsity(cfg, m, r0, log, R)
            sparsify_section[r0["label"]] = res["section"]
            checks.extend(res["checks"])

        # -- token entropy (claim 6)
        log("token entropy of every model along its own samples")
        base_ent = m.entropy(cfg.model)
        ent = {}
        for meth in ("es", "grpo"):
            if meth in by_method:
                ent[meth] = [m.entropy(str(r["dir"])) for r in by_method[meth]]
                if meth == "grpo":
                    e = stats.paired_effect(ent[meth], [base_ent], resamples=R, replicates=True)
                    checks.append(_check(6, "grpo vs base, token entropy", "grpo", "entropy", e["estimate"], e["ci"], -1,
                                         per_seed=e["per_seed"], evidence=multiplicity.Replicates(e["replicates"]),
                                         seed_spread=e["seeds"] > 1))
        if "es" in ent and "grpo" in ent:
            e = stats.paired_effect(ent["es"], ent["grpo"], trained_base=True, resamples=R, replicates=True)
            checks.append(_check(6, "token entropy, es minus grpo", "es", "entropy", e["estimate"], e["ci"], +1,
                                 per_seed=e["per_seed"], evidence=multiplicity.Replicates(e["replicates"]),
                                 seed_spread=e["seeds"] > 1 or e["base_seeds"] > 1))

        # -- population diversity (claim 7), first ES run around its final weights
        diversity_section = {}
        if "es" in by_method:
            r0 = by_method["es"][0]
            div = _diversity(cfg, m, r0, out, log)
            diversity_section[r0["label"]] = div
            js, se = div["js_mi_mean"], div["js_mi_se"] or 0.0
            checks.append(_check(7, "population JS (posterior estimator) > 0", "es", "js", js,
                                 (js - 1.96 * se, js + 1.96 * se), +1, evidence=multiplicity.TStat(js, se, math.inf),
                                 seed_spread=False))
            gaps = [p["coverage_population"] - p["coverage_centre"] for p in div["per_prompt"]
                    if p["coverage_centre"] is not None]
            if len(gaps) >= 2:
                ci = stats.mean_bootstrap(gaps, resamples=R)
                checks.append(_check(7, "Pass@N: population (one sample each) minus centre (N samples)", "es",
                                     "coverage gap", sum(gaps) / len(gaps), ci, +1, seed_spread=False,
                                     evidence=multiplicity.Replicates(stats.mean_replicates(gaps, resamples=R))))

        held_out = {}
        for name in cfg.held_out:
            ht = get_task(name)
            for label, spec in [("base", cfg.model), *((r["label"], str(r["dir"])) for r in plan)]:
                held_out.setdefault(label, {})[name] = m.evaluation(spec, label, 0, task=ht)["pass_at_k"]

        _adjust(checks)  # Holm over every check of the study: the verdicts below are the adjusted ones
        claims = [{"id": cid, "title": title, "checks": [c for c in checks if c["claim"] == cid],
                   "verdict": _claim_verdict([c for c in checks if c["claim"] == cid])}
                  for cid, title in CLAIMS.items() if any(c["claim"] == cid for c in checks)]
        summary = effects_summary(effects)
        study = {"config": {**cfg.to_dict(), "budget": study_budget(cfg), "preset": _preset(cfg)},
                 "rule": f"{stats.rule_text(cfg.noninferiority_margin)} {SEED_SPREAD}",
                 "claims": claims, "effects": summary,
                 "runs": [{"label": r["label"], "method": r["method"], "seed": r["seed"], "dir": _shown(r["dir"], out),
                           "total": r["total"]} for r in plan],
                 "seconds": round(time.time() - t0, 1)}
        evals = {"base": base_evals[0], **{lab: ev for lab, ev in run_evals.items()}}
        training = {r["label"]: training_section(r["label"], r["dir"]) for r in plan}
        doc = analysis_document(cfg.model, [model_entry(r["label"], str(r["dir"]), _shown(r["dir"], out)) for r in plan],
                                diff=diffs, ratios=diff_doc["ratios"], evals=evals,
                                sparsify=sparsify_section or None, diversity=diversity_section or None,
                                training={k: v for k, v in training.items() if v}, held_out=held_out or None,
                                study=study)
        doc = {k: v for k, v in doc.items() if v is not None}
        write_json_atomic(doc, out / "analysis.json")
        with atomic_path(out / "verdicts.csv") as tmp:
            stats.table(checks).to_csv(tmp, index=False)
        with atomic_path(out / "verdicts.md") as tmp:
            tmp.write_text(study_markdown(doc))
        render_report(doc, out / "report.html")
        return doc
    finally:
        m.close_engine()  # a vLLM engine is a subprocess: never left running


def _sparsity(cfg: StudyConfig, m: Measures, run: dict, log: Log, R: int) -> dict:
    """Claim 3 for one run: gain retained at each target sparsity by the threshold and by both controls."""
    from deltalens.analysis.sparsify import (
        apply_threshold,
        random_mask,
        thresholds_for_sparsity,
        uniform_shrink,
    )
    from deltalens.io.tensors import open_tensors

    weights = RunDir(run["dir"]).weights()
    with open_tensors(cfg.model) as bsrc, open_tensors(weights) as csrc:
        taus = thresholds_for_sparsity(bsrc, csrc, list(cfg.sparsity))
        base_sd = {n: bsrc.get(n) for n in bsrc.names()}
        ckpt_sd = {n: csrc.get(n) for n in csrc.names()}
    base_p1 = m.state_dict_pass1(cfg.model, base_sd, "base:" + m.hash(cfg.model), label="base")
    full_p1 = m.state_dict_pass1(cfg.model, ckpt_sd, "full:" + m.hash(str(run["dir"])), label=run["label"])
    points, checks = [], []
    for target, tau in zip(cfg.sparsity, taus):
        log(f"sparsity {target:g} of {run['label']}: threshold, random mask, uniform shrink")
        thr, st = apply_threshold(base_sd, ckpt_sd, tau)
        rnd, _ = random_mask(base_sd, ckpt_sd, st["sparsity"], seed=run["seed"])
        shr, _ = uniform_shrink(base_sd, ckpt_sd, st["kept_l2_frac"] or 0.0)
        tag = f"{m.hash(str(run['dir']))}:{tau!r}"
        what = f"{run['label']} at sparsity {target:g}"
        p = {"threshold": m.state_dict_pass1(cfg.model, thr, "thr:" + tag, label=f"{what}, threshold"),
             "random": m.state_dict_pass1(cfg.model, rnd, "rnd:" + tag, label=f"{what}, random mask"),
             "shrink": m.state_dict_pass1(cfg.model, shr, "shr:" + tag, label=f"{what}, uniform shrink")}
        ret = {k: multiplicity.fieller_share([v], [full_p1], [base_p1]) for k, v in p.items()}
        ret = {k: (est, ev, ev.interval(stats.LEVEL)) for k, (est, ev) in ret.items()}
        points.append({"target_sparsity": target, "tau": tau, "sparsity": st["sparsity"],
                       "kept_l2_frac": st["kept_l2_frac"], "pass_at_k": {"1": sum(p["threshold"]) / len(base_p1)},
                       "gain_retained": ret["threshold"][0],
                       "controls": {k: {"pass_at_1": sum(v) / len(v), "gain_retained": ret[k][0],
                                        "ci": list(ret[k][2])} for k, v in p.items() if k != "threshold"},
                       "gain_retained_ci": list(ret["threshold"][2])})  # Fieller, as the claim-3 check
        if target >= 0.9:
            meth = run["method"]
            checks.append(_check(3, f"{meth}: Pass@1 gain kept at sparsity {target:g} (share)", meth,
                                 "gain retained", ret["threshold"][0], ret["threshold"][2], +1, null=0.5,
                                 evidence=ret["threshold"][1], seed_spread=False))
            for ctl in ("random", "shrink"):
                e = stats.paired_effect([p["threshold"]], [p[ctl]], resamples=R, replicates=True)
                checks.append(_check(3, f"{meth}: threshold minus {ctl} at sparsity {target:g}, Pass@1", meth,
                                     "pass@1", e["estimate"], e["ci"], +1, seed_spread=False,
                                     evidence=multiplicity.Replicates(e["replicates"])))
    section = {"task": m.task.spec, "backend": cfg.backend, "ks": [1],
               "base_pass_at_k": {"1": sum(base_p1) / len(base_p1)},
               "full_pass_at_k": {"1": sum(full_p1) / len(full_p1)}, "points": points}
    return {"section": section, "checks": checks}


def _diversity(cfg: StudyConfig, m: Measures, run: dict, out: Path, log: Log) -> dict:
    from deltalens.analysis.diversity import diversity_section

    it = max(RunDir(run["dir"]).checkpoints())
    key = m.cache.key("study-diversity", run=m.hash(str(run["dir"])), iteration=it, members=cfg.diversity_members,
                      prompts=cfg.diversity_prompts, temperature=cfg.temperature, chat=cfg.chat_template)
    log(f"population diversity of {run['label']} around iteration {it}")
    div = m.cache.get_or_compute(key, lambda: diversity_section(
        str(run["dir"]), m.task, members=cfg.diversity_members, iteration=it, prompts=cfg.diversity_prompts,
        samples=4, temperature=cfg.temperature, chat_template=cfg.chat_template), log)
    # the run and its checkpoint as the rest of the document names them: relative to DIR, not this machine's paths
    return {**div, **{k: _shown(div[k], out) for k in ("model", "centre") if isinstance(div.get(k), str)}}


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
    if cfg.backend == "vllm":  # before loading the model: these read its config only
        from deltalens.generation.vllm import check_weight_loading, import_vllm

        import_vllm()  # a missing vLLM is said now, not after hours of training
        if {"es", "grpo"} & set(cfg.methods):  # the sparsity step loads state dicts into the base's engine
            check_weight_loading(cfg.model)
    check_start(cfg.model, [cfg.chat_template])  # each run then loads its own copy
    return plan


def _check_study_file(cfg: StudyConfig, out: Path) -> None:
    """DIR/study.json pins what the runs depend on: a rerun may add seeds or methods, not change these."""
    pinned = ("model", "task", "budget", "preset", "chat_template")
    diff = pin_json({k: getattr(cfg, k) for k in pinned}, out / "study.json")
    if diff:
        raise DeltalensError(f"{out} is a study with other settings ({', '.join(f'{k}: {a!r} vs {b!r}' for k, (a, b) in sorted(diff.items()))}); "
                             "use another --out")
