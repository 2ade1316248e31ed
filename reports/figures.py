"""Plotly figure specs (plain JSON-able dicts) for each section of analysis.json.

Each builder returns a `Figure` or None when its section (or the data it needs) is absent. The figures are
drawn in the browser by templates/report.js with the plotly.js inlined in the page; this module only
assembles data and layout, so rendering needs no kaleido, no network, and no torch.
User strings that plotly draws (labels, group and task names) go through `ptext`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .common import (
    BASE_COLOR,
    MODEL_COLORS,
    Context,
    as_dict,
    as_list,
    esc,
    fmt_g,
    group_color,
    num,
    order_groups,
    ptext,
    rgba,
    sort_ks,
)
from .metrics import (
    GAIN_THRESHOLD,
    gain_curve,
    js_shown,
    layer_grid,
    mean_band,
    passk_interval,
    sparsity_keeping_gain,
    study_base_evaluations,
)

FONT = ('-apple-system, BlinkMacSystemFont, "Segoe UI", Roboto, "Helvetica Neue", Arial, "Noto Sans", '
        'sans-serif')
DASHES = ["solid", "dash", "dot", "dashdot", "longdash", "longdashdot"]

_AXIS = {"gridcolor": "#e8ebef", "linecolor": "#b8bec7", "zerolinecolor": "#d5d9df", "ticks": "outside",
         "tickcolor": "#b8bec7", "ticklen": 4, "automargin": True, "title": {"standoff": 10}}
# Shared look of every figure: report.js sets it as each layout's template.
TEMPLATE = {"layout": {
    "font": {"family": FONT, "size": 13, "color": "#1f2937"},
    "paper_bgcolor": "#ffffff", "plot_bgcolor": "#ffffff", "colorway": MODEL_COLORS,
    "xaxis": _AXIS, "yaxis": _AXIS,
    "hoverlabel": {"font": {"family": FONT, "size": 12}},
    "legend": {"bgcolor": "rgba(255,255,255,0.85)", "font": {"size": 12}},
    "margin": {"l": 64, "r": 24, "t": 20, "b": 56},
}}


@dataclass
class Figure:
    id: str
    title: str
    caption: str                                   # one sentence on how to read it (HTML-escaped text)
    data: list[dict]
    layout: dict
    meta: str = ""                                 # optional line of settings, already HTML (escaped)
    controls_html: str = ""                        # HTML placed above the figure (already escaped)
    after_html: str = ""                           # HTML placed below the figure (already escaped)
    extra: dict = field(default_factory=dict)      # data report.js needs for the controls
    notes: list[str] = field(default_factory=list)  # plain-text remarks, escaped when rendered

    def spec(self) -> dict[str, Any]:
        return {"id": self.id, "data": self.data, "layout": self.layout}


def _subplot_title(text: str, x0: float, x1: float) -> dict:
    return {"text": f"<b>{text}</b>", "x": (x0 + x1) / 2, "xref": "paper", "y": 1.0, "yref": "paper",
            "yanchor": "bottom", "xanchor": "center", "showarrow": False, "font": {"size": 13}, "yshift": 6}


def _spread(values: list[float | None]) -> float:
    pos = [v for v in values if v is not None and v > 0]
    return max(pos) / min(pos) if pos else 1.0


def _legend_right() -> dict:
    return {"orientation": "v", "x": 1.02, "xanchor": "left", "y": 1, "yanchor": "top"}


def _settings_line(ev: dict) -> str:
    parts = []
    task, split = ev.get("task"), ev.get("split")
    if task is not None:
        parts.append(f"task {task}" + (f"/{split}" if split else ""))
    for key, label in (("n_problems", "problems"), ("samples", "samples")):
        if num(ev.get(key)) is not None:
            parts.append(f"{int(ev[key])} {label}")
    if num(ev.get("temperature")) is not None:
        parts.append(f"T={ev['temperature']:g}")
    if num(ev.get("max_new_tokens")) is not None:
        parts.append(f"≤{int(ev['max_new_tokens'])} new tokens")
    if num(ev.get("seed")) is not None:
        parts.append(f"seed {int(ev['seed'])}")
    return " · ".join(parts)


# --------------------------------------------------------------------------------------------- Pass@K
def _eval_curve(ev: dict) -> tuple[list[float], list[float | None], list[float | None]]:
    """(ks, Pass@K, Maj@K) of one evaluation: its full curve, else the requested ks only."""
    curve = as_dict(ev.get("curve"))
    ks = [num(k) for k in as_list(curve.get("k"))]
    if ks and all(k is not None for k in ks):
        p = [num(v) for v in as_list(curve.get("pass"))]
        m = [num(v) for v in as_list(curve.get("maj"))]
    else:
        keys = sort_ks(as_dict(ev.get("pass_at_k")))
        ks = [num(k) for k in keys]
        keep = [j for j, k in enumerate(ks) if k is not None]
        ks = [ks[j] for j in keep]
        p = [num(as_dict(ev.get("pass_at_k")).get(keys[j])) for j in keep]
        m = [num(as_dict(ev.get("maj_at_k")).get(keys[j])) for j in keep]
    n = len(ks)
    return ks, (p + [None] * n)[:n], (m + [None] * n)[:n]


def _band(xs, lo, hi, color, group, name, alpha=0.16) -> list[dict]:
    """A filled band between lo and hi (two traces; the upper edge first)."""
    common = {"type": "scatter", "mode": "lines", "x": xs, "line": {"width": 0}, "legendgroup": group,
              "showlegend": False, "hoverinfo": "skip"}
    return [{**common, "y": hi, "name": f"{name} upper"},
            {**common, "y": lo, "name": name, "fill": "tonexty", "fillcolor": rgba(color, alpha)}]


def fig_passk(ctx: Context) -> Figure | None:
    """One line per method: the mean over its seeds, a band (min–max over seeds) and each seed on demand.

    A method with one run (and the base) gets a band of the 95% interval over test problems instead. Per-seed
    curves start hidden (legend entries, click to show): at study size, 20 lines are unreadable.
    """
    evals = as_dict(ctx.analysis.get("evals"))
    base_key = ctx.base_key(evals)
    curves = {key: _eval_curve(evals[key]) for key in [base_key, *ctx.models]
              if key is not None and isinstance(evals.get(key), dict)}
    # a study's base is its one base definition (study.base: the mean over its sampling seeds), as in the
    # summary and the verdicts; its band is over the per-problem counts of every sampling seed
    study_base = as_dict(as_dict(ctx.analysis.get("study")).get("base"))
    base_seed_evals = study_base_evaluations(ctx)
    if base_key in curves and as_list(as_dict(study_base.get("curve")).get("k")):
        curves[base_key] = _eval_curve(study_base)

    def evals_of(m):
        return base_seed_evals if m == base_key and base_seed_evals else [evals[m]]

    curves = {k: v for k, v in curves.items() if v[0]}
    if not curves:
        return None
    kmax = max(max(ks) for ks, _, _ in curves.values())
    data: list[dict] = []
    settings = {key: _settings_line(evals[key]) for key in curves}
    requested = sorted({int(k) for ev in evals.values() for k in as_dict(as_dict(ev).get("pass_at_k"))
                        if str(k).isdigit() and int(k) >= 1})
    hover = "%{fullData.name}<br>K = %{x}: %{y:.1%}<extra></extra>"

    def family(key, members, name, color, legendgroup, width, visible=True):
        """Pass@K line (+ band) and Maj@K line of one model or of the mean over a method's runs."""
        cs = [curves[m] for m in members]
        ks = cs[0][0]
        if any(c[0] != ks for c in cs):  # seeds evaluated at different K: draw the first only
            cs, members = cs[:1], members[:1]
        p_mean, p_lo, p_hi = mean_band([c[1] for c in cs])
        m_mean = mean_band([c[2] for c in cs])[0]
        out = []
        if visible is True:
            if len(cs) > 1:
                band, what = (p_lo, p_hi), "min–max over seeds"
            else:
                iv = passk_interval([e for m in members for e in evals_of(m)], ks)
                band, what = (iv if iv else (None, None)), "95% interval over problems"
            if band[0] is not None and any(v is not None for v in band[0]):
                out += _band(ks, band[0], band[1], color, legendgroup, f"{name} · {what}")
        tr = {"type": "scatter", "x": ks, "y": p_mean, "name": name, "legendgroup": legendgroup,
              "mode": "lines+markers" if len(ks) <= 40 else "lines", "line": {"color": color, "width": width},
              "marker": {"size": 4}, "hovertemplate": hover}
        if visible is not True:
            tr["visible"] = visible
        if visible is True and len(cs) > 1 and requested:
            # the 95% interval over problems of the seed mean, at the requested K, as error bars
            xs = [k for k in requested if k in ks]
            lo, hi = passk_interval([e for m in members for e in evals_of(m)], xs) or ([], [])
            ys = [p_mean[ks.index(k)] for k in xs]
            if xs and all(v is not None for v in lo + ys):
                out.append({"type": "scatter", "mode": "markers", "x": xs, "y": ys, "legendgroup": legendgroup,
                            "showlegend": False, "name": f"{name} · 95% interval over problems",
                            "marker": {"color": color, "size": 6},
                            "error_y": {"type": "data", "symmetric": False, "array": [h - y for h, y in zip(hi, ys)],
                                        "arrayminus": [y - v for y, v in zip(ys, lo)], "color": color,
                                        "thickness": 1.5, "width": 4},
                            "hovertemplate": "%{fullData.name}<br>K = %{x}: %{y:.1%}<extra></extra>"})
        out.append(tr)
        if any(v is not None for v in m_mean):
            mt = {"type": "scatter", "x": ks, "y": m_mean, "name": f"{name} · Maj@K", "legendgroup": legendgroup,
                  "showlegend": False, "mode": "lines", "hovertemplate": hover,
                  "line": {"color": color, "width": max(1.0, width - 1), "dash": "dash"}}
            if visible is not True:
                mt["visible"] = visible
            out.append(mt)
        return out

    if base_key in curves:
        data += family(base_key, [base_key], ptext(ctx.display(base_key)), BASE_COLOR, "base", 2)
    seed_traces: list[dict] = []
    for method, members in ctx.methods.items():
        members = [m for m in members if m in curves]
        if not members:
            continue
        color = ctx.method_colors[method]
        if len(members) == 1:
            data += family(members[0], members, ptext(members[0]), ctx.color(members[0]), f"m:{method}", 2.5)
            continue
        data += family(None, members, ptext(ctx.method_name(method)), color, f"m:{method}", 3)
        for label in members:
            seed_traces += family(label, [label], ptext(label), ctx.color(label), f"s:{label}", 1.5,
                                  visible="legendonly")
    data += seed_traces
    ticks = [2 ** i for i in range(int(math.log2(kmax)) + 1)]
    if kmax not in ticks:
        ticks.append(kmax)
    layout = {
        "height": 470,
        "xaxis": {"type": "log", "title": {"text": "K (samples per problem)"}, "tickvals": ticks,
                  "ticktext": [str(int(t)) if float(t).is_integer() else str(t) for t in ticks]},
        "yaxis": {"title": {"text": "problems solved"}, "tickformat": ".0%", "range": [0, 1.02]},
        "legend": {**_legend_right(), "tracegroupgap": 2, "font": {"size": 12}}, "hovermode": "closest",
    }
    distinct = set(settings.values())
    if len(distinct) == 1:
        meta = esc(next(iter(distinct)))
    else:
        meta = "<br>".join(f"<b>{esc(ctx.display(k))}</b>: {esc(v)}" for k, v in settings.items())
    notes = []
    if ctx.multi_seed:
        notes.append("Bold lines are the mean over a method's training seeds, with a band from the lowest to the "
                     "highest seed and error bars at the requested K for the 95% interval over test problems "
                     "(normal approximation, per-problem Pass@K averaged over seeds); each seed's own curve is "
                     "hidden until its legend entry is clicked. A single model's band is its 95% interval over "
                     "problems.")
    else:
        notes.append("Bands are 95% intervals over test problems (normal approximation of each problem's "
                     "unbiased Pass@K).")
    base_seeds = num(as_dict(as_dict(ctx.analysis.get("study")).get("config")).get("base_seeds"))
    if base_key in curves and base_seeds and base_seeds > 1:
        notes.append(f"The base curve is the mean over the {int(base_seeds)} sampling seeds the study evaluated "
                     "(its one base: the summary table and the verdicts use the same), its band over every seed's "
                     "per-problem counts." if study_base else
                     f"The base curve is its evaluation with sampling seed 0 (the analysis keeps that one); the "
                     f"summary table's base row and its changes use the mean over the {int(base_seeds)} sampling "
                     "seeds the study evaluated, as the verdicts do.")
    return Figure(
        "fig-passk", "Pass@K and Maj@K",
        "Solid lines are Pass@K, the share of problems solved by at least one of K samples, and dashed lines "
        "are Maj@K, where the most common of K answers must be right; a gain at K = 1 that shrinks or turns "
        "into a loss at K = 32 means training sharpened what the base model could already do rather than "
        "teaching it new problems.",
        data, layout, meta=meta, notes=notes)


