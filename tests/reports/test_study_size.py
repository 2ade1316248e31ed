"""The report at study size (issue #30): a mean per method with seeds on demand, intervals on Pass@K, the
training curves on the compute axis, a hue per method and a shade per seed, distance ratios per method pair,
sample completions, and plotly's partial bundle.

tests/fixtures/analysis_study.json is the SmolLM2 study (9 runs: es, grpo, es-grpo x seeds 0-2) rebuilt from the
report committed before this change (docs/smollm2-study-report.html: its figure data and tables, with the
training rows' compute units recomputed from the study's configs as `training_section` now records them);
prompts are cut to their last question, layers to 0-3, and the first 5 problems of base, es-s0, grpo-s0 and
es-grpo-s0 carry two synthetic completions (one hostile) so that the completions section has input.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
from deltalens.reports import build_html
from deltalens.reports.common import Context
from deltalens.reports.figures import fig_distance, fig_passk, fig_training
from deltalens.reports.metrics import pass_at_k, passk_interval, ratio_rows
from deltalens.reports.render import PLOTLY_BUNDLE_VERSION, _template

from deltalens.analysis.report import training_section

FIXTURES = Path(__file__).parents[1] / "fixtures"


@pytest.fixture(scope="module")
def study() -> dict:
    return json.loads((FIXTURES / "analysis_study.json").read_text())


@pytest.fixture(scope="module")
def study_html(study) -> str:
    return build_html(study)


def test_one_hue_per_method_and_a_shade_per_seed(study):
    ctx = Context(study)
    assert list(ctx.methods) == ["es", "grpo", "es-grpo"]
    assert len(set(ctx.method_colors.values())) == 3
    shades = [ctx.color(f"{m}-s{s}") for m in ctx.methods for s in range(3)]
    assert len(set(shades)) == 9
    assert ctx.color("es-s0") != ctx.color("es-grpo-s2")  # the two blues of the old report

    def hue(c):
        r, g, b = (int(c[i:i + 2], 16) for i in (1, 3, 5))
        return max(("r", r), ("g", g), ("b", b), key=lambda t: t[1])[0]
    assert {hue(ctx.color(f"es-s{s}")) for s in range(3)} == {"b"}
    assert {hue(ctx.color(f"grpo-s{s}")) for s in range(3)} == {"r"}


def test_passk_one_line_per_method_seeds_hidden(study):
    fig = fig_passk(Context(study))
    shown = [t for t in fig.data if t.get("visible", True) is True and t.get("showlegend", True)]
    assert [t["name"] for t in shown] == ["base", "es (mean of 3 seeds)", "grpo (mean of 3 seeds)",
                                          "es-grpo (mean of 3 seeds)"]
    hidden = [t for t in fig.data if t.get("visible") == "legendonly"]
    assert {t["name"] for t in hidden if t.get("showlegend", True)} == {f"{m}-s{s}" for m in ("es", "grpo", "es-grpo")
                                                                        for s in range(3)}
    es = next(t for t in shown if t["name"].startswith("es (mean"))
    seeds = [study["evals"][f"es-s{s}"]["curve"]["pass"] for s in range(3)]
    assert es["y"][0] == pytest.approx(sum(v[0] for v in seeds) / 3)
    # a band (min-max over seeds) and error bars (95% over problems) at the requested K
    band = [t for t in fig.data if t.get("fill") == "tonexty" and t["legendgroup"] == "m:es"]
    assert band and band[0]["y"][0] == pytest.approx(min(v[0] for v in seeds))
    bars = next(t for t in fig.data if "error_y" in t and t["legendgroup"] == "m:es")
    assert bars["x"] == [1, 16, 32] and all(v > 0 for v in bars["error_y"]["array"])
    assert len([t for t in fig.data if t.get("showlegend", True) and t.get("visible", True) is True]) == 4


def test_pass_at_k_and_its_interval():
    assert pass_at_k(32, 0, 1) == 0 and pass_at_k(32, 32, 16) == 1 and pass_at_k(4, 2, 1) == pytest.approx(0.5)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    ev = {"per_problem": [{"correct": c, "n": 4} for c in (0, 4, 2, 2)]}
    lo, hi = passk_interval([ev], [1])
    sd = (sum((v - 0.5) ** 2 for v in (0, 1, 0.5, 0.5)) / 3) ** 0.5
    assert lo[0] == pytest.approx(max(0, 0.5 - 1.959964 * sd / 2)) and hi[0] == pytest.approx(0.5 + 1.959964 * sd / 2)
    assert passk_interval([ev, {"per_problem": []}], [1]) is None


def test_distance_has_no_ratio_box_and_a_table_per_method_pair(study, study_html):
    fig = fig_distance(Context(study))
    assert not fig.layout.get("annotations")
    rows = {(r["a"], r["b"]): r for r in ratio_rows(Context(study))}
    assert set(rows) == {("es", "grpo"), ("es", "es-grpo"), ("es-grpo", "grpo")}
    es_grpo = rows[("es", "grpo")]
    rel = {lab: study["diff"][lab]["whole"]["rel_l2"] for lab in study["diff"]}
    matched = sum(rel[f"es-s{s}"] / rel[f"grpo-s{s}"] for s in range(3)) / 3
    assert es_grpo["pairs"] == 9 and es_grpo["matched"] == pytest.approx(matched)
    assert es_grpo["min"] <= es_grpo["mean"] <= es_grpo["max"]
    table = study_html[study_html.index('id="ratio-table"'):]
    table = table[:table.index("</table>")]
    assert table.count("<tr>") == 4 and f"{es_grpo['mean']:.3g}×" in table


def test_summary_has_method_means_and_no_ratio_lists(study, study_html):
    summary = study_html[study_html.index('id="sec-summary"'):study_html.index('id="sec-claims"')]
    assert "× grpo" not in summary and "× es" not in summary
    assert summary.count('class="method-mean"') == 3
    # the base row is the mean over the study's 3 sampling seeds (as in the verdicts), not seed 0's 59.1%
    base = summary[summary.index("mean of 3 sampling seeds"):]
    assert "58.9%" in base[:400] and "59.1%" not in base[:400]
    assert "+12.9 pp" in summary  # es Pass@1: 0.566 - 0.437, as docs/smollm2-study-verdicts.md


def test_training_on_the_compute_axis(study):
    fig = fig_training(Context(study))
    assert fig.layout["xaxis"]["title"]["text"] == "compute units"
    means = [t for t in fig.data if t["name"].endswith("(mean of 3 seeds)") and "fill" not in t]
    assert {t["name"] for t in means} == {"es (mean of 3 seeds)", "grpo (mean of 3 seeds)", "es-grpo (mean of 3 seeds)"}
    es = next(t for t in means if t["name"].startswith("es ("))
    grpo = next(t for t in means if t["name"].startswith("grpo"))
    assert es["x"][-1] == grpo["x"][-1] == study["study"]["config"]["budget"]  # both end at the budget
    assert len(grpo["x"]) == 2 * len(es["x"])  # 40 GRPO steps vs 20 ES iterations in the same compute


def test_training_small_multiples_and_old_analyses(study):
    a = copy.deepcopy(study)
    for lab, t in a["training"].items():
        for r in t["rows"]:
            if not lab.startswith("es-s"):
                r.update(kl=0.01 * r["iteration"], entropy=0.5, grad_norm=1.0)
            if r["iteration"] % 10 == 0:
                r["eval_pass1"] = 0.5
    fig = fig_training(Context(a))
    titles = [an["text"] for an in fig.layout["annotations"]]
    assert titles == ["<b>training reward</b>", "<b>validation Pass@1</b>", "<b>KL to the reference</b>",
                      "<b>token entropy</b>", "<b>gradient norm</b>"]
    assert {t["yaxis"] for t in fig.data} == {"y", "y2", "y3", "y4", "y5"}
    # an analysis without units (written before them) keeps the per-iteration figure
    for t in a["training"].values():
        t["x"] = "iteration"
        for r in t["rows"]:
            r.pop("units")
    old = fig_training(Context(a))
    assert old.title == "Training reward" and "units" not in json.dumps(old.layout)


def test_training_section_records_units_and_validation(tmp_path):
    run = tmp_path / "es"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"method": "es", "prompts_per_iteration": 4, "population": 8}))
    rows = [{"iteration": 0, "eval": {"pass_at_1": 0.25}},
            {"iteration": 1, "reward_mean": 0.3, "reward_min": 0.1, "reward_max": 0.5, "rewards": [0.1] * 8},
            {"iteration": 2, "reward_mean": 0.4, "eval": {"pass_at_1": 0.5}}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sec = training_section("es", run)
    assert sec["x"] == "units" and [r["units"] for r in sec["rows"]] == [0, 64, 128]
    assert [r.get("eval_pass1") for r in sec["rows"]] == [0.25, None, 0.5] and "rewards" not in sec["rows"][1]
    grpo = tmp_path / "grpo"
    (grpo / "checkpoints").mkdir(parents=True)
    (grpo / "config.json").write_text(json.dumps({"method": "grpo"}))
    (grpo / "metrics.jsonl").write_text(json.dumps({"iteration": 1, "units": 64, "reward_mean": 0.2, "kl": 0.1,
                                                    "entropy": 0.3, "grad_norm": 2.0, "loss": 1.0}) + "\n")
    row = training_section("grpo", grpo)["rows"][0]
    assert row == {"iteration": 1, "units": 64, "reward_mean": 0.2, "kl": 0.1, "entropy": 0.3, "grad_norm": 2.0}


def test_sample_completions_escaped(study, study_html):
    sec = study_html[study_html.index('id="sec-completions"'):]
    sec = sec[:sec.index("</section>")]
    assert "<script>alert(1)" not in sec and "&lt;script&gt;alert(1)&lt;/script&gt;" in sec
    assert sec.count('class="comp-problem"') == 4 and sec.count("✓</span>") == 16 and sec.count("✗</span>") == 16
    assert "es-s0 (es)" in sec and "grpo-s0 (grpo)" in sec
    a = copy.deepcopy(study)
    for ev in a["evals"].values():
        for r in ev["per_problem"]:
            r.pop("completions", None)
    assert 'id="no-completions"' in build_html(a)


def test_partial_plotly_bundle(study, study_html):
    plotly = pytest.importorskip("plotly.offline")
    full = plotly.get_plotlyjs()
    version = re.search(r"plotly\.js v(\d+\.\d+\.\d+)", full[:300]).group(1)
    bundle = _template("plotly-cartesian.min.js")
    assert re.search(r"plotly\.js \(cartesian - minified\) v(\d+\.\d+\.\d+)", bundle[:300]).group(1) \
        == version == PLOTLY_BUNDLE_VERSION
    assert bundle[:200] in study_html and full[:200] not in study_html
    assert len(study_html.encode()) < 2_500_000 < len(full.encode())
    # a trace type outside the bundle: the full plotly.js, said on the page
    from deltalens.reports import render as render_mod
    orig = render_mod.BUILDERS
    try:
        def fig_pie(ctx):
            f = fig_distance(ctx)
            f.id, f.data = "fig-pie", [{"type": "sankey"}]
            return f
        render_mod.BUILDERS = [*orig, ("diff", fig_pie)]
        page = render_mod.build_html(study)
    finally:
        render_mod.BUILDERS = orig
    assert full[:200] in page and "sankey are not in plotly.js" in page
