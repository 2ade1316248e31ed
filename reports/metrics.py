"""Numbers derived from analysis.json for the report (no plotting here)."""

from __future__ import annotations

import math

from .common import as_dict, as_list, num, order_groups

GAIN_THRESHOLD = 0.9


def gain_curve(sp: dict, k: str = "1") -> tuple[list[tuple[float, float]], bool | None]:
    """(sparsity, share of the Pass@k gain retained) points sorted by sparsity, and whether there was a gain.

    The share is computed from the points' Pass@k when base and full Pass@k are known, else taken from the
    points' `gain_retained` (defined on Pass@1). `had_gain` is None when it cannot be told.
    """
    base = num(as_dict(sp.get("base_pass_at_k")).get(k))
    full = num(as_dict(sp.get("full_pass_at_k")).get(k))
    had_gain = None if base is None or full is None else full > base
    points = []
    for p in as_list(sp.get("points")):
        p = as_dict(p)
        s = num(p.get("sparsity"))
        if s is None:
            continue
        pk = num(as_dict(p.get("pass_at_k")).get(k))
        if had_gain and pk is not None:
            g = (pk - base) / (full - base)
        elif had_gain is False:
            g = None
        else:
            g = num(p.get("gain_retained")) if k == "1" else None
        if g is not None:
            points.append((s, g))
    points.sort(key=lambda t: t[0])
    return points, had_gain


def sparsity_keeping_gain(sp: dict, threshold: float = GAIN_THRESHOLD, k: str = "1") -> tuple[float | None, str]:
    """The largest sparsity that still keeps `threshold` of the Pass@k gain, linearly interpolated.

    Returns (value, qualifier): qualifier '≈' (interpolated between two tested sparsities, shown as '≈60%'),
    '≥' (every tested point kept the gain: the value is the largest tested sparsity), or a reason with value
    None ('no gain', 'no points').
    Walks up from the full model (sparsity 0, all gain) and stops at the first point below the threshold,
    so a noisy curve that dips and recovers reports the conservative (first) crossing.
    """
    points, had_gain = gain_curve(sp, k)
    if had_gain is False:
        return None, "no gain"
    points = [(s, g) for s, g in points if s > 0]
    if not points:
        return None, "no points"
    prev_s, prev_g = 0.0, 1.0
    for s, g in points:
        if g < threshold:
            if prev_g <= g:  # cannot happen after the first step; guard the division anyway
                return prev_s, "≈"
            return prev_s + (prev_g - threshold) / (prev_g - g) * (s - prev_s), "≈"
        prev_s, prev_g = s, g
    return prev_s, "≥"


def layer_grid(d: dict) -> tuple[list[int], list[str], dict[str, list[list[float | None]]]]:
    """(layers, groups, {"l2": z, "rel_l2": z}) for a layer x group heatmap of one model's diff.

    Uses `layers` rows with an integer layer; falls back to aggregating `tensors` (l2 and base_l2 add in
    quadrature) when `layers` is absent. Rows with layer = null (embeddings, final norm) are left out.
    """
    cells: dict[tuple[int, str], dict[str, float | None]] = {}
    rows = [r for r in as_list(d.get("layers")) if isinstance(r, dict)]
    if rows:
        for r in rows:
            layer = r.get("layer")
            if isinstance(layer, bool) or not isinstance(layer, int):
                continue
            cells[(layer, str(r.get("group", "other")))] = {"l2": num(r.get("l2")), "rel_l2": num(r.get("rel_l2"))}
    else:
        acc: dict[tuple[int, str], list[float]] = {}
        for t in as_list(d.get("tensors")):
            if not isinstance(t, dict):
                continue
            layer = t.get("layer")
            if isinstance(layer, bool) or not isinstance(layer, int):
                continue
            l2, base = num(t.get("l2")), num(t.get("base_l2"))
            a = acc.setdefault((layer, str(t.get("group", "other"))), [0.0, 0.0, 1.0])
            if l2 is None:
                a[2] = 0.0
            else:
                a[0] += l2 * l2
            if base is None:
                a[2] = 0.0
            else:
                a[1] += base * base
        for key, (l2sq, basesq, ok) in acc.items():
            l2 = math.sqrt(l2sq) if ok else None
            rel = l2 / math.sqrt(basesq) if ok and basesq > 0 else None
            cells[key] = {"l2": l2, "rel_l2": rel}
    layers = sorted({layer for layer, _ in cells})
    groups = order_groups(g for _, g in cells)
    z = {m: [[as_dict(cells.get((layer, g))).get(m) for g in groups] for layer in layers] for m in ("l2", "rel_l2")}
    return layers, groups, z


# ------------------------------------------------------------------------- Pass@K intervals, seeds
Z95 = 1.959964


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased Pass@k of one problem with c correct of n samples: 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):  # C(n-c, k)/C(n, k) as a product: no huge integers
        prod *= 1.0 - k / i
    return 1.0 - prod


def per_problem_counts(ev: dict) -> list[tuple[int, int]]:
    """(correct, n) per problem of an evaluation; empty when it has no usable per_problem rows."""
    out = []
    for r in as_list(ev.get("per_problem")):
        c, n = as_dict(r).get("correct"), as_dict(r).get("n")
        if isinstance(c, int) and isinstance(n, int) and not isinstance(c, bool) and 0 <= c <= n and n >= 1:
            out.append((c, n))
    return out


