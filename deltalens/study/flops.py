"""What each run of a study spent, beside what the FLOP-matched budget charged it (issue #34, item 8).

The budget (`deltalens.training.budget`) charges units per response: ES 2, GRPO 8, whatever the responses'
lengths, and leaves out GRPO's KL reference forward pass. `run_flops` measures, per run, from its
config.json and metrics.jsonl (one row per iteration/step):

    charged_units      what the budget charged: GRPO's last `units` row (else steps x P x 8G), ES
                       iterations x P x 2N
    measured_units     the same per-response accounting with every pass counted (`grpo_units_per_response`:
                       + 2 per response for the reference model when beta > 0, more passes when μ > 1)
    reference_units    the part of measured_units that is GRPO's reference pass (0 for ES)
    completion_tokens  mean response length in tokens over the run (the rows' `completion_length`: GRPO
                       records TRL's mean per step, ES the mean over its iteration's members and prompts;
                       None, "not recorded", for a run whose rows have none, e.g. one from before ES
                       recorded it)
    token_units        the measured cost in token units (~FLOPs / params): per iteration/step, its
                       responses x passes per token x that row's mean length, summed
                       (`grpo_token_units_per_step`, `es_token_units_per_iteration`); None where lengths are
                       not recorded. A row without a length counts at the mean of the rows that have one
                       (`lengths_recorded` says how many did)

A chain (es-grpo) is the sum of its stages (each stage's own directory). `study_flops` puts every run of
the plan side by side and states whether "FLOP-matched" held on the measured figures: each group's mean
token_units against the ES runs', within FLOP_TOLERANCE (10%); "not recorded" when a group's lengths are
missing, with what the per-response accounting alone shows.
"""

from __future__ import annotations

from pathlib import Path

from deltalens.errors import DeltalensError
from deltalens.io.runs import RunDir
from deltalens.methods import chain_stages
from deltalens.training.budget import (
    GRPO_UNITS_PER_RESPONSE,
    REFERENCE_UNITS_PER_RESPONSE,
    es_token_units_per_iteration,
    es_units,
    grpo_token_units_per_step,
    grpo_units,
    grpo_units_per_response,
)

FLOP_TOLERANCE = 0.10  # "FLOP-matched" holds when every method's measured cost is within 10% of ES's
NOT_RECORDED = "not recorded"


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _training_rows(run: RunDir) -> list[dict]:
    """One row per trained iteration/step (the last written wins: a resumed run's rows are not counted twice)."""
    rows = {}
    for r in run.metrics():
        if isinstance(r.get("iteration"), int) and r["iteration"] > 0 and "reward_mean" in r:
            rows[r["iteration"]] = r
    return [rows[k] for k in sorted(rows)]


def _empty(method: str) -> dict:
    return {"method": method, "iterations": 0, "charged_units": None, "measured_units": None, "reference_units": 0.0,
            "completion_tokens": None, "token_units": None, "lengths_recorded": 0, "missing": []}


def run_flops(run_dir, method: str) -> dict:
    """The measured cost of one run (module docstring)."""
    run = RunDir(run_dir)
    try:
        cfg = run.config()
    except DeltalensError:
        cfg = {}
    stages = chain_stages(method) if isinstance(method, str) else None
    if stages is not None:
        return _chain_flops(Path(run_dir), method, cfg)
    out = _empty(method)
    if method not in ("es", "grpo"):
        out["missing"].append(f"the cost of method {method!r} (no accounting here)")
        return out
    rows = _training_rows(run)
    out["iterations"] = len(rows)
    try:
        if method == "es":
            P, N = cfg["prompts_per_iteration"], cfg["population"]
            out.update(population=N, prompts=P)
            out["charged_units"] = out["measured_units"] = float(es_units(len(rows), P, N))
        else:
            P, G = cfg["prompts_per_step"], cfg["num_generations"]
            beta, mu = cfg.get("beta", 0.0), cfg.get("num_iterations", 1)
            out.update(prompts=P, num_generations=G, beta=beta, num_iterations=mu)
            units = [r["units"] for r in rows if _num(r.get("units"))]
            out["charged_units"] = float(units[-1]) if units else float(grpo_units(len(rows), P, G))
            responses = len(rows) * P * G
            per = grpo_units_per_response(beta, mu)
            out["measured_units"] = float(per * responses)
            out["reference_units"] = float(per * responses - grpo_units_per_response(0.0, mu) * responses)
    except (DeltalensError, KeyError, TypeError):
        out["missing"].append("the run's counts (config.json lacks its prompts/population or generations)")
        return out
    lengths = [r.get("completion_length") if _num(r.get("completion_length")) else None for r in rows]
    known = [x for x in lengths if x is not None]
    out["lengths_recorded"] = len(known)
    if not known:
        out["missing"].append(f"completion lengths ({method} metrics rows record none): {NOT_RECORDED}")
        return out
    mean = sum(known) / len(known)

    def cost(length: float) -> float:  # token units of one iteration/step whose responses averaged `length`
        if method == "es":
            return es_token_units_per_iteration(out["prompts"], out["population"], length)
        return grpo_token_units_per_step(out["prompts"], out["num_generations"], length, beta=out["beta"],
                                         num_iterations=out["num_iterations"])

    out["completion_tokens"] = mean
    out["token_units"] = sum(cost(mean if x is None else x) for x in lengths)
    if len(known) < len(rows):
        out["missing"].append(f"completion lengths of {len(rows) - len(known)} of {len(rows)} rows (counted at "
                              "the mean of the others)")
    return out


