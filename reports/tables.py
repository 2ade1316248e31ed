"""HTML tables of the report. Every user-supplied string goes through `esc`."""

from __future__ import annotations

from .common import (
    BASE_COLOR,
    PER_SEED_NOTE,
    Context,
    as_dict,
    as_list,
    check_label,
    esc,
    fmt_ci,
    fmt_g,
    fmt_int,
    fmt_pct,
    fmt_pp,
    num,
    per_seed_text,
    sort_ks,
)
from .metrics import js_shown, ratio_rows, sparsity_keeping_gain

MAX_ROWS = 300


def _swatch(ctx: Context, label: str) -> str:
    return f'<span class="swatch" style="background:{ctx.color(label)}"></span>'


def _delta(d: float | None, good_up: bool = True) -> str:
    if d is None:
        return ""
    cls = "flat" if abs(d) < 5e-4 else ("up" if (d > 0) == good_up else "down")
    return f'<span class="delta {cls}">{esc(fmt_pp(d))}</span>'


def _value_with_delta(value: float | None, base: float | None) -> str:
    if value is None:
        return '<span class="na">—</span>'
    out = esc(fmt_pct(value))
    if base is not None:
        out += " " + _delta(value - base)
    return out


def base_pass_at_k(ctx: Context) -> tuple[dict, int]:
    """The base's Pass@K for tables, and over how many sampling seeds it is a mean.

    A study evaluates the base with several sampling seeds and compares every method with their mean
    (study.effects[...].base); the analysis's evals.base is seed 0 only. Where the study's means exist they
    are used, so the summary agrees with the verdicts; otherwise evals.base.
    """
    evals = as_dict(ctx.analysis.get("evals"))
    bk = ctx.base_key(evals)
    own = dict(as_dict(as_dict(evals.get(bk)).get("pass_at_k"))) if bk else {}
    study = as_dict(ctx.analysis.get("study"))
    seeds = num(as_dict(study.get("config")).get("base_seeds"))
    one_base = as_dict(as_dict(study.get("base")).get("pass_at_k"))
    if seeds and one_base:  # the study's one base definition (study.base), as the figure and verdicts use
        return {**own, **{str(k): num(v) for k, v in one_base.items()}}, int(seeds)
    if seeds and seeds > 1:
        means = {}
        for key, e in as_dict(study.get("effects")).items():
            metric = str(key).split(":", 1)[-1]
            if metric.startswith("pass@") and num(as_dict(e).get("base")) is not None:
                means[metric[5:]] = num(as_dict(e)["base"])
        if means:
            return {**own, **means}, int(seeds)
    return own, 1


