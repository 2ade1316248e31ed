"""The study section of an `analysis.json` as Markdown (`DIR/verdicts.md` of `deltalens study`), and a
sweep's results as Markdown (`DIR/sweep.md` of `deltalens sweep`).

Generated, never hand-written: docs/reproduction.md quotes this file as the study wrote it, so the
tables in the docs are the ones the verdict rule produced. Reads only JSON (no torch), like the HTML report.

    from deltalens.reports.markdown import study_markdown
    text = study_markdown(json.load(open("analysis.json")))
    text = sweep_markdown(json.load(open("sweep.json")))
"""

from __future__ import annotations

from typing import Any

from .common import PER_SEED_NOTE, as_dict, as_list, check_label, fmt_ci, fmt_g, num, per_seed_text


def _ci(lo: Any, hi: Any) -> str:
    return fmt_ci(lo, hi, missing="undefined")


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(head: list[str], rows: list[list[Any]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(_cell(c) for c in r) + " |" for r in rows)]


def effects_table(study: dict) -> list[str]:
    """Rows: methods; columns: each metric@K as 'method value (difference vs base [95% interval])'."""
    effects = as_dict(study.get("effects"))
    cols: list[str] = []
    methods: list[str] = []
    for key in effects:
        meth, col = str(key).split(":", 1)
        cols += [col] if col not in cols else []
        methods += [meth] if meth not in methods else []
    if not cols:
        return []
    cols.sort(key=lambda c: (not c.startswith("pass"), int(c.split("@")[1])))
    label = {c: c.replace("pass@", "Pass@").replace("maj@", "Maj@") for c in cols}
    base = ["base"] + [fmt_g(as_dict(effects.get(f"{methods[0]}:{c}")).get("base")) for c in cols]
    rows = [base]
    for meth in methods:
        row = [meth]
        for c in cols:
            e = as_dict(effects.get(f"{meth}:{c}"))
            ci = as_list(e.get("ci")) + [None, None]
            d = num(e.get("estimate"))
            row.append("—" if d is None else
                       f"{fmt_g(e.get('method'))} ({'+' if d >= 0 else ''}{fmt_g(d)} {_ci(ci[0], ci[1])})")
        rows.append(row)
    return _table(["model", *(label[c] for c in cols)], rows)


def adjusted(checks: list) -> bool:
    """Whether a study's checks carry Holm-adjusted verdicts (studies from before issue #34 do not)."""
    return any("p_holm" in as_dict(c) for c in checks)


def holm_cells(c: dict, missing: str = "undefined") -> list[str]:
    """The cells a Holm-adjusted check adds: the Monte Carlo SEs of its 95% bounds ("analytic" for a t or
    Fieller interval), its interval at the Holm level, its p-value and Holm's, its unadjusted verdict."""
    se = [num(c.get("mcse_low")), num(c.get("mcse_high"))]
    if None in se:
        mc = "—"
    elif se == [0.0, 0.0] and c.get("interval") != "bootstrap":
        mc = "analytic"
    else:
        mc = f"±{fmt_g(se[0])}, ±{fmt_g(se[1])}"
    level = num(c.get("holm_level"))
    held = fmt_ci(c.get("ci_low_holm"), c.get("ci_high_holm"), missing=missing)
    held += "" if level is None else f" at {100 * level:.4g}%"
    return [mc, held, f"{fmt_g(c.get('p_value'))} ({fmt_g(c.get('p_holm'))})", str(c.get("verdict_unadjusted", ""))]


HOLM_HEAD = ["MC SE of bounds", "Holm interval", "p (Holm)", "unadjusted verdict"]


def claims_table(study: dict) -> list[str]:
    """The verdict table; for a Holm-adjusted study also each check's MC SEs, Holm-level interval, p-values
    and unadjusted verdict, the verdict column being Holm's."""
    claims = [as_dict(cl) for cl in as_list(study.get("claims"))]
    holm = adjusted([c for cl in claims for c in as_list(cl.get("checks"))])
    extra = len(HOLM_HEAD) if holm else 0
    rows = []
    for cl in claims:
        rows.append([f"**{cl.get('id')}**", f"**{cl.get('title')}**", "", "", "", *[""] * extra, "",
                     f"**{cl.get('verdict')}**"])
        if cl.get("note"):  # a paper claim the study did not run: the option that runs it
            rows.append(["", str(cl.get("note")), "", "", "", *[""] * extra, "", ""])
        for c in as_list(cl.get("checks")):
            c = as_dict(c)
            cells = holm_cells(c) if holm else []
            rows.append(["", check_label(c), fmt_g(c.get("estimate")), per_seed_text(c),
                         _ci(c.get("ci_low"), c.get("ci_high")), *cells[:3],
                         f"{c.get('direction')} vs {fmt_g(num(c.get('null')) or 0.0)}", *cells[3:], c.get("verdict")])
    if holm:
        return _table(["#", "claim / check", "estimate", "per seed", "95% interval (unadjusted)", *HOLM_HEAD[:3],
                       "paper's direction", HOLM_HEAD[3], "verdict (Holm)"], rows)
    return _table(["#", "claim / check", "estimate", "per seed", "95% interval", "paper's direction", "verdict"], rows)