# ------------------------------------------------------------------------------------ distance from init
def fig_distance(ctx: Context) -> Figure | None:
    diff = as_dict(ctx.analysis.get("diff"))
    rows = []
    for label in ctx.models:
        whole = as_dict(as_dict(diff.get(label)).get("whole"))
        if label in diff and num(whole.get("rel_l2")) is not None:
            rows.append((label, whole))
    if not rows:
        return None
    values = [num(w.get("rel_l2")) for _, w in rows]
    data = [{
        "type": "bar", "x": [ptext(label) for label, _ in rows], "y": values,
        "marker": {"color": [ctx.color(label) for label, _ in rows]},
        "text": [fmt_g(v) for v in values], "textposition": "outside", "cliponaxis": False,
        "customdata": [[num(w.get("l2")), num(as_dict(diff[label]).get("n_params"))] for label, w in rows],
        "hovertemplate": "%{x}<br>‖θ−θ₀‖/‖θ₀‖ = %{y:.3g}<br>‖θ−θ₀‖ = %{customdata[0]:.3g}"
                         "<br>%{customdata[1]:,} parameters<extra></extra>",
        "showlegend": False,
    }]
    # Linear on purpose: the ratio between methods is the point, and a log axis would hide it.
    yaxis = {"title": {"text": "‖θ − θ₀‖ / ‖θ₀‖"}, "rangemode": "tozero", "exponentformat": "e"}
    layout = {"height": 380, "xaxis": {"title": {"text": "model"}, "type": "category"}, "yaxis": yaxis,
              "bargap": 0.45 if len(rows) < 6 else 0.25, "margin": {"t": 16}}
    return Figure(
        "fig-distance", "Distance from the initial weights",
        "Bar height is how far each fine-tuned model moved from its starting weights, ‖θ − θ₀‖ / ‖θ₀‖ over "
        "all parameters (bars of one method share its hue, a shade per seed); the table below gives the ratio "
        "between methods (how many times further one moved).",
        data, layout)


