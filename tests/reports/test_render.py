"""deltalens.reports: analysis.json -> one self-contained HTML file (no browser needed here)."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from deltalens.reports import build_html, render_file, render_report
from deltalens.reports.figures import TEMPLATE
from deltalens.reports.metrics import gain_curve, layer_grid, sparsity_keeping_gain

from deltalens.errors import DeltalensError

FIXTURE = Path(__file__).parents[1] / "fixtures" / "analysis_full.json"
ALL_FIGURES = ["fig-passk", "fig-distance", "fig-heatmap", "fig-groups", "fig-topk", "fig-sparsify",
               "fig-training", "fig-diversity"]
EVIL_LABEL = "<script>alert(1)</script>"
EVIL_PROMPT = "Q: 1+1=?</script><script>alert(2)</script>\nA:"
EVIL_PATH = '"><img src=x onerror=alert(3)>'


@pytest.fixture
def full() -> dict:
    return json.loads(FIXTURE.read_text())


def minimal_diff() -> dict:
    """Only what `deltalens diff` of one model writes: whole, groups, layers (no top-k, no tensors)."""
    def m(l2, base):
        return {"n": 1000, "l2": l2, "base_l2": base, "rel_l2": l2 / base, "max_abs": l2 / 10, "mean_abs": l2 / 100,
                "frac_changed": 1.0, "frac_above_tol": 0.9}
    layers = [{"layer": i, "group": g, **m(0.1 * (i + 1) * (j + 1), 2.0 + j)}
              for i in range(2) for j, g in enumerate(["attn_q", "mlp_up"])]
    layers.append({"layer": None, "group": "embed", **m(0.3, 5.0)})
    return {
        "schema_version": 1, "deltalens_version": "0.1.0", "created": "2026-11-29T22:00:00Z",
        "base": {"label": "base", "path": "tiny"},
        "models": [{"label": "ft", "path": "ckpt/ft", "kind": "checkpoint", "method": None}],
        "diff": {"ft": {"dtype": "float32", "n_params": 5000, "tol": 1e-6, "whole": m(0.6, 9.0),
                        "groups": {"attn_q": m(0.2, 3.0), "mlp_up": m(0.5, 4.0), "embed": m(0.3, 5.0)},
                        "layers": layers, "warnings": []}},
    }


def island(html: str) -> dict:
    match = re.search(r'<script type="application/json" id="deltalens-data">(.*?)</script>', html, re.DOTALL)
    assert match, "no data island"
    return json.loads(match.group(1))


def figure_ids(html: str) -> set[str]:
    return set(re.findall(r'<div class="fig" id="([^"]+)"', html))


def strip_plotly(html: str) -> str:
    """The page without the inlined plotly.js (third-party code that mentions URLs in strings)."""
    start = html.index("<script>window.PlotlyConfig")
    end = html.index("</script>", html.index("<script>", start + 10))
    return html[:start] + html[end:]


# ------------------------------------------------------------------------------------------ content
def test_full_fixture_has_every_section(tmp_path, full):
    out = render_report(full, tmp_path / "report.html")
    html = out.read_text()
    assert figure_ids(html) == set(ALL_FIGURES)
    assert [f["id"] for f in island(html)["figures"]] == ALL_FIGURES
    assert 'id="sections-absent"' not in html
    assert 'id="render-problems"' not in html
    assert 'id="sec-heldout"' in html and "arith-long" in html
    assert "Per-problem results (100 problems)" in html and "Per-prompt divergence (16 prompts)" in html
    # header: title, creation time, versions
    assert "<title>deltalens report: es, grpo vs base</title>" in html
    assert "2026-11-29 22:00 UTC" in html and "deltalens 0.1.0" in html
    # summary: Pass@K with change vs base, distance, sparsity at 90% of the gain (ratios are in their own table)
    summary = html[html.index('id="sec-summary"'):html.index('id="sec-fig-passk"')]
    for text in ("Pass@1", "Pass@16", "Pass@32", "16.6%", "+4.5 pp", "29.1%", "+17.0 pp", "0.0307", "7.23e-4",
                 "56%", "66%", "lm_head.weight: 3 values differ"):
        assert text in summary, text
    assert "× grpo" not in summary
    ratios = html[html.index('id="ratio-table"'):]
    ratios = ratios[:ratios.index("</table>")]
    es, grpo = (full["diff"][m]["whole"]["rel_l2"] for m in ("es", "grpo"))
    assert f"<b>{es / grpo:.3g}×</b>" in ratios and ">es</th>" not in ratios and "es / " in ratios


def test_figures_are_valid_plotly(full):
    go = pytest.importorskip("plotly.graph_objects")
    go.layout.Template(TEMPLATE)  # raises on an unknown property
    for spec in island(build_html(full))["figures"]:
        go.Figure(data=spec["data"], layout=spec["layout"])  # raises ValueError on an invalid property


def test_heatmap_payload_has_both_metrics_per_model(full):
    hm = island(build_html(full))["heatmap"]
    assert [m["label"] for m in hm["models"]] == ["es", "grpo"]
    es = hm["models"][0]
    assert es["y"] == [0, 1, 2, 3] and es["x"][:2] == ["attn_q", "attn_k"] and "embed" not in es["x"]
    assert es["z"]["l2"] != es["z"]["rel_l2"]
    assert len(es["z"]["l2"]) == 4 and len(es["z"]["l2"][0]) == len(es["x"])
    html = build_html(full)
    assert 'id="heatmap-metric-rel_l2"' in html and 'id="heatmap-model"' in html


def test_minimal_analysis_only_diff(tmp_path):
    out = render_report(minimal_diff(), tmp_path / "r.html")
    html = out.read_text()
    assert figure_ids(html) == {"fig-distance", "fig-heatmap", "fig-groups"}
    assert 'id="heatmap-model"' not in html  # one model: no selector
    absent = html[html.index('id="sections-absent"'):]
    absent = absent[:absent.index("</div>")]
    for title, command in [("Pass@K evaluation", "--task T"), ("Sparsification", "--thresholds"),
                           ("Training reward", "run directories"), ("Population diversity", "--diversity"),
                           ("Forgetting", "--held-out")]:
        assert title in absent and command in absent
    assert "Weight deltas" not in absent
    assert "<td class=\"num\">n/a</td>" in html  # no sparsify: the summary says n/a
    assert 'id="sec-heldout"' not in html
    # a study's analysis: the hint names the study's own option
    study = render_report({**minimal_diff(), "study": {"claims": []}}, tmp_path / "s.html").read_text()
    absent = study[study.index('id="sections-absent"'):]
    absent = absent[:absent.index("</div>")]
    assert "deltalens study ... --held-out" in absent and "deltalens report ... --task T --held-out" not in absent


def test_envelope_only_renders_everything_absent(tmp_path):
    html = render_report({"schema_version": 1}, tmp_path / "r.html").read_text()
    assert figure_ids(html) == set()
    assert island(html)["figures"] == []
    assert html.count("<li><b>") >= 6


def test_layers_fall_back_to_tensors():
    d = {"tensors": [
        {"name": "a", "group": "attn_q", "layer": 0, "l2": 3.0, "base_l2": 10.0},
        {"name": "b", "group": "attn_q", "layer": 0, "l2": 4.0, "base_l2": 0.0},
        {"name": "c", "group": "norm", "layer": 1, "l2": 1.0, "base_l2": 2.0},
        {"name": "d", "group": "embed", "layer": None, "l2": 9.0, "base_l2": 9.0},
    ]}
    layers, groups, z = layer_grid(d)
    assert layers == [0, 1] and groups == ["attn_q", "norm"]
    assert z["l2"] == [[5.0, None], [None, 1.0]]
    assert z["rel_l2"] == [[0.5, None], [None, 0.5]]


# ------------------------------------------------------------------------------- sparsity @ 90% gain
def _sp(points, base=0.2, full=0.4):
    return {"base_pass_at_k": {"1": base}, "full_pass_at_k": {"1": full},
            "points": [{"sparsity": s, "pass_at_k": {"1": p}} for s, p in points]}


def test_sparsity_keeping_gain_interpolates():
    # gains: 0.5 -> 0.95, 0.7 -> 0.85: crosses 0.9 half way
    s, qual = sparsity_keeping_gain(_sp([(0.7, 0.37), (0.5, 0.39), (0.9, 0.25)]))
    assert qual == "≈" and s == pytest.approx(0.6)  # shown as "≈60%": not a tested point


def test_sparsity_keeping_gain_edge_cases():
    assert sparsity_keeping_gain(_sp([(0.5, 0.4), (0.9, 0.39)])) == (0.9, "≥")  # never drops below 90%
    assert sparsity_keeping_gain(_sp([(0.5, 0.2)], base=0.3, full=0.3)) == (None, "no gain")
    assert sparsity_keeping_gain({"points": []}) == (None, "no points")
    s, _ = sparsity_keeping_gain(_sp([(0.2, 0.21)]))  # drops at the first point: interpolate from sparsity 0
    assert s == pytest.approx(0.2 * 0.1 / 0.95)
    # without base/full Pass@1 the points' own gain_retained is used
    s, _ = sparsity_keeping_gain({"points": [{"sparsity": 0.4, "gain_retained": 1.0},
                                             {"sparsity": 0.8, "gain_retained": 0.8}]})
    assert s == pytest.approx(0.6)
    assert gain_curve({"points": [{"sparsity": None, "gain_retained": 1.0}]}) == ([], None)


# ---------------------------------------------------------------------------------------- safety
def evil(full: dict) -> dict:
    a = copy.deepcopy(full)
    a["models"][0]["label"] = EVIL_LABEL
    a["models"][0]["path"] = EVIL_PATH
    for section in ("diff", "evals", "sparsify", "training", "diversity", "held_out"):
        a[section][EVIL_LABEL] = a[section].pop("es")
    a["ratios"][0]["a"] = EVIL_LABEL
    a["evals"]["base"]["per_problem"][0]["prompt"] = EVIL_PROMPT
    a["evals"]["base"]["task"] = "</script><b>task</b>"
    a["diversity"][EVIL_LABEL]["per_prompt"][0]["prompt"] = EVIL_PROMPT
    a["diff"]["grpo"]["warnings"].append("<img src=x onerror=alert(4)>")
    a["held_out"]["base"]["<svg onload=alert(5)>"] = {"1": 0.5}
    return a


def test_user_strings_are_escaped(full):
    html = build_html(evil(full))
    for raw in (EVIL_LABEL, "alert(2)</script>", "<img src=x", "<svg onload", "<b>task</b>"):
        assert raw not in html, raw
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html  # shown as text in the tables
    assert "&quot;&gt;&lt;img src=x onerror=alert(3)&gt;" in html
    assert "&lt;/script&gt;&lt;script&gt;alert(2)&lt;/script&gt;" in html
    # exactly the page's own script elements close: no user string ends one early
    assert len(re.findall(r"</script", html, re.IGNORECASE)) == len(re.findall(r"<script", html, re.IGNORECASE)) == 4
    # the data island still parses and carries the label (plotly-escaped, so plotly shows it as text)
    data = island(html)
    assert data["heatmap"]["models"][0]["label"] == "&lt;script&gt;alert(1)&lt;/script&gt;"
    names = [t.get("name", "") for f in data["figures"] for t in f["data"]]
    assert not any("<script" in n for n in names)


def test_json_island_escapes_angle_brackets_and_nan(full):
    full["models"][1]["label"] = "a</b>&c"
    full["diff"]["a</b>&c"] = full["diff"].pop("grpo")
    full["diff"]["es"]["whole"]["max_abs"] = float("nan")
    full["diff"]["a</b>&c"]["whole"]["rel_l2"] = float("inf")
    html = build_html(full)
    text = re.search(r'id="deltalens-data">(.*?)</script>', html, re.DOTALL).group(1)
    assert "<" not in text and ">" not in text and "&" not in text
    assert "NaN" not in text and "Infinity" not in text
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


def test_page_is_self_contained(full):
    html = build_html(full)
    assert not re.search(r"<script[^>]*\ssrc\s*=", html, re.IGNORECASE)
    assert not re.search(r"<link\b", html, re.IGNORECASE)
    assert not re.search(r"<(img|iframe|embed|object|source|audio|video)\b", html, re.IGNORECASE)
    ours = strip_plotly(html)
    assert "http://" not in ours and "https://" not in ours and "@import" not in ours
    assert len(ours) < len(html) / 10  # the plotly.js block really was what we stripped
    assert "Plotly.newPlot" in ours


# --------------------------------------------------------------------------------- input checking
@pytest.mark.parametrize("analysis,needle", [
    ({"diff": {}}, "no schema_version"),
    ({"schema_version": 2}, "upgrade deltalens"),
    ({"schema_version": "1"}, "must be an integer"),
    ({"schema_version": True}, "must be an integer"),
    ({"schema_version": 0}, "unsupported"),
    ([1, 2], "JSON object"),
])
def test_bad_envelope_is_a_user_error(tmp_path, analysis, needle):
    out = tmp_path / "r.html"
    with pytest.raises(DeltalensError) as e:
        render_report(analysis, out)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert not out.exists()


def test_render_file_errors(tmp_path):
    with pytest.raises(DeltalensError, match="no such file"):
        render_file(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DeltalensError, match="not valid JSON"):
        render_file(bad)
    good = tmp_path / "a.json"
    good.write_text(json.dumps({"schema_version": 1}))
    with pytest.raises(DeltalensError, match="directory"):
        render_file(good, tmp_path)
    with pytest.raises(DeltalensError, match="overwrite"):
        render_file(good, good)


def test_malformed_sections_do_not_crash(tmp_path, full):
    full["diff"]["es"]["groups"] = "oops"
    full["diff"]["grpo"]["layers"] = [1, None, {"layer": "x"}]
    full["evals"]["es"]["curve"] = {"k": [1, None]}
    full["sparsify"]["es"]["points"] = [{"sparsity": "a"}, 3]
    full["training"]["es"]["rows"] = [{"iteration": 0}, "x"]
    full["held_out"]["es"] = 5
    full["ratios"] = [None, {"a": "es"}]
    html = render_report(full, tmp_path / "r.html").read_text()
    assert "fig-passk" in figure_ids(html)


# ------------------------------------------------------------------------------------------ output
def test_default_output_and_atomic_write(tmp_path, monkeypatch):
    src = tmp_path / "analysis.json"
    src.write_text(json.dumps(minimal_diff()))
    out = render_file(src)
    assert out == tmp_path / "analysis.html" and out.stat().st_size > 1_000_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["analysis.html", "analysis.json"]
    assert oct(out.stat().st_mode & 0o777) == oct(0o644)

    # a failure while replacing leaves the previous report intact and no temp file behind
    out.write_text("OLD")
    import deltalens.reports.render as render_mod

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(render_mod.os, "replace", boom)
    with pytest.raises(DeltalensError, match="No space left"):
        render_file(src, out)
    assert out.read_text() == "OLD"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["analysis.html", "analysis.json"]


def test_output_parent_is_created(tmp_path):
    out = render_report(minimal_diff(), tmp_path / "a" / "b" / "r.html")
    assert out.is_file()


def test_cli_render_command(tmp_path):
    typer = pytest.importorskip("typer")
    from deltalens.cli.report import render
    from typer.testing import CliRunner

    app = typer.Typer()
    app.command()(render)
    src = tmp_path / "analysis.json"
    src.write_text(json.dumps(minimal_diff()))
    result = CliRunner().invoke(app, [str(src)])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(tmp_path / "analysis.html")
    result = CliRunner().invoke(app, [str(src), "-o", str(tmp_path / "x.html")])
    assert result.exit_code == 0 and (tmp_path / "x.html").is_file()


def test_reports_never_import_torch(tmp_path):
    code = (
        "import sys\n"
        "import deltalens.reports as r\n"
        f"r.render_file({str(FIXTURE)!r}, {str(tmp_path / 'r.html')!r})\n"
        "bad = sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "r.html").is_file()


def test_the_js_figure_and_table_name_their_estimator(full):
    """One JS estimator, named wherever it is shown: the figure's axis and bars, the per-prompt table's
    header. A section that names its estimator shows js_mean; an older one without the field shows its
    posterior js_mi_mean when it has one, else its js_mean named as the direct estimator."""
    def shown(doc):
        data = island(build_html(doc))
        fig = next(f for f in data["figures"] if f["id"] == "fig-diversity")
        bars = next(t for t in fig["data"] if t.get("legendgroup") == "js" and t["type"] == "bar")
        return fig, bars, build_html(doc)

    fig, bars, html = shown(full)  # the fixture's sections predate the field and hold one estimate
    assert "direct estimator" in fig["layout"]["yaxis"]["title"]["text"] and bars["y"] == [0.012, 0.004]
    assert "es JS (direct estimator)</th>" in html

    new = copy.deepcopy(full)
    for sec in new["diversity"].values():
        sec.update(estimator="posterior", js_mean=sec["js_mean"] * 2, js_mi_mean=sec["js_mean"] * 2)
    fig, bars, html = shown(new)
    assert fig["layout"]["yaxis"]["title"]["text"] == "Jensen–Shannon divergence, posterior estimator (nats)"
    assert bars["name"] == "JS (posterior estimator), all samples" and bars["y"] == [0.024, 0.008]
    assert "(posterior estimator; ±1 Monte Carlo standard error" in html and "es JS (posterior estimator)</th>" in html

    old = copy.deepcopy(full)
    old["diversity"]["es"].update(js_mi_mean=0.02, js_mi_se=0.001)  # written before the field: direct in js_mean
    for p in old["diversity"]["es"]["per_prompt"]:
        p.update(js_mi=0.5, js_mi_se=0.01)
    fig, bars, html = shown(old)
    assert bars["y"] == [0.02, 0.004] and bars["customdata"] == ["posterior estimator", "direct estimator"]
    assert "es JS (posterior estimator)</th>" in html and "grpo JS (direct estimator)</th>" in html
    assert "0.5 ± 0.01" in html