def summary_table(ctx: Context) -> str:
    a = ctx.analysis
    evals = as_dict(a.get("evals"))
    diff = as_dict(a.get("diff"))
    sparsify = as_dict(a.get("sparsify"))
    ks = sort_ks(k for ev in evals.values() for k in as_dict(as_dict(ev).get("pass_at_k"))) or ["1", "16", "32"]
    bk = ctx.base_key(evals)
    base_pk, base_seeds = base_pass_at_k(ctx)
    head = ["Model"] + [f"Pass@{esc(k)}" for k in ks] + [
        '‖θ−θ₀‖/‖θ₀‖', 'Sparsity keeping ≥90% of Pass@1 gain']
    tips = [""] + ["share of problems solved by at least one of K samples; change vs base in points"] * len(ks) + [
        ("relative distance from the initial weights (whole model); ratios between methods are under the distance "
        "figure"),
        ("largest fraction of Δ that can be zeroed (smallest entries first) keeping 90% of the Pass@1 gain; "
         "interpolated between the tested sparsities")]
    rows = []
    if bk is not None:
        tag = f"base · mean of {base_seeds} sampling seeds" if base_seeds > 1 else "base"
        cells = [f'<th scope="row">{_swatch(ctx, "base")}{esc(ctx.base_label)} <span class="tag">{esc(tag)}</span></th>']
        cells += [f'<td class="num">{esc(fmt_pct(base_pk.get(k)))}</td>' for k in ks]
        cells += ['<td class="num na">—</td>'] * 2
        rows.append("<tr>" + "".join(cells) + "</tr>")

    def rel_of(label):
        return num(as_dict(as_dict(diff.get(label)).get("whole")).get("rel_l2"))

    for method, members in ctx.methods.items():
        if len(members) > 1:  # the method's mean over its seeds first, then its runs
            cells = [(f'<th scope="row"><span class="swatch" style="background:{ctx.method_colors[method]}"></span>'
                     f'{esc(method)} <span class="tag">mean of {len(members)} seeds</span></th>')]
            for k in ks:
                vals = [num(as_dict(as_dict(evals.get(m)).get("pass_at_k")).get(k)) for m in members]
                mean = sum(vals) / len(vals) if vals and all(v is not None for v in vals) else None
                cells.append(f'<td class="num">{_value_with_delta(mean, num(base_pk.get(k)))}</td>')
            rels = [rel_of(m) for m in members]
            rel = sum(rels) / len(rels) if all(v is not None for v in rels) else None
            cells.append(f'<td class="num">{esc(fmt_g(rel))}</td><td class="num na">—</td>')
            rows.append('<tr class="method-mean">' + "".join(cells) + "</tr>")
        for label in members:
            info = ctx.model_info.get(label, {})
            meth = info.get("method")
            tag = f' <span class="tag">{esc(meth)}</span>' if meth and str(meth) != label else ""
            cells = [f'<th scope="row">{_swatch(ctx, label)}{esc(label)}{tag}</th>']
            pk = as_dict(as_dict(evals.get(label)).get("pass_at_k"))
            for k in ks:
                cells.append(f'<td class="num">{_value_with_delta(num(pk.get(k)), num(base_pk.get(k)))}</td>')
            cells.append(f'<td class="num">{esc(fmt_g(rel_of(label)))}</td>')
            sp = sparsify.get(label)
            if isinstance(sp, dict):
                s90, qual = sparsity_keeping_gain(sp)
                text = f"{qual}{s90:.0%}" if s90 is not None else f"n/a ({qual})"
            else:
                text = "n/a"
            cells.append(f'<td class="num">{esc(text)}</td>')
            rows.append(("<tr class=\"seed-run\">" if len(members) > 1 else "<tr>") + "".join(cells) + "</tr>")
    thead = "".join(f'<th scope="col" title="{esc(t)}">{h}</th>' for h, t in zip(head, tips))
    note = ""
    if base_seeds > 1:
        note = (f'<p class="note">The base row is the mean over the {base_seeds} sampling seeds the base was '
                'evaluated with, and every change from base is against it (as in the verdicts).</p>')
    return (f'<div class="table-wrap"><table class="summary"><thead><tr>{thead}</tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table></div>{note}')


def ratio_table(ctx: Context) -> str:
    """Distance ratios per pair of methods (mean and range over pairs of runs), below the distance figure."""
    rows = ratio_rows(ctx)
    if not rows:
        return ""
    multi = ctx.multi_seed
    body = []
    for r in rows:
        a = f'<span class="swatch" style="background:{ctx.method_colors.get(r["a"], BASE_COLOR)}"></span>{esc(r["a"])}'
        b = f'<span class="swatch" style="background:{ctx.method_colors.get(r["b"], BASE_COLOR)}"></span>{esc(r["b"])}'
        cells = [f'<th scope="row">{a} / {b}</th>', f'<td class="num"><b>{esc(fmt_g(r["mean"]))}×</b></td>']
        if multi:
            rng = "—" if r["pairs"] < 2 else f'{fmt_g(r["min"])}× – {fmt_g(r["max"])}×'
            matched = "—" if r["matched"] is None else f'{fmt_g(r["matched"])}× ({r["n_matched"]})'
            cells += [f'<td class="num">{esc(rng)}</td>', f'<td class="num">{esc(matched)}</td>',
                      f'<td class="num">{r["pairs"]}</td>']
        body.append("<tr>" + "".join(cells) + "</tr>")
    head = ["Methods (farther / nearer)", "Ratio of ‖θ−θ₀‖/‖θ₀‖"]
    if multi:
        head += ["Range over run pairs", "Seed-matched mean (pairs)", "Run pairs"]
    thead = "".join(f'<th scope="col">{esc(h)}</th>' for h in head)
    note = ("Mean of rel_l2(a) / rel_l2(b) over every pair of a run of a and a run of b; seed-matched: over "
            "a-s0 / b-s0, a-s1 / b-s1, ... (what the study's claim 2 tests)." if multi else
            "rel_l2 of the first method divided by that of the second.")
    return (f'<div class="table-wrap"><table class="data ratios" id="ratio-table"><thead><tr>{thead}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table></div><p class="note">{esc(note)}</p>')


