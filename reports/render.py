"""analysis.json -> one self-contained HTML file (plotly.js and the data inlined; opens offline).

Public API: `render_report(analysis, out_path)`, `render_file(analysis_json_path, out_path=None)`,
`build_html(analysis)` (the page as a string) and `load_analysis(path)` (read + validate).

Safety: user strings (labels, paths, prompts, task names) are HTML-escaped wherever they enter markup, and
the data island is JSON with every `<`, `>` and `&` written as a \\u escape, so no string in analysis.json
can close the <script> element or inject markup. No external URL is referenced: the page needs no network.

plotly.js: the page inlines plotly's "cartesian" partial bundle (templates/plotly-cartesian.min.js, MIT,
version PLOTLY_BUNDLE_VERSION, ~1.5 MB instead of the full 4.8 MB), which holds every trace type the figures
draw (scatter, bar, heatmap). Before inlining it the renderer checks that each figure's trace types are in
the bundle; if one is not (a future figure), the full plotly.js of the installed plotly package is inlined
instead and the page says so.
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import math
import os
import re
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import DeltalensError
from ..schema import SCHEMA_VERSION, check_version, read_text
from .common import Context, esc
from .figures import BUILDERS, TEMPLATE, Figure
from .tables import (
    claims_table,
    completions_section,
    held_out_table,
    inputs_table,
    per_problem_table,
    per_prompt_table,
    ratio_table,
    summary_table,
    warnings_list,
)

# section key -> (title, how to add it). Shown in the "not in this analysis" note.
SECTIONS: dict[str, tuple[str, str]] = {
    "diff": ("Weight deltas (distance, layers, groups, top coordinates)", "`deltalens diff`"),
    "evals": ("Pass@K evaluation", "`deltalens report ... --task T`"),
    "sparsify": ("Sparsification of the update", "`deltalens report ... --task T --thresholds 5e-4,1e-3`"),
    "training": ("Training reward curves", "pass run directories (runs/es) rather than bare checkpoints"),
    "diversity": ("Population diversity", "`deltalens report ... --task T --diversity`"),
    "held_out": ("Forgetting on held-out tasks", "`deltalens report ... --task T --held-out arith-3,arith-long`"),
}
# the same, where the analysis is a study's (`deltalens study` writes every section but the held-out one
# unless asked): its own options, not `deltalens report`'s
STUDY_SECTIONS: dict[str, str] = {
    "held_out": "`deltalens study ... --held-out arith-3,arith-long`",
}
MAX_DEPTH = 64  # analysis.json nests about 8 levels; far deeper input would exhaust the renderer's recursion
_DRAW_ERRORS = (KeyError, TypeError, ValueError, AttributeError, IndexError, ZeroDivisionError)


def _renderer_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("deltalens")
    except PackageNotFoundError:  # running from a checkout that is not installed
        from .. import __version__

        return str(__version__)


# ------------------------------------------------------------------------------------------- input
def validate(analysis: Any) -> dict:
    """Check the envelope of an analysis; return it. Raises DeltalensError with a one-line message."""
    if not isinstance(analysis, dict):
        raise DeltalensError(f"analysis.json must hold a JSON object, not {type(analysis).__name__}")
    check_version(analysis, _renderer_version())
    return analysis


def load_analysis(path: str | os.PathLike) -> dict:
    """Read and validate an analysis.json file (or a published analysis.json.gz)."""
    path = Path(path)
    try:
        text = read_text(path)
    except FileNotFoundError:
        raise DeltalensError(f"no such file: {path}") from None
    except IsADirectoryError:
        raise DeltalensError(f"{path} is a directory; pass the analysis.json file inside it") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DeltalensError(f"cannot read {path}: {e}") from None
    try:
        analysis = json.loads(text, parse_int=_bounded_int)
    except json.JSONDecodeError as e:
        raise DeltalensError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
    except RecursionError:
        raise DeltalensError(f"{path}: JSON nested too deeply to be an analysis") from None
    except ValueError as e:  # from _bounded_int
        raise DeltalensError(f"{path}: {e}") from None
    if _depth_exceeds(analysis, MAX_DEPTH):
        raise DeltalensError(f"{path}: JSON nested deeper than {MAX_DEPTH} levels; not an analysis")
    return validate(analysis)


def _bounded_int(text: str) -> int:
    """json's int parser, refusing integers no float can hold (figures convert numbers to floats)."""
    if len(text.lstrip("-")) > 300:
        raise ValueError(f"integer {text[:12]}... ({len(text)} digits) is out of range for an analysis")
    return int(text)