def _chain_flops(run_dir: Path, method: str, cfg: dict) -> dict:
    """A chain's cost: the sum of its stages' (config.json's `stages`, each run in its own directory)."""
    out = _empty(method)
    stages = cfg.get("stages") if isinstance(cfg.get("stages"), list) else []
    if not stages:
        out["missing"].append("the chain's stages (its config.json lists none)")
        return out
    parts = [run_flops(run_dir / s["dir"], s["method"]) for s in stages]
    out["stages"] = parts
    for key in ("iterations", "charged_units", "measured_units", "reference_units", "token_units"):
        vals = [p[key] for p in parts]
        out[key] = None if any(v is None for v in vals) else sum(vals)
    out["lengths_recorded"] = sum(p["lengths_recorded"] for p in parts)
    out["missing"] = [f"{p['method']} stage: {m}" for p in parts for m in p["missing"]]
    return out


def _ratio(a, b):
    return a / b if a is not None and b else None


def study_flops(plan: list[dict], tolerance: float = FLOP_TOLERANCE) -> dict:
    """Every run's `run_flops`, each group's mean measured cost against the ES runs', and whether "FLOP-matched"
    held on measured figures within `tolerance` (`matched`: True, False, or None = not recorded), in words
    (`text`). `plan`: the study's runs (label, group, method, dir)."""
    return flops_summary({r["label"]: run_flops(r["dir"], r["method"]) for r in plan}, plan, tolerance)


def flops_summary(runs: dict, plan: list[dict], tolerance: float = FLOP_TOLERANCE) -> dict:
    """`study_flops` from each run's `run_flops` (label -> dict) already measured: what a merged study
    (`deltalens.study.merge`) recomputes from its pieces' per-run figures."""
    groups: dict[str, list[dict]] = {}
    for r in plan:
        groups.setdefault(r["group"], []).append(runs[r["label"]])

    def mean(vals):
        return None if not vals or any(v is None for v in vals) else sum(vals) / len(vals)

    summary = {g: {"runs": len(fs), "charged_units": mean([f["charged_units"] for f in fs]),
                   "measured_units": mean([f["measured_units"] for f in fs]),
                   "token_units": mean([f["token_units"] for f in fs]),
                   "completion_tokens": mean([f["completion_tokens"] for f in fs])} for g, fs in groups.items()}
    ref = summary.get("es")
    for s in summary.values():
        s["measured_over_charged"] = _ratio(s["measured_units"], s["charged_units"])
        s["tokens_vs_es"] = _ratio(s["token_units"], ref["token_units"]) if ref else None
    out = {"tolerance": tolerance, "reference": "es" if ref else None, "groups": summary, "runs": runs}
    out["matched"], out["text"] = _verdict(summary, tolerance)
    return out


def _g(x) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def _verdict(summary: dict, tol: float) -> tuple[bool | None, str]:
    if "es" not in summary or len(summary) < 2:
        return None, "FLOP matching: one method only, nothing to compare."
    others = [g for g in summary if g != "es"]
    per_response = ", ".join(f"{g} {summary[g]['measured_over_charged']:.3g}x" for g in summary
                             if summary[g]["measured_over_charged"] not in (None, 1.0))
    charge = (f" Counting every pass per response, the runs spent this multiple of what the budget charged them "
              f"(the KL reference pass: {(GRPO_UNITS_PER_RESPONSE + REFERENCE_UNITS_PER_RESPONSE) / GRPO_UNITS_PER_RESPONSE:g}x for GRPO "
              f"with beta > 0): {per_response}." if per_response else "")
    unknown = [g for g in summary if summary[g]["token_units"] is None]
    if unknown:
        return None, (f"FLOP-matched on measured figures (tolerance {tol:.0%}): {NOT_RECORDED} (the metrics of "
                      f"{', '.join(unknown)} record no completion lengths), so the budget's match is a statement "
                      f"about responses, not tokens.{charge}")
    ratios = {g: summary[g]["tokens_vs_es"] for g in others}
    if any(r is None for r in ratios.values()):
        return None, (f"FLOP-matched on measured figures (tolerance {tol:.0%}): {NOT_RECORDED} (no ES token cost "
                      f"to compare with).{charge}")
    shown = ", ".join(f"{g} {r:.3g}x" for g, r in ratios.items())
    ok = all(abs(r - 1) <= tol for r in ratios.values())
    lengths = ", ".join(f"{g} {_g(summary[g]['completion_tokens'])}" for g in summary)
    return ok, (f"FLOP-matched on measured figures (tolerance {tol:.0%}): {'held' if ok else 'did not hold'}: "
                f"measured cost (token units: responses x passes x completion tokens) against the ES runs': "
                f"{shown}; mean completion tokens {lengths}.{charge}")
