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