def _depth_exceeds(obj: Any, limit: int) -> bool:
    """Whether containers nest more than `limit` deep (iterative: no recursion on hostile input)."""
    stack = [(obj, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, (dict, list)):
            if d > limit:
                return True
            stack.extend((v, d + 1) for v in (x.values() if isinstance(x, dict) else x))
    return False


# ------------------------------------------------------------------------------------------ assets
def _template(name: str) -> str:
    try:
        return resources.files(__package__).joinpath("templates", name).read_text(encoding="utf-8")
    except (FileNotFoundError, ModuleNotFoundError, TypeError):
        return (Path(__file__).parent / "templates" / name).read_text(encoding="utf-8")


# The partial bundle vendored in templates/ (npm plotly.js-cartesian-dist-min) and the trace types it holds.
PLOTLY_BUNDLE = "plotly-cartesian.min.js"
PLOTLY_BUNDLE_VERSION = "4.1.1"
PLOTLY_BUNDLE_TRACES = frozenset({"bar", "box", "contour", "heatmap", "histogram", "histogram2d",
                                  "histogram2dcontour", "image", "pie", "scatter", "scatterternary", "violin"})


def _trace_types(figures: list[Figure]) -> set[str]:
    return {str(t.get("type") or "scatter") for f in figures for t in f.data}


@functools.lru_cache(maxsize=1)
def _plotly_bundle() -> str:
    return _script_safe(_template(PLOTLY_BUNDLE))


@functools.lru_cache(maxsize=1)
def _plotly_js() -> str:
    try:
        from plotly.offline import get_plotlyjs
    except ImportError as e:  # plotly is a core dependency; say how to fix a broken environment
        raise DeltalensError("rendering a report needs plotly: pip install 'plotly>=5.20'") from e
    return _script_safe(get_plotlyjs())


def _script_safe(js: str) -> str:
    """Make inline JS safe inside <script>: no `</script` and no `<!--` (neither occurs in plotly.js today)."""
    js = re.sub(r"</(script)", r"<\\/\1", js, flags=re.IGNORECASE)
    return js.replace("<!--", "<\\!--")


def _json_island(payload: Any) -> str:
    """JSON for a <script type="application/json">: `<`, `>`, `&` and the JS line separators as \\u escapes."""
    text = json.dumps(_finite(payload), ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    for ch, rep in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"),
                    ("\u2029", "\\u2029")):
        text = text.replace(ch, rep)
    return text


def _finite(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


# ------------------------------------------------------------------------------------------- page
def _present(analysis: dict, key: str) -> bool:
    v = analysis.get(key)
    return isinstance(v, dict) and len(v) > 0


def _figure_section(fig: Figure) -> str:
    parts = [f'<section class="card" id="sec-{fig.id}" data-figure="{fig.id}">', f"<h2>{esc(fig.title)}</h2>",
             f'<p class="caption">{esc(fig.caption)}</p>']
    if fig.meta:
        parts.append(f'<p class="meta-line">{fig.meta}</p>')
    parts.append(fig.controls_html)
    # An explicit height: with responsive resizing plotly sizes the plot to its div, not to layout.height.
    height = int(fig.layout.get("height") or 420)
    parts.append(f'<div class="fig" id="{fig.id}" style="height:{height}px" role="img" '
                 f'aria-label="{esc(fig.title)}"></div>')
    parts += [f'<p class="note">{esc(n)}</p>' for n in fig.notes]
    parts.append(fig.after_html)
    parts.append("</section>")
    return "\n".join(p for p in parts if p)


def _fmt_time(value: Any) -> str:
    if not value:
        return "unknown"
    try:
        t = _dt.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
        return t.strftime("%Y-%m-%d %H:%M UTC") if t.utcoffset() == _dt.timedelta(0) else t.isoformat(" ")
    except ValueError:
        return str(value)


def build_html(analysis: dict, *, rendered_at: _dt.datetime | None = None) -> str:
    """The complete report page for a validated analysis, as a string."""
    analysis = validate(analysis)
    ctx = Context(analysis)
    figures: list[Figure] = []
    problems: list[str] = []
    for section, builder in BUILDERS:
        if not _present(analysis, section):
            continue
        try:
            fig = builder(ctx)
        except _DRAW_ERRORS as e:
            problems.append(f"Could not draw {builder.__name__[4:]} from '{section}': {type(e).__name__}: {e}")
            continue
        if fig is not None:
            figures.append(fig)
    for fig in figures:
        if fig.id == "fig-passk":
            fig.after_html = _safe(per_problem_table, ctx, problems)
        elif fig.id == "fig-diversity":
            fig.after_html = _safe(per_prompt_table, ctx, problems)
        elif fig.id == "fig-distance":
            fig.after_html = _safe(ratio_table, ctx, problems)

    held = _safe(held_out_table, ctx, problems) if _present(analysis, "held_out") else None
    claims = _safe(claims_table, ctx, problems) if _present(analysis, "study") else None
    absent = [k for k in SECTIONS if not _present(analysis, k)]
    completions = _safe(completions_section, ctx, problems) if _present(analysis, "evals") else None
    outside = sorted(_trace_types(figures) - PLOTLY_BUNDLE_TRACES)
    if outside:  # a figure the partial bundle cannot draw: inline all of plotly.js rather than break it
        problems.append(f"Trace types {', '.join(outside)} are not in plotly.js's cartesian bundle; the full "
                        "plotly.js is inlined instead (a larger file).")

    body: list[str] = []
    models = ", ".join(ctx.models) or "no models"
    rendered_at = rendered_at or _dt.datetime.now(_dt.timezone.utc)
    meta_items = [
        ("Analysis created", _fmt_time(analysis.get("created"))),
        ("deltalens (analysis)", analysis.get("deltalens_version") or "unknown"),
        ("Rendered", f"{rendered_at.strftime('%Y-%m-%d %H:%M UTC')} by deltalens {_renderer_version()}"),
        ("Schema", f"v{analysis['schema_version']}"),
    ]
    body.append(
        '<header class="page-head"><div class="brand">deltalens</div>'
        f'<h1>What changed: {esc(models)} <span class="vs">vs</span> {esc(ctx.base_label)}</h1>'
        '<dl class="meta">' + "".join(f"<div><dt>{esc(k)}</dt><dd>{esc(v)}</dd></div>" for k, v in meta_items)
        + "</dl></header>")
    toc = [("sec-summary", "Summary")] + ([("sec-claims", "Claims")] if claims else []) + [
        (f"sec-{f.id}", f.title) for f in figures]
    if completions is not None:
        toc.append(("sec-completions", "Sample completions"))
    if held is not None:
        toc.append(("sec-heldout", "Forgetting"))
    body.append('<nav class="toc" aria-label="Sections">'
                + "".join(f'<a href="#{i}">{esc(t)}</a>' for i, t in toc) + "</nav>")

    summary = ['<section class="card" id="sec-summary"><h2>Summary</h2>',
               ('<p class="caption">One row per model: Pass@K with the change from base in percentage points '
                '(green up, red down), how far the weights moved from the initial model, and how much of the '
                'update can be zeroed while keeping 90% of the Pass@1 gain; a method trained with several '
                'seeds has a row for its mean above its runs. Distance ratios between methods are in the table '
                'under the distance figure.</p>'), _safe(summary_table, ctx, problems), _safe(warnings_list, ctx, problems)]
    if absent:
        study = isinstance(analysis.get("study"), dict)
        items = "".join(f"<li><b>{esc(SECTIONS[k][0])}</b> — add with "
                        f"{_code(STUDY_SECTIONS.get(k, SECTIONS[k][1]) if study else SECTIONS[k][1])}</li>"
                        for k in absent)
        summary.append(f'<div class="absent" id="sections-absent"><b>Sections absent from this analysis</b>'
                       f"<ul>{items}</ul></div>")
    if problems:
        items = "".join(f"<li>{esc(p)}</li>" for p in problems)
        summary.append(f'<div class="warn" id="render-problems"><b>Parts of analysis.json could not be shown'
                       f"</b><ul>{items}</ul></div>")
    summary.append('<details class="more"><summary>Inputs</summary>' + _safe(inputs_table, ctx, problems)
                   + "</details></section>")
    body.append("\n".join(summary))
    if claims:
        body.append('<section class="card" id="sec-claims"><h2>Claims of arXiv 2608.27351: verdicts</h2>'
                    '<p class="caption">Each claim is tested as directional checks, every one with a 95% bootstrap '
                    'interval (over test problems and, where there are several, training seeds).</p>'
                    + claims + "</section>")
    body += [_figure_section(f) for f in figures]
    if completions is not None:
        body.append('<section class="card" id="sec-completions"><h2>Sample completions</h2>' + completions
                    + "</section>")
    if held is not None:
        body.append('<section class="card" id="sec-heldout"><h2>Forgetting on held-out tasks</h2>'
                    '<p class="caption">Pass@K on tasks that were not trained on, with the change from base; a red '
                    'drop means the model forgot something the base model could do.</p>' + held + "</section>")
    body.append('<footer class="page-foot">Generated by deltalens from analysis.json (schema v'
                f'{esc(analysis["schema_version"])}). This file is self-contained and works offline.</footer>')

    payload: dict[str, Any] = {"template": TEMPLATE, "figures": [f.spec() for f in figures]}
    for f in figures:
        payload.update(f.extra)
    fills = {
        "TITLE": esc(f"deltalens report: {models} vs {ctx.base_label}"),
        "CSS": _template("report.css"),
        "BODY": "\n".join(body),
        "DATA": _json_island(payload),
        "PLOTLY": _plotly_js() if outside else _plotly_bundle(),
        "APP": _script_safe(_template("report.js")),
        "GENERATOR": esc(f"deltalens {_renderer_version()}"),
    }
    return re.sub(r"\{\{([A-Z]+)\}\}", lambda m: fills[m.group(1)], _template("report.html"))


def _code(text: str) -> str:
    """Escape text, rendering `backticked` spans as <code>."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", esc(text))


def _safe(fn, ctx: Context, problems: list[str]) -> str:
    try:
        return fn(ctx) or ""
    except _DRAW_ERRORS as e:
        problems.append(f"Could not build {fn.__name__.replace('_', ' ')}: {type(e).__name__}: {e}")
        return ""


# ------------------------------------------------------------------------------------------ output
def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def render_report(analysis: dict, out_path: str | os.PathLike) -> Path:
    """Render `analysis` (a parsed analysis.json) to one self-contained HTML file; return its path.

    The file is written atomically (temp file in the same directory, then os.replace), so a reader never
    sees a half-written report. Raises DeltalensError for an unusable analysis or output path.
    """
    out = Path(out_path)
    if out.is_dir():
        raise DeltalensError(f"output {out} is a directory; give a file name such as {out / 'report.html'}")
    page = build_html(analysis)
    try:
        _write_atomic(out, page)
    except OSError as e:
        raise DeltalensError(f"cannot write {out}: {e.strerror or e}") from None
    return out


def default_html(src: Path) -> Path:
    """Where `render` writes by default: the input with suffix .html, a .json.gz losing both suffixes."""
    return (src.with_suffix("") if src.suffix == ".gz" else src).with_suffix(".html")


def render_file(analysis_json_path: str | os.PathLike, out_path: str | os.PathLike | None = None) -> Path:
    """Render the analysis.json at `analysis_json_path`; default output: the same path with suffix .html
    (analysis.json.gz -> analysis.html)."""
    src = Path(analysis_json_path)
    analysis = load_analysis(src)
    out = Path(out_path) if out_path is not None else default_html(src)
    if out.resolve() == src.resolve():
        raise DeltalensError(f"output {out} would overwrite the analysis itself; choose another name")
    return render_report(analysis, out)


__all__ = ["PLOTLY_BUNDLE_VERSION", "SCHEMA_VERSION", "SECTIONS", "build_html", "default_html", "load_analysis",
           "render_file", "render_report", "validate"]
