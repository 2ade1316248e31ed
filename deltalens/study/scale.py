"""`deltalens study scale STUDY_DIR...`: the paper's claim 6 across model sizes, from finished studies.

Claim 6 (arXiv 2608.27351): the population size N that ES needs shrinks as the model grows. One study is one
model: its claim-6 checks (`deltalens.study.checks.population_checks`, run with --population-sizes) give,
for each extra population N, the share of the reference ES run's Pass@1 gain that N keeps, with a Fieller
interval. This module reads each study's analysis.json and, per model (its parameter count), finds

    N needed        the smallest N whose share is at least F (`--fraction`, default 0.9); the reference
                    population, whose share is 1 by definition, when no smaller N reaches F
    its interval    [the smallest N whose share's interval reaches F (or is undefined: it may),
                     the smallest N whose share's interval lies at or above F (the reference N when none)]
    censoring       where that lower end (or the N needed itself) is the smallest N the study ran, a smaller
                    untested N might reach F too: it reads "at most" that N (`low_censored`, `at_most`), and
                    a censored lower end never counts as lying surely above another model's interval

with each study's Holm-level interval of the check (the one its own verdicts use; the unadjusted 95% one
where no Holm interval is recorded), so the statement carries each study's multiplicity control. Torch-free.

The verdict on "the N needed shrinks with model scale", in the study's rule style, over the models sorted
by parameter count (at least MIN_SIZES = 3 sizes, one reference N for all of them):

    reproduced     the N needed never grows with size, and the largest model's interval lies wholly below
                   the smallest model's (its upper end < the smallest's lower end)
    contradicted   it never shrinks, and the largest model's interval lies wholly above the smallest's
    unclear        otherwise, or with fewer than 3 sizes ("unclear: needs 3 model sizes"), with reference
                   populations that differ (each N needed is measured against a different gain), with
                   studies whose extra runs took α differently (--population-alpha fixed vs scaled), or where
                   a model's reference gain is not above 0 (no share is defined)

Parameter counts come from each study's analysis.json (`diff.<run>.n_params`: every floating-point
parameter, tied tensors once); a document without them falls back to the base model's config.json
(Llama, Mistral and Qwen2 layouts), else it is refused. The reference population comes from the study's
FLOP accounting (`study.flops`, which records each ES run's population), else from the reference run's
config.json under STUDY_DIR/runs.
"""

from __future__ import annotations

import json
import math
from itertools import pairwise
from pathlib import Path

from deltalens.errors import DeltalensError
from deltalens.schema import read_text

DEFAULT_FRACTION = 0.9  # "reaches": keeps this share of the reference ES run's Pass@1 gain
MIN_SIZES = 3  # a trend needs at least three model sizes
REFERENCE_GROUP = "es"  # the claim-6 checks compare each N with the study's es runs
RULE = ("N needed: the smallest population N whose share of the reference ES run's Pass@1 gain is at least "
        "{f:g} (the reference N, share 1, when none is); its interval: from the smallest N whose share's "
        "interval reaches {f:g} (or is undefined) to the smallest N whose interval lies at or above {f:g} (the "
        "reference N when none), from each study's Holm-level Fieller intervals of claim 6. \"The N needed "
        "shrinks with model scale\" (models by parameter count, at least {m} sizes, one reference N): reproduced "
        "when it never grows with size and the largest model's interval lies wholly below the smallest's, "
        "contradicted when it never shrinks and the largest's lies wholly above, unclear otherwise.")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


ANALYSIS_NAMES = ("analysis.json", "analysis.json.gz")  # what a study writes; what docs/ publishes


def study_file(path) -> Path:
    """The analysis file of STUDY_DIR: its analysis.json, else a published analysis.json.gz (e.g.
    docs/tiny-study-2026-12-03/); a file path is itself."""
    p = Path(path)
    if not p.is_dir():
        return p
    return next((p / n for n in ANALYSIS_NAMES if (p / n).is_file()), p / ANALYSIS_NAMES[0])