def inputs_table(ctx: Context) -> str:
    diff = as_dict(ctx.analysis.get("diff"))
    base_path = esc(ctx.base_path if ctx.base_path is not None else "—")
    rows = [(f'<tr><th scope="row">{_swatch(ctx, "base")}{esc(ctx.base_label)}</th><td>base</td><td>—</td>'
             f'<td class="path">{base_path}</td><td>—</td></tr>')]
    for label in ctx.models:
        info = ctx.model_info.get(label, {})
        d = as_dict(diff.get(label))
        params = f"{fmt_int(d.get('n_params'))} · {esc(d.get('dtype'))}" if d else "—"
        rows.append(f'<tr><th scope="row">{_swatch(ctx, label)}{esc(label)}</th><td>{esc(info.get("kind") or "—")}</td>'
                    f'<td>{esc(info.get("method") or "—")}</td><td class="path">{esc(info.get("path") or "—")}</td>'
                    f'<td class="num">{params}</td></tr>')
    return ('<div class="table-wrap"><table class="inputs"><thead><tr><th scope="col">Label</th>'
            '<th scope="col">Kind</th><th scope="col">Method</th><th scope="col">Path</th>'
            '<th scope="col">Parameters compared</th></tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table></div>')


def warnings_list(ctx: Context) -> str:
    items = []
    diff = as_dict(ctx.analysis.get("diff"))
    for label in ctx.models:
        for w in as_list(as_dict(diff.get(label)).get("warnings")):
            items.append(f"<li><b>{esc(label)}</b>: {esc(w)}</li>")
    if not items:
        return ""
    return f'<div class="warn"><b>Warnings from <code>deltalens diff</code></b><ul>{"".join(items)}</ul></div>'


VERDICT_CLASS = {"reproduced": "up", "contradicted": "down", "mixed": "flat", "unclear": "flat"}


def claims_table(ctx: Context) -> str | None:
    """The study's verdicts: one row per claim, then its checks (estimate, 95% interval, paper's direction);
    for a Holm-adjusted study also each check's Monte Carlo SEs, Holm-level interval, p-values and unadjusted
    verdict, the verdict column being Holm's."""
    from .markdown import HOLM_HEAD, adjusted, holm_cells

    study = as_dict(ctx.analysis.get("study"))
    claims = as_list(study.get("claims"))
    if not claims:
        return None
    holm = adjusted([c for cl in claims for c in as_list(as_dict(cl).get("checks"))])
    rows = []
    for cl in claims:
        cl = as_dict(cl)
        v = str(cl.get("verdict"))
        rows.append(f'<tr class="claim"><th scope="row" colspan="{9 if holm else 5}">({esc(cl.get("id"))}) '
                    f'{esc(cl.get("title"))}</th>'
                    f'<td><span class="delta {VERDICT_CLASS.get(v, "flat")}">{esc(v)}</span></td></tr>')
        if cl.get("note"):  # a paper claim the study did not run: the option that runs it
            rows.append(f'<tr><td colspan="{10 if holm else 6}">{esc(cl.get("note"))}</td></tr>')
        for c in as_list(cl.get("checks")):
            c = as_dict(c)
            cv = str(c.get("verdict"))
            null = num(c.get("null")) or 0.0
            cells = holm_cells(c, missing="—") if holm else []
            rows.append(f'<tr><td>{esc(check_label(c))}</td><td class="num">{esc(fmt_g(c.get("estimate")))}</td>'
                        f'<td class="num">{esc(per_seed_text(c))}</td>'
                        f'<td class="num">{esc(fmt_ci(c.get("ci_low"), c.get("ci_high")))}</td>'
                        + "".join(f'<td class="num">{esc(x)}</td>' for x in cells[:3]) +
                        f'<td class="num">{esc(c.get("direction"))} vs {esc(fmt_g(null))}</td>'
                        + "".join(f"<td>{esc(x)}</td>" for x in cells[3:]) +
                        f'<td><span class="delta {VERDICT_CLASS.get(cv, "flat")}">{esc(cv)}</span></td></tr>')
    names = (("Check", "Estimate", "Per training seed", "95% interval (unadjusted)", *HOLM_HEAD[:3],
              "Paper's direction", HOLM_HEAD[3], "Verdict (Holm)") if holm else
             ("Check", "Estimate", "Per training seed", "95% interval", "Paper's direction", "Verdict"))
    head = "".join(f"<th>{h}</th>" for h in names)
    rule = f'<p class="caption">{esc(study.get("rule"))}</p>' if study.get("rule") else ""
    rule += f'<p class="caption">{esc(PER_SEED_NOTE)}</p>'
    flops = as_dict(study.get("flops")).get("text")
    rule += f'<p class="caption">Compute: {esc(flops)}</p>' if flops else ""
    return f'{rule}<table class="data"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def held_out_table(ctx: Context) -> str | None:
    held = as_dict(ctx.analysis.get("held_out"))
    entries = [(k, b) for k, b in ctx.with_base(held) if isinstance(held[k], dict)]
    if not entries:
        return None
    tasks: dict[str, list[str]] = {}
    for key, _ in entries:
        for task, scores in held[key].items():
            tasks.setdefault(str(task), [])
            tasks[task] = sort_ks(tasks[task] + list(as_dict(scores)))
    bk = ctx.base_key(held)
    top = "".join(f'<th scope="colgroup" colspan="{max(1, len(ks))}" class="task">{esc(t)}</th>'
                  for t, ks in tasks.items())
    sub = "".join(f'<th scope="col">Pass@{esc(k)}</th>' for ks in tasks.values() for k in (ks or ["—"]))
    rows = []
    for key, is_base in entries:
        name = esc(ctx.display(key)) + (' <span class="tag">base</span>' if is_base else "")
        cells = [f'<th scope="row">{_swatch(ctx, key)}{name}</th>']
        for task, ks in tasks.items():
            scores = as_dict(held[key].get(task))
            base_scores = as_dict(as_dict(held.get(bk)).get(task)) if bk and not is_base else {}
            for k in ks or ["—"]:
                v = num(scores.get(k))
                cells.append(f'<td class="num">{_value_with_delta(v, num(base_scores.get(k)))}</td>')
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return (f'<div class="table-wrap"><table class="heldout"><thead><tr><th rowspan="2" scope="col">Model</th>{top}'
            f'</tr><tr>{sub}</tr></thead><tbody>{"".join(rows)}</tbody></table></div>')