def study_markdown(analysis: dict) -> str:
    """The study's settings, Pass@K/Maj@K effects against the base, and the verdict table, as Markdown."""
    study = as_dict(analysis.get("study"))
    cfg = as_dict(study.get("config"))
    runs = as_list(study.get("runs"))
    seeds = cfg.get("seeds")
    lines = [(f"Study of `{cfg.get('model')}` on `{cfg.get('task')}`: methods {', '.join(map(str, as_list(cfg.get('methods'))))}; "
             f"training seeds {', '.join(map(str, as_list(seeds)))}; budget {fmt_g(cfg.get('budget'))} units per method "
             f"(preset {cfg.get('preset')}); {len(runs)} runs; test problems: "
             f"{cfg.get('limit') or 'the whole test split'}, {cfg.get('samples')} samples at T = "
             f"{cfg.get('temperature')}"
             f"{' (also ' + ', '.join(str(t) for t in as_list(cfg.get('temperatures')) if t != cfg.get('temperature')) + ')' if len(as_list(cfg.get('temperatures'))) > 1 else ''}; base evaluated with {cfg.get('base_seeds')} sampling seeds; "
             f"{cfg.get('resamples')} bootstrap resamples; {fmt_g(study.get('seconds'))} s for this pass."), ""]
    eff = effects_table(study)
    if eff:
        lines += [("Pass@K and Maj@K (mean over seeds; in brackets the difference from the base and its 95% interval "
                   "over problems and seeds):"), "", *eff, ""]
    if study.get("rule"):
        lines += [f"Verdict rule: {study['rule']}", ""]
    if (study.get("flops") or {}).get("text"):
        lines += [f"Compute: {study['flops']['text']}", ""]
    lines += [PER_SEED_NOTE, ""]
    lines += claims_table(study)
    return "\n".join(lines) + "\n"


# a sweep trained with one seed per point: its intervals hold no run-to-run variation
ONE_SEED_NOTE = ("One training seed per point: the intervals are over validation problems only and do not carry "
                 "the variation between training runs, so a point marked worse than the best may differ from it "
                 "by no more than two seeds of one setting do (an example: benchmarks/README.md, \"Whole runs "
                 "under autocast\"); add --seeds to tell.")


def sweep_markdown(sweep: dict) -> str:
    """A sweep's settings and one row per grid point, best first (`deltalens sweep`, DIR/sweep.md)."""
    ev, base = as_dict(sweep.get("evaluation")), as_dict(sweep.get("base"))
    fixed = ", ".join(f"{k}={v}" for k, v in as_dict(sweep.get("fixed")).items()) or "none"
    lines = [(f"Sweep of `{sweep.get('method')}` on `{sweep.get('model')}`, task `{sweep.get('task')}`, preset "
              f"{sweep.get('preset')}, fixed options: {fixed}. Scored on {ev.get('problems')} **validation** problems "
              f"x {ev.get('samples')} samples at T = {ev.get('temperature')} (chat template {ev.get('chat_template')}), "
              f"training seeds {', '.join(map(str, as_list(ev.get('seeds'))))}; base Pass@1 "
              f"{fmt_g(base.get('pass_at_1'))}; {fmt_g(sweep.get('seconds'))} s for this pass."), ""]
    rows = []
    for p in as_list(sweep.get("points")):
        p = as_dict(p)
        vb, vbest = as_list(p.get("vs_base_ci")) + [None, None], as_list(p.get("vs_best_ci")) + [None, None]
        best = p.get("name") == sweep.get("best")
        rows.append([f"**{p.get('name')}**" if best else p.get("name"), fmt_g(p.get("pass_at_1")),
                     f"{fmt_g(p.get('vs_base'))} {_ci(vb[0], vb[1])}",
                     "best" if best else f"{fmt_g(p.get('vs_best'))} {_ci(vbest[0], vbest[1])}",
                     "yes" if p.get("within_noise_of_best") else "no", fmt_g(p.get("mean_reward")),
                     fmt_g(p.get("format_rate"))])
    lines += _table(["point", "validation Pass@1", "minus base [95%]", "minus best [95%]", "within noise of best",
                     "mean reward", "format rate"], rows)
    lines += ["", ("Intervals: paired bootstrap over validation problems and the point's training seeds "
                   "(deltalens.analysis.stats). Points within noise of the best cannot be told apart on these "
                   "problems.")]
    if len(as_list(ev.get("seeds"))) == 1:
        lines += ["", ONE_SEED_NOTE]
    return "\n".join(lines) + "\n"