def read_study(path) -> tuple[Path, dict]:
    """(the analysis file, its document) for a study directory, its analysis.json or a published
    analysis.json.gz (`study_file`); refused in one line when missing, unreadable or not a study's."""
    f = study_file(path)
    if not f.is_file():
        raise DeltalensError(f"{path}: no analysis.json or analysis.json.gz (give a finished study's directory "
                             "or its analysis file)")
    try:
        doc = json.loads(read_text(f))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DeltalensError(f"{f}: not readable as JSON ({e})") from None
    study = doc.get("study") if isinstance(doc, dict) else None
    if not isinstance(study, dict) or not isinstance(study.get("claims"), list):
        raise DeltalensError(f"{f}: not a study's analysis (no study section); run `deltalens study` first")
    return f, doc


def load_study(path) -> tuple[Path, dict]:
    """(the study directory, its analysis.json) for STUDY_DIR (`read_study`); also refused without claim 6's
    population-size runs."""
    p = Path(path)
    _, doc = read_study(p)
    if not population_checks(doc):
        raise DeltalensError(f"{path}: the study has no population-size runs (claim 6); rerun it with "
                             "--population-sizes 4,8,16")
    return p if p.is_dir() else p.parent, doc


def population_checks(doc: dict) -> list[dict]:
    """Claim 6's checks of a study document (one per extra population N), by N."""
    out = []
    for cl in doc["study"]["claims"]:
        if isinstance(cl, dict) and cl.get("id") == 6:
            out += [c for c in cl.get("checks", []) if isinstance(c, dict) and isinstance(c.get("population"), int)]
    return sorted(out, key=lambda c: c["population"])


def parameter_count(doc: dict, study_dir: Path) -> tuple[int, str]:
    """(parameters, where the count came from): analysis.json's diff, else the base model's config.json."""
    counts = {c.get("n_params") for c in (doc.get("diff") or {}).values() if isinstance(c, dict)}
    counts = {int(c) for c in counts if _finite(c) and c > 0}
    if counts:  # every run is diffed against the one base: the same count (the largest, should one differ)
        return max(counts), "analysis.json (diff n_params)"
    base = (doc.get("base") or {}).get("path")
    cfg = _base_config(base, study_dir) if base else None
    if cfg is None:
        raise DeltalensError(f"{study_dir}: no parameter count (its analysis.json has no diff section and the base "
                             f"model {base!r} has no config.json here)")
    return config_parameters(cfg, f"{study_dir}: base model {base!r}"), "the base model's config.json"


def _base_config(base: str, study_dir: Path) -> dict | None:
    from deltalens.io.spec import resolve

    for spec in (base, study_dir / base):
        try:
            ref = resolve(str(spec), fetch=False)
        except DeltalensError:
            continue
        f = Path(ref.location) / "config.json" if ref.kind == "hf_dir" else None
        if f is not None and f.is_file():
            return json.loads(f.read_text(encoding="utf-8"))
    return None