def passk_interval(evs: list[dict], ks: list[float]) -> tuple[list[float | None], list[float | None]] | None:
    """95% normal-approximation interval over problems of Pass@K (K in `ks`), for the mean over `evs`.

    Each problem's Pass@K is averaged over the evaluations first (seeds of a method, or one evaluation), then
    mean ± 1.96 · sd / sqrt(problems), clipped to [0, 1]: the uncertainty from which test problems were drawn.
    None when some evaluation lacks per-problem counts or they cover different numbers of problems.
    """
    counts = [per_problem_counts(ev) for ev in evs]
    m = len(counts[0]) if counts else 0
    if m < 2 or any(len(c) != m for c in counts):
        return None
    lo, hi = [], []
    for k in ks:
        if k is None or k < 1 or any(k > n for cs in counts for _, n in cs):
            lo.append(None)
            hi.append(None)
            continue
        vals = [sum(pass_at_k(cs[i][1], cs[i][0], int(k)) for cs in counts) / len(counts) for i in range(m)]
        mean = sum(vals) / m
        sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / (m - 1))
        half = Z95 * sd / math.sqrt(m)
        lo.append(max(0.0, mean - half))
        hi.append(min(1.0, mean + half))
    return lo, hi


def study_base_evaluations(ctx) -> list[dict]:
    """A study's base at its verdict temperature, one evaluation-like {"per_problem": rows} per sampling seed
    (study.data.evaluations); empty for an analysis without them."""
    study = as_dict(ctx.analysis.get("study"))
    data = as_dict(study.get("data"))
    t = num(data.get("temperature"))
    by_t = as_dict(data.get("evaluations"))
    seeds = as_list(as_dict(by_t.get(f"{t:g}" if t is not None else "")).get("base"))
    return [{"per_problem": as_list(rows)} for rows in seeds if as_list(rows)]


def mean_band(series: list[list[float | None]]) -> tuple[list[float | None], list[float | None], list[float | None]]:
    """Pointwise mean, min and max over equally long series (None where any series lacks the point)."""
    mean, lo, hi = [], [], []
    for vals in zip(*series):
        if any(v is None for v in vals):
            mean.append(None)
            lo.append(None)
            hi.append(None)
        else:
            mean.append(sum(vals) / len(vals))
            lo.append(min(vals))
            hi.append(max(vals))
    return mean, lo, hi


def ratio_rows(ctx) -> list[dict]:
    """Whole-model distance ratios per pair of methods, over every pair of their runs.

    One row per unordered method pair, oriented so that the mean ratio is >= 1 (the method that moved
    farther on top): mean, min and max of rel_l2(a) / rel_l2(b) over all (run of a, run of b) pairs, and
    the mean over seed-matched pairs (a-s0 / b-s0, ...) where both methods have the same seeds.
    """
    diff = as_dict(ctx.analysis.get("diff"))

    def rel(label):
        v = as_dict(as_dict(diff.get(label)).get("whole")).get("rel_l2")
        return v if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else None

    methods = [(m, [lab for lab in labs if rel(lab) is not None]) for m, labs in ctx.methods.items()]
    methods = [(m, labs) for m, labs in methods if labs]
    rows = []
    for i, (ma, la) in enumerate(methods):
        for mb, lb in methods[i + 1:]:
            vals = [rel(a) / rel(b) for a in la for b in lb]
            mean = sum(vals) / len(vals)
            if mean < 1:
                ma_, mb_, la_, lb_ = mb, ma, lb, la
                vals = [1 / v for v in vals]
                mean = sum(vals) / len(vals)
            else:
                ma_, mb_, la_, lb_ = ma, mb, la, lb
            seeds_a = {ctx.seed_of(a): a for a in la_}
            seeds_b = {ctx.seed_of(b): b for b in lb_}
            common = [s for s in seeds_a if s is not None and s in seeds_b]
            matched = [rel(seeds_a[s]) / rel(seeds_b[s]) for s in common]
            rows.append({"a": ma_, "b": mb_, "mean": mean, "min": min(vals), "max": max(vals), "pairs": len(vals),
                         "matched": sum(matched) / len(matched) if len(matched) > 1 else None,
                         "n_matched": len(matched)})
    return rows


# ---------------------------------------------------------------------------------------- diversity: JS
# The one Jensen-Shannon estimator a report shows (deltalens.analysis.diversity.estimators): the posterior
# (mutual-information) form. Sections that name it (`estimator`) hold it in js_mean / js_se (per prompt:
# js / js_se); older sections without the field hold the direct estimate there and the posterior one in
# js_mi_mean / js_mi_se (per prompt: js_mi / js_mi_se), which is shown when present.
JS_ESTIMATOR_NAMES = {"posterior": "posterior estimator", "direct": "direct estimator"}


def js_shown(row: dict, section: dict | None = None, mean: str = "js_mean", se: str = "js_se",
             mi: str = "js_mi_mean", mi_se: str = "js_mi_se") -> tuple[float | None, float | None, str]:
    """(JS, its s.e., the estimator's name) of a diversity section or σ-sweep row (`section` None), or of a
    per-prompt row of `section` (pass mean="js", se="js_se", mi="js_mi", mi_se="js_mi_se")."""
    named = as_dict(section if section is not None else row).get("estimator")
    if isinstance(named, str):
        return num(row.get(mean)), num(row.get(se)), JS_ESTIMATOR_NAMES.get(named, f"{named} estimator")
    if num(row.get(mi)) is not None:
        return num(row.get(mi)), num(row.get(mi_se)), JS_ESTIMATOR_NAMES["posterior"]
    return num(row.get(mean)), num(row.get(se)), JS_ESTIMATOR_NAMES["direct"]