# ----------------------------------------------------------------------------------- layer x group heatmap
METRIC_INFO = {
    "l2": {"button": "Absolute ‖Δ‖", "title": "‖Δ‖₂", "hover": "‖Δ‖₂"},
    "rel_l2": {"button": "Relative ‖Δ‖ / ‖θ₀‖", "title": "‖Δ‖/‖θ₀‖", "hover": "‖Δ‖/‖θ₀‖"},
}


def _heat_hover(metric: str) -> str:
    return f"layer %{{y}} · %{{x}}<br>{METRIC_INFO[metric]['hover']} = %{{z:.3g}}<extra></extra>"


def fig_heatmap(ctx: Context) -> Figure | None:
    diff = as_dict(ctx.analysis.get("diff"))
    models, raw = [], []
    for label in ctx.models:
        if not isinstance(diff.get(label), dict):
            continue
        layers, groups, z = layer_grid(diff[label])
        if layers and groups:
            raw.append(label)
            models.append({"label": ptext(label), "x": [ptext(g) for g in groups], "y": layers, "z": z})
    if not models:
        return None
    first = models[0]
    nlayers = max(len(m["y"]) for m in models)
    data = [{
        "type": "heatmap", "x": first["x"], "y": first["y"], "z": first["z"]["l2"], "colorscale": "Viridis",
        "colorbar": {"title": {"text": METRIC_INFO["l2"]["title"], "side": "right"}, "thickness": 14,
                     "exponentformat": "e"},
        "hovertemplate": _heat_hover("l2"), "xgap": 1, "ygap": 1, "hoverongaps": False,
    }]
    layout = {
        "height": int(min(860, max(320, 130 + 30 * nlayers))),
        "xaxis": {"title": {"text": "parameter group"}, "type": "category", "side": "bottom", "ticks": ""},
        "yaxis": {"title": {"text": "layer"}, "autorange": "reversed", "ticks": "",
                  **({"dtick": 1} if nlayers <= 32 else {})},
        "margin": {"t": 24},
    }
    buttons = "".join(
        f'<button type="button" class="seg-btn{" active" if m == "l2" else ""}" data-metric="{m}" '
        f'id="heatmap-metric-{m}" aria-pressed="{"true" if m == "l2" else "false"}">{esc(info["button"])}</button>'
        for m, info in METRIC_INFO.items())
    controls = f'<div class="seg" role="group" aria-label="Heatmap metric">{buttons}</div>'
    if len(models) > 1:
        options = "".join(f'<option value="{i}">{esc(label)}</option>' for i, label in enumerate(raw))
        controls += (f'<label class="select">Model <select id="heatmap-model" '
                     f'aria-label="Heatmap model">{options}</select></label>')
    extra = {"heatmap": {"figure": "fig-heatmap", "models": models,
                         "metrics": {m: {"title": i["title"], "hover": _heat_hover(m)}
                                     for m, i in METRIC_INFO.items()}}}
    return Figure(
        "fig-heatmap", "Where the weights changed: layer × parameter group",
        "Each cell is the size of the weight change in one parameter group of one transformer layer (brighter "
        "is larger); switch to the relative view ‖Δ‖/‖θ₀‖ to compare tensors of different size and scale fairly.",
        data, layout, controls_html=f'<div class="controls">{controls}</div>', extra=extra,
        notes=["Tensors outside the layers (embeddings, final norm, lm_head) are in the group bars below."])