def _truncation_note(total: int) -> str:
    return (f'<p class="note">Showing the first {MAX_ROWS} of {total} rows; all of them are in analysis.json.</p>'
            if total > MAX_ROWS else "")


def per_problem_table(ctx: Context) -> str:
    evals = as_dict(ctx.analysis.get("evals"))
    entries = [k for k, _ in ctx.with_base(evals) if as_list(as_dict(evals[k]).get("per_problem"))]
    if not entries:
        return ""
    problems: dict[str, dict] = {}
    for key in entries:
        for p in as_list(evals[key]["per_problem"]):
            if not isinstance(p, dict):
                continue
            prompt = str(p.get("prompt", ""))
            row = problems.setdefault(prompt, {"answer": p.get("answer"), "by": {}})
            row["by"][key] = p
    head = "".join(f"<th scope=\"col\">{_swatch(ctx, k)}{esc(ctx.display(k))}</th>" for k in entries)
    rows = []
    for i, (prompt, row) in enumerate(list(problems.items())[:MAX_ROWS]):
        cells = [(f'<td class="num">{i + 1}</td><td class="prompt"><code>{esc(prompt)}</code></td>'
                  f'<td><code>{esc(row["answer"])}</code></td>')]
        for key in entries:
            p = row["by"].get(key)
            c, n = (num(p.get("correct")), num(p.get("n"))) if p else (None, None)
            if c is None or not n:
                cells.append('<td class="num na">—</td>')
                continue
            frac = c / n
            maj = p.get("majority")
            title = f"majority answer: {maj}" if maj is not None else ""
            cells.append(f'<td class="num cellbar" style="--frac:{frac:.3f}" title="{esc(title)}">'
                         f'{int(c)}/{int(n)}</td>')
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return (f'<details class="more"><summary>Per-problem results ({len(problems)} problems)</summary>'
            f'{_truncation_note(len(problems))}'
            f'<div class="table-wrap scroll"><table class="perproblem"><thead><tr><th scope="col">#</th>'
            f'<th scope="col">Prompt</th><th scope="col">Answer</th>{head}</tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table></div>'
            '<p class="note">Cells show correct samples / samples; the shading is the fraction correct. Hover a '
            'cell for the majority answer.</p></details>')


