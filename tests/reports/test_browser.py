"""The rendered report in a real headless Chromium: figures draw, no console errors, toggles work, offline.

Needs Debian's chromium and the Python playwright package (its bundled driver; no `playwright install`):
    apt-get install -y chromium && pip install playwright
Run: pytest -m browser tests/test_report_browser.py   (DELTALENS_SCREENSHOT=path.png keeps the screenshot;
DELTALENS_CHROMIUM overrides /usr/bin/chromium). Skips with the reason when either is missing.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from pathlib import Path

import pytest
from deltalens.reports import render_report

pytestmark = pytest.mark.browser

FIXTURE = Path(__file__).parents[1] / "fixtures" / "analysis_full.json"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
EVIL_LABEL = "<script>alert(1)</script>"


def _chromium() -> str:
    path = os.environ.get("DELTALENS_CHROMIUM") or "/usr/bin/chromium"
    if not (Path(path).is_file() and os.access(path, os.X_OK)):
        found = shutil.which("chromium") or shutil.which("chromium-browser")
        if not found:
            pytest.skip(f"no chromium at {path} or on PATH (apt-get install -y chromium)")
        path = found
    return path


@pytest.fixture(scope="module")
def browser():
    executable = _chromium()
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed (pip install playwright)")
    with sync_api.sync_playwright() as p:
        try:
            b = p.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS, headless=True)
        except Exception as e:  # noqa: BLE001 - a broken browser install is a skip, not a failure
            pytest.skip(f"chromium at {executable} does not start under playwright: {str(e).splitlines()[0]}")
        yield b
        b.close()


class Page:
    """A report opened from disk with every non-file request blocked and recorded."""

    def __init__(self, browser, path: Path):
        self.console: list[str] = []
        self.dialogs: list[str] = []
        self.requests: list[str] = []
        self.page = browser.new_page(viewport={"width": 1280, "height": 900})
        self.page.on("console", lambda m: self.console.append(f"{m.type}: {m.text}") if m.type in
                     ("error", "warning") else None)
        self.page.on("pageerror", lambda e: self.console.append(f"pageerror: {e}"))

        def on_dialog(d):
            self.dialogs.append(d.message)
            d.dismiss()

        self.page.on("dialog", on_dialog)

        def route(r):
            if r.request.url.startswith("file://"):
                r.continue_()
            else:
                self.requests.append(r.request.url)
                r.abort()

        self.page.route("**/*", route)
        self.page.goto(path.as_uri())
        self.page.wait_for_function("document.body.hasAttribute('data-rendered')", timeout=60_000)

    def js(self, expr: str, arg=None):
        return self.page.evaluate(expr, arg)

    def figures(self) -> list[dict]:
        return self.js("""() => Array.from(document.querySelectorAll('div.fig')).map(el => {
            const svg = el.querySelector('.main-svg');
            const box = svg ? svg.getBoundingClientRect() : {width: 0, height: 0};
            return {id: el.id, container: !!el.querySelector('.plot-container'),
                    svgs: el.querySelectorAll('.main-svg').length, width: box.width, height: box.height,
                    traces: (el._fullData || []).length, drawn: el.querySelectorAll('.main-svg .trace path, .main-svg image').length,
                    error: !!el.querySelector('.fig-error')};
        })""")

    def close(self):
        self.page.close()


def _assert_all_figures_drawn(page: Page, expected: list[str]):
    figs = page.figures()
    assert [f["id"] for f in figs] == expected
    for f in figs:
        assert f["container"] and f["svgs"] >= 1, f
        assert f["width"] > 300 and f["height"] > 200, f
        assert f["traces"] > 0 and f["drawn"] > 0 and not f["error"], f
    assert sorted(page.js("window.deltalens.rendered")) == sorted(expected)
    assert page.js("window.deltalens.errors") == []


def test_full_report_in_chromium(browser, tmp_path):
    out = render_report(json.loads(FIXTURE.read_text()), tmp_path / "report.html")
    page = Page(browser, out)
    try:
        expected = ["fig-passk", "fig-distance", "fig-heatmap", "fig-groups", "fig-topk", "fig-sparsify",
                    "fig-training", "fig-diversity"]
        _assert_all_figures_drawn(page, expected)

        # heatmap toggle: absolute -> relative, then the model selector, then back to absolute
        hm = page.js("window.deltalens.payload.heatmap.models")
        z = "() => document.getElementById('fig-heatmap').data[0].z"
        title = "() => document.getElementById('fig-heatmap').data[0].colorbar.title.text"

        def shows(model: int, metric: str) -> str:
            return (f"JSON.stringify(({z})()) === "
                    f"JSON.stringify(window.deltalens.payload.heatmap.models[{model}].z.{metric})")

        assert page.js(z) == hm[0]["z"]["l2"]
        page.page.click("#heatmap-metric-rel_l2")
        page.page.wait_for_function(shows(0, "rel_l2"), timeout=10_000)
        assert page.js(z) == hm[0]["z"]["rel_l2"] != hm[0]["z"]["l2"]
        assert page.js(title) == "‖Δ‖/‖θ₀‖"
        assert page.js("document.getElementById('heatmap-metric-rel_l2').classList.contains('active')")
        assert page.js("document.querySelector('#fig-heatmap .cbtitle').textContent") == "‖Δ‖/‖θ₀‖"
        page.page.select_option("#heatmap-model", "1")
        page.page.wait_for_function(shows(1, "rel_l2"), timeout=10_000)
        assert page.js(z) == hm[1]["z"]["rel_l2"] != hm[0]["z"]["rel_l2"]
        page.page.click("#heatmap-metric-l2")
        page.page.wait_for_function(shows(1, "l2"), timeout=10_000)
        assert page.js(title) == "‖Δ‖₂"
        assert not page.js("document.getElementById('heatmap-metric-rel_l2').classList.contains('active')")

        # collapsed tables open and hold escaped, readable text
        page.page.click("details.more >> text=Per-problem results")
        assert page.page.is_visible("table.perproblem")

        assert page.console == [], page.console
        assert page.requests == [], page.requests
        assert page.dialogs == []

        shot = Path(os.environ.get("DELTALENS_SCREENSHOT") or tmp_path / "report.png")
        shot.parent.mkdir(parents=True, exist_ok=True)
        page.page.click("#heatmap-metric-rel_l2")  # show the relative view in the screenshot
        page.page.select_option("#heatmap-model", "0")
        page.page.click("details.more >> text=Per-problem results")  # close it again
        page.page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 50_000
    finally:
        page.close()


def test_hostile_labels_stay_text(browser, tmp_path):
    a = json.loads(FIXTURE.read_text())
    a = copy.deepcopy(a)
    a["models"][0]["label"] = EVIL_LABEL
    for section in ("diff", "evals", "sparsify", "training", "diversity", "held_out"):
        a[section][EVIL_LABEL] = a[section].pop("es")
    a["ratios"][0]["a"] = EVIL_LABEL
    a["evals"]["base"]["per_problem"][0]["prompt"] = "</script><script>alert(2)</script>"
    a["models"][1]["label"] = "<b onmouseover=alert(3)>bold</b>"
    for section in ("diff", "evals", "sparsify", "training", "diversity", "held_out"):
        a[section]["<b onmouseover=alert(3)>bold</b>"] = a[section].pop("grpo")
    out = render_report(a, tmp_path / "evil.html")
    page = Page(browser, out)
    try:
        _assert_all_figures_drawn(page, ["fig-passk", "fig-distance", "fig-heatmap", "fig-groups", "fig-topk",
                                         "fig-sparsify", "fig-training", "fig-diversity"])
        assert page.dialogs == [] and page.console == [] and page.requests == []
        assert page.js("document.querySelectorAll('script').length") == 4
        assert page.js("document.querySelectorAll('b[onmouseover]').length") == 0
        first_row = page.js("document.querySelector('table.summary tbody tr:nth-child(2) th').textContent")
        assert EVIL_LABEL in first_row
        # plotly draws the label literally too (legend of the group bars)
        legend = page.js("Array.from(document.querySelectorAll('#fig-groups .legendtext')).map(e => e.textContent)")
        assert EVIL_LABEL in legend and "<b onmouseover=alert(3)>bold</b>" in legend
    finally:
        page.close()


def _minimal_diff() -> dict:
    def m(l2, base):
        return {"n": 100, "l2": l2, "base_l2": base, "rel_l2": l2 / base}
    layers = [{"layer": i, "group": g, **m(0.1 * (i + 1) * (j + 1), 2.0 + 3 * j)}
              for i in range(3) for j, g in enumerate(["attn_q", "mlp_up"])]
    return {"schema_version": 1, "base": {"label": "base", "path": "tiny"},
            "models": [{"label": "ft", "path": "ckpt/ft", "kind": "checkpoint", "method": None}],
            "diff": {"ft": {"whole": m(0.6, 9.0), "groups": {"attn_q": m(0.2, 3.0), "mlp_up": m(0.5, 4.0)},
                            "layers": layers}}}


def test_minimal_report_in_chromium(browser, tmp_path):
    out = render_report(_minimal_diff(), tmp_path / "min.html")
    page = Page(browser, out)
    try:
        _assert_all_figures_drawn(page, ["fig-distance", "fig-heatmap", "fig-groups"])
        assert page.console == [] and page.requests == []
        # the toggle works without a model selector too
        before = page.js("document.getElementById('fig-heatmap').data[0].z")
        page.page.click("#heatmap-metric-rel_l2")
        page.page.wait_for_function("JSON.stringify(document.getElementById('fig-heatmap').data[0].z) === "
                                    "JSON.stringify(window.deltalens.payload.heatmap.models[0].z.rel_l2)",
                                    timeout=10_000)
        assert page.js("document.getElementById('fig-heatmap').data[0].z") != before
    finally:
        page.close()


STUDY = Path(__file__).parents[1] / "fixtures" / "analysis_study.json"
_BOXES = """(id) => {
    const el = document.getElementById(id);
    const box = e => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
    const legend = el.querySelector('.legend .bg');
    const sb = el.querySelector('.legend .scrollbar');
    return {legend: legend ? box(legend) : null,
            scroll: sb ? sb.getBoundingClientRect().height : 0,
            svg: box(el.querySelector('.main-svg')),
            annotations: Array.from(el.querySelectorAll('.infolayer .annotation')).map(box),
            plots: Array.from(el.querySelectorAll('.draglayer .nsewdrag')).map(box),
            xtitle: (el.querySelector('.g-xtitle') || {}).textContent || ''};
}"""


def _overlap(a, b) -> bool:
    return a[0] < b[2] - 1 and b[0] < a[2] - 1 and a[1] < b[3] - 1 and b[1] < a[3] - 1


def test_study_report_in_chromium(browser, tmp_path):
    """The SmolLM2 study (9 runs): no legend or annotation box overlaps a plot, an annotation or another box,
    no legend scrolls, one colour per method, the training figure on the compute axis, a small file."""
    analysis = json.loads(STUDY.read_text())
    out = render_report(analysis, tmp_path / "study.html")
    assert out.stat().st_size < 2_500_000  # the full plotly.js alone is 4.8 MB
    page = Page(browser, out)
    try:
        expected = ["fig-passk", "fig-distance", "fig-heatmap", "fig-groups", "fig-topk", "fig-sparsify",
                    "fig-training", "fig-diversity"]
        _assert_all_figures_drawn(page, expected)
        assert page.console == [] and page.requests == [] and page.dialogs == []
        for fig in expected:
            b = page.js(_BOXES, fig)
            boxes = ([b["legend"]] if b["legend"] else []) + b["annotations"]
            for i, x in enumerate(boxes):
                for y in boxes[i + 1:]:
                    assert not _overlap(x, y), (fig, x, y)
                for p in b["plots"]:  # no box over a plot area (the old 36-ratio box covered a bar)
                    assert not _overlap(x, p), (fig, "a box over a plot", x, p)
            assert b["scroll"] == 0, (fig, "the legend scrolls")
            if b["legend"]:
                assert b["legend"][3] <= b["svg"][3] + 1, (fig, "the legend runs out of the figure")
        # Pass@K: 4 lines drawn (base + a mean per method), the 9 seeds as legend entries only
        visible = page.js("""() => document.getElementById('fig-passk')._fullData
            .filter(t => t.visible === true && t.showlegend).map(t => t.name)""")
        assert visible == ["base", "es (mean of 3 seeds)", "grpo (mean of 3 seeds)", "es-grpo (mean of 3 seeds)"]
        # one colour per method: the legend's line colours of a method's mean and of its seeds share a hue
        legend = page.js("""() => Array.from(document.querySelectorAll('#fig-passk .legend .traces')).map(t => [
            t.querySelector('.legendtext').textContent,
            (t.querySelector('.legendlines path') || {style: {}}).style.stroke])""")
        colors = dict(legend)
        means = {m: colors[f"{m} (mean of 3 seeds)"] for m in ("es", "grpo", "es-grpo")}
        assert len(set(means.values())) == 3
        assert len({colors[f"{m}-s{s}"] for m in means for s in range(3)}) == 9

        def rgb(c):
            return [int(v) for v in re.findall(r"\d+", c)[:3]]
        for m, c in means.items():
            top = max(range(3), key=lambda i: rgb(c)[i])
            assert all(max(range(3), key=lambda i: rgb(colors[f"{m}-s{s}"])[i]) == top for s in range(3)), m
        # clicking a seed's legend entry draws it
        page.page.click("#fig-passk .legend .traces:has-text('es-s1') .legendtoggle", force=True)
        page.page.wait_for_function("""() => document.getElementById('fig-passk')._fullData
            .some(t => t.name === 'es-s1' && t.visible === true)""", timeout=10_000)
        # training: the compute axis
        assert page.js(_BOXES, "fig-training")["xtitle"] == "compute units"
        assert page.page.is_visible("#ratio-table") and page.page.is_visible("#sec-completions")
        shot = os.environ.get("DELTALENS_STUDY_SCREENSHOT")
        if shot:
            page.page.screenshot(path=shot, full_page=True)
    finally:
        page.close()