# ------------------------------------------------------------------------------------------- group bars
def fig_groups(ctx: Context) -> Figure | None:
    diff = as_dict(ctx.analysis.get("diff"))
    labels = [label for label in ctx.models if as_dict(as_dict(diff.get(label)).get("groups"))]
    if not labels:
        return None
    groups = order_groups(g for label in labels for g in as_dict(diff[label]["groups"]))
    data, values = [], []
    for label in labels:
        gm = as_dict(diff[label]["groups"])
        y = [num(as_dict(gm.get(g)).get("l2")) for g in groups]
        values += y
        data.append({
            "type": "bar", "name": ptext(label), "x": [ptext(g) for g in groups], "y": y,
            "marker": {"color": ctx.color(label)},
            "customdata": [[num(as_dict(gm.get(g)).get("rel_l2")), num(as_dict(gm.get(g)).get("n"))] for g in groups],
            "hovertemplate": "%{fullData.name} · %{x}<br>‖Δ‖₂ = %{y:.3g}<br>‖Δ‖/‖θ₀‖ = %{customdata[0]:.3g}"
                             "<br>%{customdata[1]:,} parameters<extra></extra>",
        })
    log = _spread(values) > 100
    yaxis: dict = {"title": {"text": "‖Δ‖₂ of the group"}}
    yaxis.update({"type": "log", "exponentformat": "power"} if log else {"rangemode": "tozero"})
    layout = {"height": 400, "barmode": "group", "bargap": 0.25, "bargroupgap": 0.05,
              "xaxis": {"title": {"text": "parameter group"}, "type": "category"}, "yaxis": yaxis,
              "legend": _legend_right()}
    scale = " on a log scale" if log else ""
    return Figure(
        "fig-groups", "Change per parameter group",
        f"Each bar is the L2 norm of one model's weight change over all tensors of a parameter group, all layers "
        f"together{scale}; groups with more parameters score higher for the same per-weight change, so hover "
        f"for the relative change ‖Δ‖/‖θ₀‖.",
        data, layout)


# ------------------------------------------------------------------------------------ top-k composition
def fig_topk(ctx: Context) -> Figure | None:
    diff = as_dict(ctx.analysis.get("diff"))
    rankings = {"abs": "ranked by |Δ| (absolute)", "rel": "ranked by |Δ| / |θ₀| (relative)"}
    labels = [label for label in ctx.models
              if any(as_dict(as_dict(as_dict(as_dict(diff.get(label)).get("topk")).get(r)).get("composition"))
                     for r in rankings)]
    if not labels:
        return None
    ks = {as_dict(diff[label].get("topk")).get("k") for label in labels}
    k = next(iter(ks)) if len(ks) == 1 and num(next(iter(ks))) is not None else None
    comps = {r: {label: as_dict(as_dict(as_dict(diff[label]["topk"]).get(r)).get("composition")) for label in labels}
             for r in rankings}
    groups = order_groups(g for r in comps for label in labels for g in comps[r][label])
    domains = {"abs": [0.0, 0.44], "rel": [0.56, 1.0]}
    axes = {"abs": ("x", "y"), "rel": ("x2", "y2")}
    extra: dict[str, int] = {}
    data = []
    for g in groups:
        color = group_color(g, extra)
        for j, r in enumerate(rankings):
            xa, ya = axes[r]
            data.append({
                "type": "bar", "name": ptext(g), "legendgroup": ptext(g), "showlegend": j == 0,
                "x": [ptext(label) for label in labels],
                "y": [num(comps[r][label].get(g)) or 0 for label in labels],
                "xaxis": xa, "yaxis": ya, "marker": {"color": color, "line": {"color": "#ffffff", "width": 0.5}},
                "hovertemplate": "%{x} · %{fullData.name}: %{y} coordinates<extra></extra>",
            })
    ytitle = f"coordinates among the top {int(k)}" if k is not None else "coordinates among the top k"
    layout = {
        "height": 420, "barmode": "stack", "bargap": 0.35,
        "xaxis": {"domain": domains["abs"], "type": "category", "title": {"text": "model"}},
        "yaxis": {"title": {"text": ytitle}, "rangemode": "tozero"},
        "xaxis2": {"domain": domains["rel"], "anchor": "y2", "type": "category", "title": {"text": "model"}},
        "yaxis2": {"anchor": "x2", "rangemode": "tozero", "matches": "y"},
        "annotations": [_subplot_title(t, *domains[r]) for r, t in rankings.items()],
        "legend": {**_legend_right(), "title": {"text": "group"}, "traceorder": "normal"},
        "margin": {"t": 48},
    }
    kk = f"{int(k)}" if k is not None else "k"
    return Figure(
        "fig-topk", f"The {kk} most-changed coordinates",
        f"Each stack splits the {kk} individual weights that changed most into the parameter groups they belong "
        f"to, ranked by absolute change |Δ| on the left and by change relative to the initial value |Δ|/|θ₀| on "
        f"the right; a group far over-represented here is where the largest single updates went.",
        data, layout)


