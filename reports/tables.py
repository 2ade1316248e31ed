"""HTML tables of the report. Every user-supplied string goes through `esc`."""

from __future__ import annotations

from .common import (
    PER_SEED_NOTE,
    Context,
    as_dict,
    as_list,
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
from .metrics import sparsity_keeping_gain

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


def summary_table(ctx: Context) -> str:
    a = ctx.analysis
    evals = as_dict(a.get("evals"))
    diff = as_dict(a.get("diff"))
    sparsify = as_dict(a.get("sparsify"))
    ks = sort_ks(k for ev in evals.values() for k in as_dict(as_dict(ev).get("pass_at_k"))) or ["1", "16", "32"]
    bk = ctx.base_key(evals)
    base_pk = as_dict(as_dict(evals.get(bk)).get("pass_at_k")) if bk else {}
    ratios: dict[str, list[str]] = {}
    for r in as_list(a.get("ratios")):
        r = as_dict(r)
        v = num(r.get("rel_l2_ratio"))
        if v is not None and r.get("a") is not None:
            ratios.setdefault(str(r["a"]), []).append(f"{v:.3g}× {esc(r.get('b'))}")
    head = ["Model"] + [f"Pass@{esc(k)}" for k in ks] + [
        '‖θ−θ₀‖/‖θ₀‖', "Ratio (rel. distance)", 'Sparsity keeping ≥90% of Pass@1 gain']
    tips = [""] + ["share of problems solved by at least one of K samples; change vs base in points"] * len(ks) + [
        "relative distance from the initial weights (whole model)",
        "rel. distance of this model divided by that of the named model",
        ("largest fraction of Δ that can be zeroed (smallest entries first) keeping 90% of the Pass@1 gain; "
         "interpolated between the tested sparsities")]
    rows = []
    base_row_needed = bk is not None
    if base_row_needed:
        cells = [f'<th scope="row">{_swatch(ctx, "base")}{esc(ctx.base_label)} <span class="tag">base</span></th>']
        cells += [f'<td class="num">{esc(fmt_pct(base_pk.get(k)))}</td>' for k in ks]
        cells += ['<td class="num na">—</td>'] * 3
        rows.append("<tr>" + "".join(cells) + "</tr>")
    for label in ctx.models:
        info = ctx.model_info.get(label, {})
        method = info.get("method")
        tag = f' <span class="tag">{esc(method)}</span>' if method and str(method) != label else ""
        cells = [f'<th scope="row">{_swatch(ctx, label)}{esc(label)}{tag}</th>']
        pk = as_dict(as_dict(evals.get(label)).get("pass_at_k"))
        for k in ks:
            cells.append(f'<td class="num">{_value_with_delta(num(pk.get(k)), num(base_pk.get(k)))}</td>')
        rel = num(as_dict(as_dict(diff.get(label)).get("whole")).get("rel_l2"))
        cells.append(f'<td class="num">{esc(fmt_g(rel))}</td>')
        cells.append(f'<td class="num">{"<br>".join(ratios.get(label, [])) or "<span class=na>—</span>"}</td>')
        sp = sparsify.get(label)
        if isinstance(sp, dict):
            s90, qual = sparsity_keeping_gain(sp)
            text = f"{qual}{s90:.0%}" if s90 is not None else f"n/a ({qual})"
        else:
            text = "n/a"
        cells.append(f'<td class="num">{esc(text)}</td>')
        rows.append("<tr>" + "".join(cells) + "</tr>")
    thead = "".join(f'<th scope="col" title="{esc(t)}">{h}</th>' for h, t in zip(head, tips))
    return (f'<div class="table-wrap"><table class="summary"><thead><tr>{thead}</tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table></div>')


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
    """The study's verdicts: one row per claim, then its checks (estimate, 95% interval, paper's direction)."""
    study = as_dict(ctx.analysis.get("study"))
    claims = as_list(study.get("claims"))
    if not claims:
        return None
    rows = []
    for cl in claims:
        cl = as_dict(cl)
        v = str(cl.get("verdict"))
        rows.append(f'<tr class="claim"><th scope="row" colspan="5">({esc(cl.get("id"))}) {esc(cl.get("title"))}</th>'
                    f'<td><span class="delta {VERDICT_CLASS.get(v, "flat")}">{esc(v)}</span></td></tr>')
        for c in as_list(cl.get("checks")):
            c = as_dict(c)
            cv = str(c.get("verdict"))
            null = num(c.get("null")) or 0.0
            rows.append(f'<tr><td>{esc(c.get("check"))}</td><td class="num">{esc(fmt_g(c.get("estimate")))}</td>'
                        f'<td class="num">{esc(per_seed_text(c))}</td>'
                        f'<td class="num">{esc(fmt_ci(c.get("ci_low"), c.get("ci_high")))}</td>'
                        f'<td class="num">{esc(c.get("direction"))} vs {esc(fmt_g(null))}</td>'
                        f'<td><span class="delta {VERDICT_CLASS.get(cv, "flat")}">{esc(cv)}</span></td></tr>')
    head = "".join(f"<th>{h}</th>" for h in ("Check", "Estimate", "Per training seed", "95% interval",
                                             "Paper's direction", "Verdict"))
    rule = f'<p class="caption">{esc(study.get("rule"))}</p>' if study.get("rule") else ""
    rule += f'<p class="caption">{esc(PER_SEED_NOTE)}</p>'
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
    head = "".join(f"<th scope=\"col\">{_swatch(ctx, label)}{esc(label)} JS</th>" for label in labels)
    rows = []
    for prompt, by in list(prompts.items())[:MAX_ROWS]:
        cells = [f'<td class="prompt"><code>{esc(prompt)}</code></td>']
        for label in labels:
            p = by.get(label, {})
            js, se = num(p.get("js")), num(p.get("js_se"))
            text = "—" if js is None else fmt_g(js) + (f" ± {fmt_g(se)}" if se is not None else "")
            cells.append(f'<td class="num">{esc(text)}</td>')
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return (f'<details class="more"><summary>Per-prompt divergence ({len(prompts)} prompts)</summary>'
            f'{_truncation_note(len(prompts))}'
            f'<div class="table-wrap scroll"><table class="perprompt"><thead><tr><th scope="col">Prompt</th>{head}'
            f'</tr></thead><tbody>{"".join(rows)}</tbody></table></div></details>')