def config_parameters(cfg: dict, what: str = "the model") -> int:
    """Parameters of a Llama / Mistral / Qwen2 causal LM from its HF config.json: embeddings (+ an untied LM
    head), per layer q/k/v/o (grouped KV heads; Qwen2's q/k/v biases) + gated MLP + 2 RMSNorms, a final norm."""
    kind = cfg.get("model_type")
    if kind not in ("llama", "mistral", "qwen2"):
        raise DeltalensError(f"{what}: cannot count the parameters of model_type {kind!r} from its config.json "
                             "(Llama, Mistral, Qwen2 only); its study's analysis.json records none")
    try:
        h, n_layers, vocab, inter = (int(cfg[k]) for k in ("hidden_size", "num_hidden_layers", "vocab_size",
                                                          "intermediate_size"))
        heads = int(cfg["num_attention_heads"])
        kv = int(cfg.get("num_key_value_heads") or heads)
        hd = int(cfg.get("head_dim") or h // heads)
    except (KeyError, TypeError, ValueError) as e:
        raise DeltalensError(f"{what}: config.json lacks {e}") from None
    attn = 2 * h * heads * hd + 2 * h * kv * hd
    if kind == "qwen2" or cfg.get("attention_bias"):
        attn += heads * hd + 2 * kv * hd
    mlp = 3 * h * inter + ((2 * inter + h) if cfg.get("mlp_bias") else 0)
    layer = attn + mlp + 2 * h
    tied = cfg.get("tie_word_embeddings", kind == "qwen2")
    return vocab * h * (1 if tied else 2) + n_layers * layer + h


def reference_population(doc: dict, study_dir: Path) -> tuple[int, str]:
    """(the reference ES runs' population, where it came from): study.flops, else the run's config.json."""
    runs = [r for r in doc["study"].get("runs", []) if isinstance(r, dict) and r.get("group") == REFERENCE_GROUP]
    flops = doc["study"].get("flops") or {}
    flops = flops.get("runs", flops) if isinstance(flops, dict) else {}
    seen = {flops.get(r.get("label"), {}).get("population") for r in runs} - {None}
    if len(seen) == 1 and isinstance(next(iter(seen)), int):
        return next(iter(seen)), "analysis.json (study.flops)"
    for r in runs:
        f = study_dir / str(r.get("dir", "")) / "config.json"
        if r.get("dir") and f.is_file():
            try:
                n = json.loads(f.read_text(encoding="utf-8")).get("population")
            except (OSError, json.JSONDecodeError):
                continue
            if isinstance(n, int):
                return n, f"{Path(str(r['dir'])).as_posix()}/config.json"
    raise DeltalensError(f"{study_dir}: the reference ES runs' population is recorded neither in its analysis.json "
                         "nor in a run's config.json under it")


def _interval(c: dict) -> tuple[float | None, float | None, str]:
    if "ci_low_holm" in c or "ci_high_holm" in c:
        lo, hi, kind = c.get("ci_low_holm"), c.get("ci_high_holm"), "holm"
    else:
        lo, hi, kind = c.get("ci_low"), c.get("ci_high"), "95%"
    return (lo if _finite(lo) else None), (hi if _finite(hi) else None), kind


def n_needed(sizes: list[dict], reference: int, fraction: float) -> dict:
    """The N needed and its interval (module docstring) from `sizes` [{population, share, ci}] (ci bounds None:
    undefined) and the reference N. None throughout when no share is defined (the reference gain is not > 0)."""
    grid = sorted((s for s in sizes if s["population"] < reference), key=lambda s: s["population"])
    if grid and not any(_finite(s["share"]) for s in grid):
        return {"n_needed": None, "n_low": None, "n_high": None, "share": None, "ci": [None, None],
                "at_most": False, "low_censored": False}

    def first(pred):
        return next((s for s in grid if pred(s)), None)

    est = first(lambda s: _finite(s["share"]) and s["share"] >= fraction)
    low = first(lambda s: s["ci"][1] is None or s["ci"][1] >= fraction)
    high = first(lambda s: s["ci"][0] is not None and s["ci"][0] >= fraction)
    # the smallest N tested already reaches F: a smaller, untested N might too, so the N needed (or the interval's
    # lower end) is "at most" that N, not that N
    return {"n_needed": est["population"] if est else reference, "n_low": low["population"] if low else reference,
            "n_high": high["population"] if high else reference, "share": est["share"] if est else 1.0,
            "ci": est["ci"] if est else [1.0, 1.0], "at_most": bool(grid) and est is grid[0],
            "low_censored": bool(grid) and low is grid[0]}


def model_row(name: str, study_dir: Path, doc: dict, fraction: float) -> dict:
    """One model's row: its study, parameter count, reference N, each N's share and the N needed."""
    params, params_from = parameter_count(doc, study_dir)
    ref, ref_from = reference_population(doc, study_dir)
    sizes, kinds = [], set()
    for c in population_checks(doc):
        lo, hi, kind = _interval(c)
        kinds.add(kind)
        sizes.append({"population": c["population"], "share": c.get("estimate") if _finite(c.get("estimate")) else None,
                      "ci": [lo, hi]})
    cfg = doc["study"].get("config") or {}
    return {"study": name, "model": cfg.get("model", (doc.get("base") or {}).get("path")), "task": cfg.get("task"),
            "params": params, "params_from": params_from, "reference_population": ref, "reference_from": ref_from,
            "population_alpha": cfg.get("population_alpha", "fixed"),  # studies before the option: fixed
            "interval": "holm" if kinds == {"holm"} else "95%" if kinds == {"95%"} else "mixed",
            "sizes": sizes, **n_needed(sizes, ref, fraction)}


def scale_verdict(models: list[dict]) -> tuple[str, str]:
    """(verdict, reason) of "the N needed shrinks with model scale" over `models` sorted by size."""
    if len(models) < MIN_SIZES:
        return "unclear", f"needs {MIN_SIZES} model sizes (got {len(models)})"
    refs = sorted({m["reference_population"] for m in models})
    if len(refs) > 1:
        return "unclear", (f"the reference ES populations differ ({', '.join(map(str, refs))}): each model's N needed "
                           "is measured against a different gain")
    rules = sorted({m["population_alpha"] for m in models})
    if len(rules) > 1:
        return "unclear", ("the studies ran their extra ES runs under different --population-alpha rules "
                           f"({', '.join(rules)}): their N needed are not comparable")
    undefined = [m["study"] for m in models if m["n_needed"] is None]
    if undefined:
        return "unclear", f"no share of the reference gain is defined for {', '.join(undefined)} (its gain is not above 0)"
    ns = [m["n_needed"] for m in models]
    small, large = models[0], models[-1]
    # a lower end at the smallest N tested is censored (a smaller N might reach F): it cannot be "surely above"
    if all(b <= a for a, b in pairwise(ns)) and large["n_high"] < small["n_low"] and not small["low_censored"]:
        return "reproduced", (f"the N needed falls from {small['n_needed']} to {large['n_needed']} and the largest "
                              f"model's interval lies below the smallest's")
    if all(b >= a for a, b in pairwise(ns)) and large["n_low"] > small["n_high"] and not large["low_censored"]:
        return "contradicted", (f"the N needed rises from {small['n_needed']} to {large['n_needed']} and the largest "
                                f"model's interval lies above the smallest's")
    trend = " -> ".join(map(str, ns))
    return "unclear", f"the N needed by size, {trend}, does not surely change between the smallest and largest model"


def scale_analysis(study_dirs, fraction: float = DEFAULT_FRACTION) -> dict:
    """Claim 6 across the given studies (module docstring): per model its row, then the verdict. Everything is
    checked before anything is returned; one line for the first problem."""
    if not (_finite(fraction) and 0 < fraction <= 1):
        raise DeltalensError(f"--fraction must lie in (0, 1] (got {fraction})")
    dirs = list(study_dirs)
    if not dirs:
        raise DeltalensError("give at least one study directory")
    seen, rows = {}, []
    for given in dirs:
        d, doc = load_study(given)
        key = d.resolve()
        if key in seen:
            raise DeltalensError(f"{given} is given twice")
        seen[key] = given
        rows.append(model_row(str(given), d, doc, fraction))
    by_size: dict[int, dict] = {}
    for r in rows:
        if r["params"] in by_size:
            raise DeltalensError(f"{by_size[r['params']]['study']} and {r['study']} have the same parameter count "
                                 f"({r['params']}): give one study per model size")
        by_size[r["params"]] = r
    models = [by_size[k] for k in sorted(by_size)]
    verdict, reason = scale_verdict(models)
    return {"claim": 6, "fraction": fraction, "models": models, "verdict": verdict, "reason": reason,
            "rule": RULE.format(f=fraction, m=MIN_SIZES)}