# ------------------------------------------------------------------------------------ sparsification
def fig_sparsify(ctx: Context) -> Figure | None:
    sparsify = as_dict(ctx.analysis.get("sparsify"))
    labels = [label for label in ctx.models if as_list(as_dict(sparsify.get(label)).get("points"))]
    if not labels:
        return None
    ks: list[str] = sort_ks(k for label in labels for p in as_list(sparsify[label]["points"])
                            for k in as_dict(as_dict(p).get("pass_at_k")))
    dash = {k: DASHES[i % len(DASHES)] for i, k in enumerate(ks)}
    data: list[dict] = []
    base_vals = as_dict(sparsify[labels[0]].get("base_pass_at_k"))
    for k in ks:
        v = num(base_vals.get(k))
        if v is not None:
            data.append({"type": "scatter", "mode": "lines", "x": [0, 1], "y": [v, v],
                         "name": f"{ptext(ctx.base_label)} Pass@{ptext(k)}", "legendgroup": "base",
                         "line": {"color": BASE_COLOR, "width": 1.5, "dash": dash[k]},
                         "hovertemplate": f"{ptext(ctx.base_label)} Pass@{ptext(k)} = %{{y:.1%}}<extra></extra>"})
    for i, label in enumerate(labels):
        sp = sparsify[label]
        color, name = ctx.color(label), ptext(label)
        # One legend entry per model (its gain curve) toggles all of its traces; line style encodes K.
        group = {"legendgroup": f"m{i}", "showlegend": False}
        pts = sorted((p for p in as_list(sp["points"]) if num(as_dict(p).get("sparsity")) is not None),
                     key=lambda p: p["sparsity"])
        full = as_dict(sp.get("full_pass_at_k"))
        for k in ks:
            xs, ys = [], []
            if num(full.get(k)) is not None:
                xs.append(0.0)
                ys.append(num(full.get(k)))
            for p in pts:
                xs.append(num(p["sparsity"]))
                ys.append(num(as_dict(p.get("pass_at_k")).get(k)))
            if any(y is not None for y in ys):
                data.append({"type": "scatter", "mode": "lines+markers", "x": xs, "y": ys, "name": f"Pass@{ptext(k)}",
                             **group, "line": {"color": color, "width": 2.2, "dash": dash[k]},
                             "marker": {"size": 6},
                             "hovertemplate": f"{name} Pass@{ptext(k)}<br>sparsity %{{x:.1%}}: %{{y:.1%}}"
                                              "<extra></extra>"})
        curve, _ = gain_curve(sp)
        if curve:
            xs = [0.0] + [s for s, _ in curve]
            ys = [1.0] + [g for _, g in curve]
            data.append({"type": "scatter", "mode": "lines+markers", "x": xs, "y": ys, "name": name,
                         **group, "showlegend": True, "xaxis": "x2", "yaxis": "y2", "line": {"color": color, "width": 2.5},
                         "marker": {"size": 6},
                         "hovertemplate": f"{name}<br>sparsity %{{x:.1%}}: %{{y:.0%}} of the Pass@1 gain"
                                          "<extra></extra>"})
            s90, qual = sparsity_keeping_gain(sp)
            if s90 is not None:
                data.append({"type": "scatter", "mode": "markers", "x": [s90], "y": [GAIN_THRESHOLD],
                             "name": f"{qual}{s90:.0%} keeps 90%", **group, "xaxis": "x2", "yaxis": "y2",
                             "marker": {"color": color, "size": 13, "symbol": "diamond-open", "line": {"width": 2.5}},
                             "hovertemplate": f"{name}: {qual}{s90:.1%} of Δ can be zeroed keeping 90% of the "
                                              "Pass@1 gain<extra></extra>"})
    for i, label in enumerate(labels):  # a model without a gain curve: its first line carries the legend entry
        traces = [t for t in data if t.get("legendgroup") == f"m{i}"]
        if traces and not any(t.get("showlegend") for t in traces):
            traces[0].update(showlegend=True, name=ptext(label))
    d_left, d_right = [0.0, 0.44], [0.56, 1.0]
    layout = {
        "height": 480, "hovermode": "closest",
        "xaxis": {"domain": d_left, "title": {"text": "sparsity (fraction of Δ zeroed)"}, "tickformat": ".0%",
                  "range": [-0.02, 1.02]},
        "yaxis": {"title": {"text": "Pass@K"}, "tickformat": ".0%"},
        "xaxis2": {"domain": d_right, "anchor": "y2", "title": {"text": "sparsity (fraction of Δ zeroed)"},
                   "tickformat": ".0%", "range": [-0.02, 1.02]},
        "yaxis2": {"anchor": "x2", "title": {"text": "share of the Pass@1 gain kept"}, "tickformat": ".0%"},
        "shapes": [{"type": "line", "xref": "x2 domain", "x0": 0, "x1": 1, "yref": "y2", "y0": GAIN_THRESHOLD,
                    "y1": GAIN_THRESHOLD, "line": {"color": "#6b7280", "width": 1.2, "dash": "dash"}}],
        "annotations": [_subplot_title("Pass@K after sparsifying Δ", *d_left),
                        _subplot_title("Pass@1 gain over base that survives", *d_right)],
        "legend": {**_legend_right(), "tracegroupgap": 8},
        "margin": {"t": 48},
    }
    names = {"solid": "solid", "dash": "dashed", "dot": "dotted", "dashdot": "dash-dotted", "longdash": "long-dashed",
             "longdashdot": "long-dash-dotted"}
    styles = ", ".join(f"{names[dash[k]]} Pass@{k}" for k in ks)
    return Figure(
        "fig-sparsify", "Sparsifying the update",
        "Left: Pass@K after zeroing the smallest-magnitude entries of each model's weight change (x = fraction "
        "zeroed, 0 = the fine-tuned model, grey = base); right: the share of the Pass@1 gain over base that "
        "survives, with the dashed line at 90% and a diamond where each curve crosses it, so a curve that stays "
        "high far to the right means the useful part of the update is sparse.",
        data, layout, notes=[f"Line styles on the left: {styles}."] if ks else [])


