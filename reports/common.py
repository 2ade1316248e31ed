"""Shared helpers: escaping, number formatting, labels, colours, methods. Pure Python; no plotly, no torch.

Colours: one hue per training method (es blue, grpo orange, es-grpo green, others after), and for a method
trained with several seeds one shade of that hue per seed (darker to lighter in seed order), so a study's
nine runs read as three families. A model without a method is a family of its own.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Iterable
from typing import Any

# Parameter groups in the order a transformer block reads them (docs/analysis-schema.md).
GROUP_ORDER = ["embed", "attn_q", "attn_k", "attn_v", "attn_o", "attn_bias", "mlp_gate", "mlp_up", "mlp_down",
               "norm", "lm_head", "other"]
GROUP_COLORS = {
    "embed": "#4e79a7", "attn_q": "#a0cbe8", "attn_k": "#f28e2b", "attn_v": "#ffbe7d", "attn_o": "#59a14f",
    "attn_bias": "#8cd17d", "mlp_gate": "#b6992d", "mlp_up": "#f1ce63", "mlp_down": "#499894",
    "norm": "#e15759", "lm_head": "#b07aa1", "other": "#9d7660",
}
EXTRA_GROUP_COLORS = ["#d37295", "#fabfd2", "#86bcb6", "#79706e", "#bab0ac", "#d4a6c8"]
BASE_COLOR = "#8a9099"
MODEL_COLORS = ["#2563eb", "#e8590c", "#0f9d76", "#9333ea", "#d6336c", "#ca8a04", "#0891b2", "#4d7c0f"]
# The methods deltalens trains keep their hue in every report; other methods take the remaining ones in order.
METHOD_HUES = {"es": "#2563eb", "grpo": "#e8590c", "es-grpo": "#0f9d76", "grpo-es": "#9333ea"}
_SEED_RE = re.compile(r"^(.*)-s(\d+)$")


def esc(value: Any) -> str:
    """HTML-escape any value for element text or a quoted attribute."""
    return html.escape("" if value is None else str(value), quote=True)


def ptext(value: Any) -> str:
    """Escape a user string for plotly, which renders a small HTML subset in SVG text.

    plotly decodes &amp; &lt; &gt; back to characters, so the label shows literally and no tag in it is
    interpreted (a label `<b>x</b>` stays as typed instead of turning bold).
    """
    return str(value).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def num(value: Any) -> float | None:
    """A finite float, or None for null / NaN / Inf / non-numbers (bools are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def sort_ks(keys: Iterable[Any]) -> list[str]:
    """Pass@K keys ("1", "16", ...) in numeric order; non-numeric keys last, alphabetically."""
    def key(k: Any) -> tuple[int, float, str]:
        try:
            return (0, float(k), "")
        except (TypeError, ValueError):
            return (1, 0.0, str(k))
    return [str(k) for k in sorted(dict.fromkeys(str(k) for k in keys), key=key)]


def order_groups(names: Iterable[str]) -> list[str]:
    names = list(dict.fromkeys(str(n) for n in names))
    known = [g for g in GROUP_ORDER if g in names]
    return known + sorted(n for n in names if n not in GROUP_ORDER)


def group_color(group: str, extra_index: dict[str, int]) -> str:
    if group in GROUP_COLORS:
        return GROUP_COLORS[group]
    i = extra_index.setdefault(group, len(extra_index))
    return EXTRA_GROUP_COLORS[i % len(EXTRA_GROUP_COLORS)]


def shade(hex_color: str, t: float) -> str:
    """`hex_color` mixed towards black (t < 0) or white (t > 0); t in [-1, 1]."""
    h = hex_color.lstrip("#")
    rgb = [int(h[i:i + 2], 16) for i in (0, 2, 4)]
    target = 255 if t > 0 else 0
    return "#" + "".join(f"{round(c + (target - c) * abs(t)):02x}" for c in rgb)


def seed_shades(hex_color: str, n: int) -> list[str]:
    """n shades of one hue, darker to lighter; the hue itself for one."""
    if n <= 1:
        return [hex_color] * n
    return [shade(hex_color, -0.3 + 0.75 * i / (n - 1)) for i in range(n)]


def rgba(hex_color: str, alpha: float) -> str:
    h = hex_color.lstrip("#")
    r, g, b = (int(h[i:i + 2], 16) for i in (0, 2, 4))
    return f"rgba({r},{g},{b},{alpha})"


def fmt_pct(x: Any, digits: int = 1) -> str:
    x = num(x)
    return "—" if x is None else f"{100 * x:.{digits}f}%"


def fmt_pp(d: Any) -> str:
    """A change in percentage points, signed."""
    d = num(d)
    if d is None:
        return ""
    return f"{100 * d:+.1f} pp".replace("-", "−")


def fmt_g(x: Any) -> str:
    """Compact general number: 0.0307, 7.23e-4, 41.7, 8.1e+05."""
    x = num(x)
    if x is None:
        return "—"
    if x == 0:
        return "0"
    if 1e-3 <= abs(x) < 1e5:
        return f"{x:.3g}"
    mant, exp = f"{x:.2e}".split("e")
    return f"{mant}e{int(exp)}"


def fmt_ci(lo: Any, hi: Any, missing: str = "—") -> str:
    """A 95% interval, [lo, hi] in fmt_g; `missing` when either end is undefined."""
    lo, hi = num(lo), num(hi)
    return missing if lo is None or hi is None else f"[{fmt_g(lo)}, {fmt_g(hi)}]"


# What the "per seed" column of a verdict table holds (Markdown and HTML say the same).
PER_SEED_NOTE = ("Per seed: the check's value for each training seed of the method; where it compares with the base "
                 "or with another trained method, each seed is compared with the other side's mean over its seeds.")


def per_seed_text(check: dict) -> str:
    """A verdict check's value for each training seed ("0.12, 0.15"), so that the spread behind an interval
    over 2-5 seeds is visible; empty for a check with one value (or none) per seed."""
    vals = [fmt_g(v) for v in as_list(check.get("per_seed")) if num(v) is not None]
    return ", ".join(vals) if len(vals) > 1 else ""


def check_label(check: dict) -> str:
    """A verdict check's name as a table shows it: the "grpo minus es" problems-lost share also states ES's
    own count per run (`lost_es`), so both methods' losses are read directly, not from a share difference."""
    name = str(check.get("check"))
    lost = [int(v) for v in as_list(check.get("lost_es")) if num(v) is not None]
    if not lost:
        return name
    return f"{name}; es lost {', '.join(map(str, lost))} problem{'s' if lost != [1] else ''} (per run)"


def fmt_int(x: Any) -> str:
    x = num(x)
    return "—" if x is None else f"{int(x):,}"


def as_dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def as_list(value: Any) -> list:
    return value if isinstance(value, list) else []


class Context:
    """What every section needs: the analysis, model labels in order, the base key, and colours."""

    def __init__(self, analysis: dict):
        self.analysis = analysis
        base = as_dict(analysis.get("base"))
        self.base_label = str(base.get("label") or "base")
        self.base_path = base.get("path")
        self.model_info: dict[str, dict] = {}
        for m in as_list(analysis.get("models")):
            if isinstance(m, dict) and m.get("label") is not None:
                self.model_info.setdefault(str(m["label"]), m)
        labels = list(self.model_info)
        # Labels that appear only inside sections (a hand-edited or merged analysis) come after, in order.
        for section in ("diff", "evals", "sparsify", "training", "diversity", "held_out"):
            for key in as_dict(analysis.get(section)):
                if not self.is_base(key) and key not in labels:
                    labels.append(key)
        self.models = labels
        # method -> its labels in order (a model without a method is a family of its own, keyed by its label)
        self.methods: dict[str, list[str]] = {}
        for label in labels:
            self.methods.setdefault(self.method_of(label), []).append(label)
        free = [c for c in MODEL_COLORS if c not in METHOD_HUES.values()]
        self.method_colors: dict[str, str] = {}
        for method in self.methods:
            if method in METHOD_HUES:
                self.method_colors[method] = METHOD_HUES[method]
            else:
                self.method_colors[method] = (free or MODEL_COLORS)[
                    len([m for m in self.method_colors if m not in METHOD_HUES]) % len(free or MODEL_COLORS)]
        self.colors = {}
        for method, members in self.methods.items():
            self.colors.update(zip(members, seed_shades(self.method_colors[method], len(members))))
        self.colors.setdefault("base", BASE_COLOR)
        self.colors[self.base_label] = BASE_COLOR

    def method_of(self, label: str) -> str:
        """The training method of a model (models[].method, else its training section's), else the label."""
        method = self.model_info.get(label, {}).get("method")
        if not method:
            method = as_dict(as_dict(self.analysis.get("training")).get(label)).get("method")
        return str(method) if method else label

    def seed_of(self, label: str) -> str | None:
        """The training seed of a model: the study's runs[].seed, else a `-s<N>` label suffix."""
        for r in as_list(as_dict(self.analysis.get("study")).get("runs")):
            if isinstance(r, dict) and r.get("label") == label and r.get("seed") is not None:
                return str(r["seed"])
        m = _SEED_RE.match(label)
        return m.group(2) if m and m.group(1) == self.method_of(label) else None

    @property
    def multi_seed(self) -> bool:
        """Whether some method has several runs (a study): figures then draw a mean per method."""
        return any(len(v) > 1 for v in self.methods.values())

    def method_name(self, method: str) -> str:
        n = len(self.methods.get(method, []))
        return f"{method} (mean of {n} seeds)" if n > 1 else method

    def is_base(self, key: str) -> bool:
        return key in ("base", self.base_label) and key not in self.model_info

    def base_key(self, section: dict) -> str | None:
        """The key the base model has in a section keyed by '<label or base>'."""
        for key in ("base", self.base_label):
            if key in section and key not in self.model_info:
                return key
        return None

    def color(self, label: str) -> str:
        return self.colors.get(label, BASE_COLOR)

    def display(self, key: str) -> str:
        """The label to show for a section key: the base's label for 'base'."""
        return self.base_label if key == "base" else key

    def with_base(self, section: dict) -> list[tuple[str, bool]]:
        """(key, is_base) for keys of `section`: base first, then models in command-line order."""
        out: list[tuple[str, bool]] = []
        bk = self.base_key(section)
        if bk is not None:
            out.append((bk, True))
        out += [(label, False) for label in self.models if label in section]
        return out
