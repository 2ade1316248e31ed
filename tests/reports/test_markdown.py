"""`reports.markdown.study_markdown`: the study's tables as Markdown, from a constructed study section."""

from __future__ import annotations

from deltalens.reports.markdown import study_markdown

STUDY = {
    "config": {"model": "tiny", "task": "arith", "methods": ["es", "grpo"], "seeds": [0, 1], "budget": 10240,
               "preset": "tiny", "limit": None, "samples": 32, "temperature": 0.6, "base_seeds": 3,
               "resamples": 2000},
    "rule": "reproduced = the 95% interval excludes the null in the paper's direction",
    "effects": {
        "es:pass@1": {"estimate": 0.0125, "method": 0.2875, "base": 0.275, "ci": [-0.01, 0.035]},
        "es:pass@16": {"estimate": -0.02, "method": 0.77, "base": 0.79, "ci": [-0.05, 0.01]},
        "grpo:pass@1": {"estimate": 0.1, "method": 0.375, "base": 0.275, "ci": [0.08, 0.12]},
        "grpo:pass@16": {"estimate": 0.03, "method": 0.82, "base": 0.79, "ci": [None, None]},
        "es:maj@16": {"estimate": 0.0, "method": 0.4, "base": 0.4, "ci": [-0.02, 0.02]},
        "grpo:maj@16": {"estimate": 0.1, "method": 0.5, "base": 0.4, "ci": [0.05, 0.15]},
    },
    "claims": [{"id": 1, "title": "GRPO raises Pass@1 | lowers Pass@16", "verdict": "mixed", "checks": [
        {"check": "grpo vs base, Pass@1", "estimate": 0.1, "ci_low": 0.08, "ci_high": 0.12, "direction": "+",
         "null": 0.0, "verdict": "reproduced", "per_seed": [0.09, 0.11]},
        {"check": "grpo vs base, Pass@16", "estimate": 0.03, "ci_low": None, "ci_high": None, "direction": "-",
         "null": 0.0, "verdict": "unclear", "per_seed": [0.03]}]}],
    "runs": [{"label": "es-s0"}, {"label": "es-s1"}, {"label": "grpo-s0"}, {"label": "grpo-s1"}],
    "seconds": 12.5,
}


def test_study_markdown_known_table():
    md = study_markdown({"study": STUDY}).splitlines()
    assert md[0].startswith("Study of `tiny` on `arith`: methods es, grpo; training seeds 0, 1; budget 1.02e+04")
    assert "4 runs; test problems: the whole test split, 32 samples at T = 0.6" in md[0]
    i = md.index("| model | Pass@1 | Pass@16 | Maj@16 |")  # Pass@K before Maj@K, K ascending
    assert md[i + 2] == "| base | 0.275 | 0.79 | 0.4 |"
    assert md[i + 3] == "| es | 0.287 (+0.0125 [-0.01, 0.035]) | 0.77 (-0.02 [-0.05, 0.01]) | 0.4 (+0 [-0.02, 0.02]) |"
    assert md[i + 4].startswith("| grpo | 0.375 (+0.1 [0.08, 0.12]) | 0.82 (+0.03 undefined) |")
    assert "| **1** | **GRPO raises Pass@1 \\| lowers Pass@16** |  |  |  |  | **mixed** |" in md  # pipes escaped
    # each training seed's value beside the interval; one value (one seed) shows nothing extra
    assert "|  | grpo vs base, Pass@1 | 0.1 | 0.09, 0.11 | [0.08, 0.12] | + vs 0 | reproduced |" in md
    assert "|  | grpo vs base, Pass@16 | 0.03 |  | undefined | - vs 0 | unclear |" in md
    assert any(x.startswith("Verdict rule: reproduced = ") for x in md)
    assert any(x.startswith("Per seed: the check's value for each training seed") for x in md)  # says what it holds


def test_study_markdown_without_effects():
    md = study_markdown({"study": {"claims": []}})
    assert "Pass@K and Maj@K" not in md and md.endswith("|---|---|---|---|---|---|---|\n")


def test_problems_lost_share_row_states_es_own_count():
    # the share row carries ES's own count per run (`lost_es`); the table states it beside the check's name
    share = {"check": "problems lost, grpo minus es (share of the 164 the base solves)", "estimate": 0.07,
             "ci_low": -0.05, "ci_high": 0.19, "direction": "+", "null": 0.0, "verdict": "unclear",
             "per_seed": [0.05, 0.13, 0.03], "lost_es": [3, 0, 1]}
    one = dict(share, lost_es=[1], per_seed=[0.05])
    for row, text in ((share, "; es lost 3, 0, 1 problems (per run) |"), (one, "; es lost 1 problem (per run) |")):
        study = {"claims": [{"id": 1, "title": "t", "verdict": "unclear", "checks": [row]}]}
        assert any(line.startswith("|  | problems lost, grpo minus es (share of the 164 the base solves)" + text)
                   for line in study_markdown({"study": study}).splitlines())