def per_prompt_table(ctx: Context) -> str:
    div = as_dict(ctx.analysis.get("diversity"))
    labels = [label for label in ctx.models if as_list(as_dict(div.get(label)).get("per_prompt"))]
    if not labels:
        return ""
    prompts: dict[str, dict] = {}
    for label in labels:
        for p in as_list(div[label]["per_prompt"]):
            if isinstance(p, dict):
                prompts.setdefault(str(p.get("prompt", "")), {})[label] = p
    per_row = {"mean": "js", "se": "js_se", "mi": "js_mi", "mi_se": "js_mi_se"}
    # each column names the JS estimator it shows (reports.metrics.js_shown)
    names = {label: js_shown(next((p for p in as_list(div[label]["per_prompt"]) if isinstance(p, dict)), {}),
                             div[label], **per_row)[2] for label in labels}
    head = "".join(f"<th scope=\"col\">{_swatch(ctx, label)}{esc(label)} JS ({esc(names[label])})</th>"
                   for label in labels)
    rows = []
    for prompt, by in list(prompts.items())[:MAX_ROWS]:
        cells = [f'<td class="prompt"><code>{esc(prompt)}</code></td>']
        for label in labels:
            p = by.get(label, {})
            js, se, _ = js_shown(p, div[label], **per_row)
            text = "—" if js is None else fmt_g(js) + (f" ± {fmt_g(se)}" if se is not None else "")
            cells.append(f'<td class="num">{esc(text)}</td>')
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return (f'<details class="more"><summary>Per-prompt divergence ({len(prompts)} prompts)</summary>'
            f'{_truncation_note(len(prompts))}'
            f'<div class="table-wrap scroll"><table class="perprompt"><thead><tr><th scope="col">Prompt</th>{head}'
            f'</tr></thead><tbody>{"".join(rows)}</tbody></table></div></details>')


COMPLETION_PROBLEMS = 4   # problems shown in "Sample completions"
COMPLETIONS_PER_MODEL = 2
COMPLETION_CHARS = 600    # a completion is cut after this many characters (the rest is in analysis.json)


def _completion_items(row: dict) -> list[tuple[str, bool | None]]:
    """(text, correct or None) of a per-problem row's kept completions.

    `completions` holds strings (or {"text", "correct"} objects); `completions_correct`, when present, marks
    the strings in the same order. Unmarked completions are shown without a mark.
    """
    marks = as_list(row.get("completions_correct"))
    out = []
    for i, c in enumerate(as_list(row.get("completions"))):
        if isinstance(c, dict):
            text, ok = c.get("text"), c.get("correct")
        else:
            text, ok = c, marks[i] if i < len(marks) else None
        if isinstance(text, str):
            out.append((text, ok if isinstance(ok, bool) else None))
    return out


def completions_section(ctx: Context) -> str:
    """Sample completions for the first few problems: the base and one run per method, escaped text."""
    evals = as_dict(ctx.analysis.get("evals"))
    bk = ctx.base_key(evals)
    shown = ([(bk, ctx.display(bk))] if bk else []) + [
        (members[0], members[0] if len(members) == 1 else f"{members[0]} ({method})")
        for method, members in ctx.methods.items() if members[0] in evals]
    by_prompt: dict[str, dict] = {}
    for key, _ in shown:
        for row in as_list(as_dict(evals.get(key)).get("per_problem")):
            if isinstance(row, dict) and _completion_items(row):
                by_prompt.setdefault(str(row.get("prompt", "")), {"answer": row.get("answer"), "by": {}})["by"][key] = row
    if not by_prompt:
        return ('<p class="note" id="no-completions">No sample completions in this analysis: evaluations keep '
                'them when asked to (per_problem[].completions).</p>')
    blocks = []
    for prompt, entry in list(by_prompt.items())[:COMPLETION_PROBLEMS]:
        items = []
        for key, name in shown:
            row = entry["by"].get(key)
            if row is None:
                continue
            cs = []
            for text, ok in _completion_items(row)[:COMPLETIONS_PER_MODEL]:
                mark = ('<span class="mark ok" title="correct">✓</span>' if ok else
                        '<span class="mark bad" title="incorrect">✗</span>' if ok is False else
                        '<span class="mark na" title="not scored">·</span>')
                cut = text if len(text) <= COMPLETION_CHARS else text[:COMPLETION_CHARS] + " …"
                cs.append(f'<li>{mark}<pre class="completion">{esc(cut)}</pre></li>')
            c, n = num(row.get("correct")), num(row.get("n"))
            score = f" · {int(c)}/{int(n)} correct" if c is not None and n else ""
            items.append(f'<div class="comp-model"><h4>{_swatch(ctx, key)}{esc(name)}{esc(score)}</h4>'
                         f'<ul class="comps">{"".join(cs)}</ul></div>')
        blocks.append(f'<div class="comp-problem"><pre class="prompt">{esc(prompt)}</pre>'
                      f'<p class="answer">answer: <code>{esc(entry["answer"])}</code></p>'
                      f'<div class="comp-grid">{"".join(items)}</div></div>')
    more = f" (first {COMPLETION_PROBLEMS} of {len(by_prompt)})" if len(by_prompt) > COMPLETION_PROBLEMS else ""
    return (f'<p class="caption">What the models wrote{esc(more)}: for each problem, the prompt and the '
            'reference answer, then one or two of the sampled completions of the base and of the first run '
            'of each method, marked ✓ correct or ✗ incorrect.</p>' + "".join(blocks))