# ---------------------------------------------------------------------------------------- training
def _fig_training_steps(ctx: Context) -> Figure | None:
    """The figure for analyses without compute units: reward per run against its own iteration or step."""
    training = as_dict(ctx.analysis.get("training"))
    labels = [label for label in ctx.models if as_list(as_dict(training.get(label)).get("rows"))]
    if not labels:
        return None
    xkeys = {label: str(training[label].get("x") or "iteration") for label in labels}
    # Runs that count progress in different units (ES iterations, GRPO steps) get a panel each.
    panels = len(labels) if len(set(xkeys.values())) > 1 else 1
    cols = min(panels, 3)
    nrows = math.ceil(panels / cols)
    hgap, vgap = 0.07, 0.16
    width, height = (1 - hgap * (cols - 1)) / cols, (1 - vgap * (nrows - 1)) / nrows
    layout: dict[str, Any] = {"height": 400 if nrows == 1 else 330 * nrows, "hovermode": "closest",
                              "legend": _legend_right(), "showlegend": panels == 1, "annotations": []}
    data, std_band = [], []
    for i, label in enumerate(labels):
        t, xkey = training[label], xkeys[label]
        rows = [r for r in as_list(t["rows"]) if isinstance(r, dict) and num(r.get("reward_mean")) is not None]
        rows.sort(key=lambda r: num(r.get(xkey)) if num(r.get(xkey)) is not None else math.inf)
        xs = [num(r.get(xkey)) for r in rows]
        if any(x is None for x in xs):
            xs = list(range(len(rows)))
        mean = [num(r["reward_mean"]) for r in rows]
        lo = [num(r.get("reward_min")) for r in rows]
        hi = [num(r.get("reward_max")) for r in rows]
        band = "min–max"
        if any(v is None for v in lo + hi):
            sd = [num(r.get("reward_std")) for r in rows]
            if all(v is not None for v in sd):
                lo = [m - s for m, s in zip(mean, sd)]
                hi = [m + s for m, s in zip(mean, sd)]
                band = "±1 std"
                std_band.append(label)
            else:
                lo = hi = []
        color, name = ctx.color(label), ptext(label)
        method = t.get("method")
        legend = f"{name} ({ptext(method)})" if method and str(method) != label else name
        p = i if panels > 1 else 0
        suffix = "" if p == 0 else str(p + 1)
        axes = {"xaxis": f"x{suffix}", "yaxis": f"y{suffix}"}
        if lo:
            data.append({"type": "scatter", "mode": "lines", "x": xs, "y": hi, "line": {"width": 0}, **axes,
                         "legendgroup": f"m{i}", "showlegend": False, "hoverinfo": "skip", "name": f"{name} max"})
            data.append({"type": "scatter", "mode": "lines", "x": xs, "y": lo, "line": {"width": 0}, **axes,
                         "fill": "tonexty", "fillcolor": rgba(color, 0.14), "legendgroup": f"m{i}",
                         "showlegend": False, "hoverinfo": "skip", "name": f"{name} {band}"})
        data.append({"type": "scatter", "mode": "lines", "x": xs, "y": mean, "name": legend, "legendgroup": f"m{i}",
                     "line": {"color": color, "width": 2.2}, **axes,
                     "customdata": [[a, b] for a, b in zip(lo, hi)] if lo else None,
                     "hovertemplate": f"%{{fullData.name}}<br>{ptext(xkey)} %{{x}}: mean reward %{{y:.3f}}"
                                      + (f"<br>{band} %{{customdata[0]:.3f}} … %{{customdata[1]:.3f}}" if lo else "")
                                      + "<extra></extra>"})
        if panels > 1 or i == 0:
            r, c = divmod(p, cols)
            x0 = c * (width + hgap)
            y1 = 1 - r * (height + vgap)
            xdom, ydom = [x0, x0 + width], [y1 - height, y1]
            xtitle = xkey if panels > 1 else " / ".join(dict.fromkeys(xkeys.values()))
            layout[f"xaxis{suffix}"] = {"domain": xdom, "anchor": f"y{suffix}", "title": {"text": ptext(xtitle)}}
            layout[f"yaxis{suffix}"] = {"domain": ydom, "anchor": f"x{suffix}",
                                        **({"title": {"text": "reward"}} if c == 0 else {}),
                                        **({"matches": "y"} if p > 0 else {})}
            if panels > 1:
                layout["annotations"].append({**_subplot_title(legend, *xdom), "y": y1})
    data = [{k: v for k, v in tr.items() if v is not None} for tr in data]
    if panels > 1:
        layout["margin"] = {"t": 40}
    note = []
    if std_band:
        note.append(f"No min/max recorded for {', '.join(std_band)}: the band there is ±1 standard deviation.")
    if panels > 1:
        note.append("The runs count progress in different units (" + ", ".join(dict.fromkeys(xkeys.values()))
                    + "), so each has its own panel; the reward axes are shared.")
    return Figure(
        "fig-training", "Training reward",
        "Each line is a run's mean reward per training iteration, and the shaded band spans the lowest to the "
        "highest reward in that iteration's population or batch.",
        data, layout, notes=note)


TRAIN_METRICS = [("reward_mean", "training reward", ".2f"), ("eval_pass1", "validation Pass@1", ".0%"),
                 ("kl", "KL to the reference", "~g"), ("entropy", "token entropy", "~g"),
                 ("grad_norm", "gradient norm", "~g")]


def fig_training(ctx: Context) -> Figure | None:
    """Training curves on the FLOP-matched compute axis, one panel per metric (small multiples).

    Every run whose rows carry `units` (deltalens.training.budget) is drawn against them, so ES iterations
    and GRPO steps compare at equal compute. Per panel: each seed a thin line in its shade, each method with
    several seeds a bold mean over them (at the compute points all its seeds share) with a min–max band.
    Without units on every run the older figure (reward per iteration or step) is drawn.
    """
    training = as_dict(ctx.analysis.get("training"))
    labels = [label for label in ctx.models if as_list(as_dict(training.get(label)).get("rows"))]
    if not labels:
        return None
    runs = {}
    for label in labels:
        rows = [r for r in as_list(training[label]["rows"]) if isinstance(r, dict)]
        if not rows or any(num(r.get("units")) is None for r in rows):
            return _fig_training_steps(ctx)
        runs[label] = sorted(rows, key=lambda r: num(r["units"]))
    metrics = [(k, t, f) for k, t, f in TRAIN_METRICS if any(num(r.get(k)) is not None for rs in runs.values() for r in rs)]
    if not metrics:
        return None
    cols = min(len(metrics), 3 if len(metrics) != 4 else 2)
    nrows = math.ceil(len(metrics) / cols)
    hgap, vgap = 0.08, 0.2 if nrows > 1 else 0.0
    width, height = (1 - hgap * (cols - 1)) / cols, (1 - vgap * (nrows - 1)) / nrows
    layout: dict[str, Any] = {"height": 340 * nrows + 40, "hovermode": "closest", "annotations": [],
                              "legend": {**_legend_right(), "tracegroupgap": 2}, "margin": {"t": 36}}
    data: list[dict] = []
    for p, (key, title, fmt) in enumerate(metrics):
        suffix = "" if p == 0 else str(p + 1)
        axes = {"xaxis": f"x{suffix}", "yaxis": f"y{suffix}"}
        r, c = divmod(p, cols)
        x0, y1 = c * (width + hgap), 1 - r * (height + vgap)
        xdom, ydom = [x0, x0 + width], [y1 - height, y1]
        layout[f"xaxis{suffix}"] = {"domain": xdom, "anchor": f"y{suffix}", "tickformat": "~s",
                                    "title": {"text": "compute units"}, **({"matches": "x"} if p else {})}
        layout[f"yaxis{suffix}"] = {"domain": ydom, "anchor": f"x{suffix}", "tickformat": fmt,
                                    **({"rangemode": "tozero"} if key in ("kl", "grad_norm") else {})}
        layout["annotations"].append({**_subplot_title(title, *xdom), "y": y1})
        hover = f"%{{fullData.name}}<br>%{{x:.3s}} units: {ptext(title)} %{{y:{fmt}}}<extra></extra>"
        for method, members in ctx.methods.items():
            members = [m for m in members if m in runs]
            series = {m: [(num(row["units"]), num(row.get(key))) for row in runs[m] if num(row.get(key)) is not None]
                      for m in members}
            series = {m: v for m, v in series.items() if v}
            if not series:
                continue
            mode = "lines+markers" if max(len(v) for v in series.values()) <= 12 else "lines"
            several = len(members) > 1
            for m, pts in series.items():
                data.append({"type": "scatter", "mode": mode, "x": [x for x, _ in pts], "y": [y for _, y in pts],
                             "name": ptext(m), "legendgroup": f"s:{m}", "showlegend": False, **axes,
                             "line": {"color": ctx.color(m), "width": 1.2 if several else 2.2},
                             "opacity": 0.4 if several else 1.0, "marker": {"size": 4}, "hovertemplate": hover})
            if several and len(series) > 1:
                shared = sorted(set.intersection(*({x for x, _ in v} for v in series.values())))
                if shared:
                    vals = [[dict(v)[x] for x in shared] for v in series.values()]
                    mean, lo, hi = mean_band(vals)
                    color, name = ctx.method_colors[method], ptext(ctx.method_name(method))
                    for tr in _band(shared, lo, hi, color, f"m:{method}", f"{name} · min–max over seeds", 0.09):
                        data.append({**tr, **axes})
                    data.append({"type": "scatter", "mode": mode, "x": shared, "y": mean, "name": name,
                                 "legendgroup": f"m:{method}", "showlegend": False, **axes,
                                 "line": {"color": color, "width": 3}, "marker": {"size": 5},
                                 "hovertemplate": hover})
    # one legend entry per method mean and per seed, on the first trace of each group
    seen: set[str] = set()
    for tr in data:
        g = tr["legendgroup"]
        if g not in seen and "fill" not in tr and not tr["name"].endswith(" upper"):
            seen.add(g)
            tr["showlegend"] = True
    order = {f"m:{m}": i * 100 for i, m in enumerate(ctx.methods)}
    order.update({f"s:{lab}": order[f"m:{ctx.method_of(lab)}"] + 1 + i for m in ctx.methods
                  for i, lab in enumerate(ctx.methods[m])})
    for tr in data:
        tr["legendrank"] = 1000 + order.get(tr["legendgroup"], 0)
    missing = [t for k, t, _ in TRAIN_METRICS if k not in {m[0] for m in metrics}]
    notes = [("The x axis is FLOP-matched compute (deltalens.training.budget: one unit is one pass of the "
             "parameters over one response; an ES response costs 2, a GRPO response 8), so a method's curve ends "
             "where its budget does.")]
    if missing:
        notes.append("Not recorded in this analysis: " + ", ".join(missing) + ".")
    return Figure(
        "fig-training", "Training curves",
        "Each panel is one training metric against compute spent; thin lines are single runs (a shade per seed), "
        "bold lines the mean over a method's seeds with a band from the lowest to the highest seed; validation "
        "Pass@1 is the periodic held-out evaluation the runs log, KL, entropy and gradient norm come from GRPO's "
        "steps.",
        data, layout, notes=notes)


# ---------------------------------------------------------------------------------------- diversity
def fig_diversity(ctx: Context) -> Figure | None:
    div = as_dict(ctx.analysis.get("diversity"))
    labels = [label for label in ctx.models if isinstance(div.get(label), dict)]
    if not labels:
        return None
    names = [ptext(label) for label in labels]
    sweeps = {label: [r for r in as_list(div[label].get("sigma_sweep")) if isinstance(r, dict)
                      and num(r.get("sigma")) is not None] for label in labels}
    has_sweep = any(sweeps.values())
    domains = [[0.0, 0.27], [0.365, 0.635], [0.73, 1.0]] if has_sweep else [[0.0, 0.44], [0.56, 1.0]]
    data: list[dict] = []
    # one JS estimator, named (reports.metrics.js_shown: a section's `estimator`, else what it holds)
    shown = [js_shown(div[label]) for label in labels]
    js, js_se = [v for v, _, _ in shown], [e for _, e, _ in shown]
    estimators = list(dict.fromkeys(name for _, _, name in shown))
    estimator = " / ".join(estimators)
    data.append({"type": "bar", "name": f"JS ({estimator}), all samples", "x": names, "y": js, "legendgroup": "js",
                 "legendgrouptitle": {"text": "divergence"},
                 "error_y": {"type": "data", "array": [v or 0 for v in js_se], "visible": True, "thickness": 1.5},
                 "marker": {"color": "#4e79a7"}, "customdata": [name for _, _, name in shown],
                 "hovertemplate": "%{x}: JS (%{customdata}) = %{y:.3g} ± %{error_y.array:.2g}<extra></extra>"})
    succ = [num(div[label].get("js_succ_mean")) for label in labels]
    if any(v is not None for v in succ):
        data.append({"type": "bar", "name": "JS, successes only", "x": names, "y": succ, "legendgroup": "js",
                     "marker": {"color": "#a0cbe8"}, "hovertemplate": "%{x}: JS (successes) = %{y:.3g}<extra></extra>"})
    cov = [("coverage_population", "population", "#59a14f"), ("coverage_centre", "centre", "#b6992d")]
    for j, (key, title, color) in enumerate(cov):
        vals = [num(div[label].get(key)) for label in labels]
        if any(v is not None for v in vals):
            data.append({"type": "bar", "name": title, "x": names, "y": vals, "xaxis": "x2", "yaxis": "y2",
                         "legendgroup": "cov", "legendgrouptitle": {"text": "coverage"},
                         "marker": {"color": color},
                         "hovertemplate": f"%{{x}}: {title} solves %{{y:.1%}}<extra></extra>"})
    layout: dict[str, Any] = {
        "height": 420, "barmode": "group", "bargap": 0.3, "hovermode": "closest",
        "xaxis": {"domain": domains[0], "type": "category"},
        "yaxis": {"title": {"text": f"Jensen–Shannon divergence, {estimator} (nats)"}, "rangemode": "tozero",
                  "exponentformat": "e"},
        "xaxis2": {"domain": domains[1], "anchor": "y2", "type": "category"},
        "yaxis2": {"anchor": "x2", "title": {"text": "problems solved"}, "tickformat": ".0%", "range": [0, 1.02]},
        "annotations": [_subplot_title("Divergence between members", *domains[0]),
                        _subplot_title("Coverage: population vs centre", *domains[1])],
        "legend": {**_legend_right(), "groupclick": "toggleitem", "tracegroupgap": 10},
        "margin": {"t": 48},
    }
    caption = ("Left: mean over prompts of the Jensen–Shannon divergence between the response distributions of "
               f"perturbed population members ({estimator}; ±1 Monte Carlo standard error, prompts fixed), i.e. "
               "how differently the population behaves; middle: the share of problems solved by at least one "
               "member versus by the unperturbed centre model")
    if has_sweep:
        first_sweep = next(i for i, label in enumerate(labels) if sweeps[label])
        for i, label in enumerate(labels):
            rows = sorted(sweeps[label], key=lambda r: r["sigma"])
            if not rows:
                continue
            color, name = ctx.color(label), ptext(label)
            xs = [num(r["sigma"]) for r in rows]
            js_rows = [js_shown(r) for r in rows]
            data.append({"type": "scatter", "mode": "lines+markers", "x": xs, "y": [v for v, _, _ in js_rows],
                         "error_y": {"type": "data", "array": [e or 0 for _, e, _ in js_rows],
                                     "visible": True, "thickness": 1.2},
                         "name": name, "legendgroup": f"s{i}",
                         "legendgrouptitle": {"text": "σ sweep"} if i == first_sweep else None,
                         "xaxis": "x3", "yaxis": "y3", "line": {"color": color, "width": 2.2},
                         "hovertemplate": f"{name}<br>σ = %{{x:.2g}}: JS = %{{y:.3g}}<extra></extra>"})
            pred = [num(r.get("js_pred")) for r in rows]
            if any(v is not None for v in pred):
                data.append({"type": "scatter", "mode": "lines", "x": xs, "y": pred, "name": f"{name} predicted",
                             "legendgroup": f"s{i}", "showlegend": False, "xaxis": "x3", "yaxis": "y3",
                             "line": {"color": color, "width": 1.8, "dash": "dash"},
                             "hovertemplate": f"{name}<br>σ = %{{x:.2g}}: predicted JS = %{{y:.3g}}<extra></extra>"})
            sigma = num(div[label].get("sigma"))
            if sigma is not None:
                layout.setdefault("shapes", []).append(
                    {"type": "line", "xref": "x3", "x0": sigma, "x1": sigma, "yref": "y3 domain", "y0": 0, "y1": 1,
                     "line": {"color": color, "width": 1, "dash": "dot"}})
        layout.update({
            "xaxis3": {"domain": domains[2], "anchor": "y3", "title": {"text": "σ (perturbation scale)"},
                       "tickformat": "~e", "nticks": 5},
            "yaxis3": {"anchor": "x3", "title": {"text": f"JS divergence, {estimator}"}, "rangemode": "tozero",
                       "exponentformat": "e"},
        })
        layout["annotations"].append(_subplot_title("Divergence vs σ", *domains[2]))
        caption += ("; right: how divergence grows with the perturbation scale σ, measured (±1 s.e.) against "
                    "the prediction (dashed), with the dotted line at the σ used")
    caption += "."
    data = [{k: v for k, v in tr.items() if v is not None} for tr in data]
    settings = {}
    for label in labels:
        d = div[label]
        text = (f"σ = {fmt_g(d.get('sigma'))}, {fmt_g(d.get('members'))} members, {fmt_g(d.get('prompts'))} "
                f"prompts × {fmt_g(d.get('samples'))} samples")
        if num(d.get("token_entropy")) is not None:
            text += f", token entropy {fmt_g(d.get('token_entropy'))}"
        settings[label] = text
    if len(labels) > 1 and len(set(settings.values())) == 1:
        meta = esc(next(iter(settings.values())))
    else:
        meta = " · ".join(f"<b>{esc(label)}</b>: {esc(text)}" for label, text in settings.items())
    notes = [] if has_sweep else ["No σ sweep in this analysis."]
    return Figure("fig-diversity", "Population diversity", caption, data, layout, meta=meta, notes=notes)


BUILDERS: list[tuple[str, Callable[[Context], Figure | None]]] = [
    ("evals", fig_passk),
    ("diff", fig_distance),
    ("diff", fig_heatmap),
    ("diff", fig_groups),
    ("diff", fig_topk),
    ("sparsify", fig_sparsify),
    ("training", fig_training),
    ("diversity", fig_diversity),
]

__all__ = ["BUILDERS", "TEMPLATE", "Figure"]
