"""`deltalens study scale`: claim 6 across model sizes from constructed studies' analysis.json: the N needed
and its interval per model, the verdict by the rule, refusals in one line, the table in 80 columns."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

from cli import common
from cli.study import show_scale, study_scale
from deltalens.errors import DeltalensError
from deltalens.study.scale import config_parameters, n_needed, scale_analysis
from deltalens.tiny import MODEL_DIR


def _check(n, share, lo, hi, holm=True):
    c = {"check": f"es N={n}: share of the reference ES run's Pass@1 gain", "population": n, "estimate": share,
         "ci_low": lo, "ci_high": hi, "direction": "+", "verdict": "unclear"}
    if holm:  # the Holm-level interval is what the rule reads: make the unadjusted one narrower, to tell them apart
        c.update(ci_low_holm=lo, ci_high_holm=hi, ci_low=None if lo is None else lo + 0.01,
                 ci_high=None if hi is None else hi - 0.01)
    return c


def _study(root: Path, name: str, params, sizes, reference=32, *, diff=True, base="m", claim6=True,
           alpha=None) -> Path:
    """A study directory with an analysis.json: claim 6's checks `sizes` [(N, share, lo, hi)]."""
    d = root / name
    d.mkdir(parents=True)
    checks = [_check(*s) for s in sizes]
    doc = {"schema_version": 1, "base": {"label": "base", "path": base},
           "study": {"config": {"model": f"model-{name}", "task": "arith",
                                **({"population_alpha": alpha} if alpha else {})}, "rule": "r",
                     "claims": [{"id": 1, "title": "one", "verdict": "unclear", "checks": []},
                                *([{"id": 6, "title": "six", "verdict": "unclear", "checks": checks}] if claim6 else [])],
                     "runs": [{"label": "es-s0", "group": "es", "method": "es", "seed": 0, "dir": "runs/es-s0"}],
                     "flops": {"runs": {"es-s0": {"method": "es", "population": reference}}}}}
    if diff:
        doc["diff"] = {"es-s0": {"n_params": float(params)}}
    (d / "analysis.json").write_text(json.dumps(doc))
    return d


SHRINKS = {  # small model: N = 16 needed, surely more than 8; large: N = 4 surely enough
    "small": (1e6, [(4, 0.2, 0.0, 0.4), (8, 0.6, 0.4, 0.8), (16, 0.95, 0.91, 1.0)]),
    "mid": (1e7, [(4, 0.5, 0.3, 0.7), (8, 0.92, 0.85, 0.99), (16, 0.97, 0.93, 1.01)]),
    "large": (1e8, [(4, 0.96, 0.92, 1.0), (8, 1.0, 0.95, 1.05), (16, 0.99, 0.95, 1.03)]),
}


def _studies(tmp_path, spec, **kw):
    return [_study(tmp_path, name, p, sizes, **kw) for name, (p, sizes) in spec.items()]


def test_n_needed_and_its_interval_known_answers():
    sizes = [{"population": n, "share": s, "ci": [lo, hi]} for n, s, lo, hi in SHRINKS["mid"][1]]
    # F = 0.9: 8 is the first share >= 0.9; 8 the first whose interval reaches 0.9; 16 the first surely above
    no = {"at_most": False, "low_censored": False}
    assert n_needed(sizes, 32, 0.9) == {"n_needed": 8, "n_low": 8, "n_high": 16, "share": 0.92, "ci": [0.85, 0.99],
                                        **no}
    # the smallest N run (4) reaches 0.5: a smaller, untested N might too, so both read "at most 4"
    assert n_needed(sizes, 32, 0.5) == {"n_needed": 4, "n_low": 4, "n_high": 8, "share": 0.5, "ci": [0.3, 0.7],
                                        "at_most": True, "low_censored": True}
    # nothing reaches 0.99 below the reference: the reference (share 1 by definition); 8's interval reaches it
    assert n_needed(sizes, 32, 0.99) == {"n_needed": 32, "n_low": 8, "n_high": 32, "share": 1.0, "ci": [1.0, 1.0],
                                         **no}
    # an undefined interval (the gain not significantly above 0) may reach F and never surely does
    vague = [{"population": 4, "share": 0.95, "ci": [None, None]}]
    assert n_needed(vague, 32, 0.9) == {"n_needed": 4, "n_low": 4, "n_high": 32, "share": 0.95, "ci": [None, None],
                                        "at_most": True, "low_censored": True}
    # the reference gained nothing: no share defined, no N needed
    assert n_needed([{"population": 4, "share": None, "ci": [None, None]}], 32, 0.9)["n_needed"] is None


def test_the_verdict_follows_the_rule(tmp_path):
    res = scale_analysis(_studies(tmp_path / "a", SHRINKS))
    assert [m["n_needed"] for m in res["models"]] == [16, 8, 4] and res["verdict"] == "reproduced"
    small, large = res["models"][0], res["models"][-1]
    assert (small["n_low"], small["n_high"], large["n_low"], large["n_high"]) == (16, 16, 4, 4)
    assert small["interval"] == "holm" and small["params_from"] == "analysis.json (diff n_params)"
    assert small["reference_population"] == 32 and small["reference_from"] == "analysis.json (study.flops)"
    # the same studies with the sizes swapped: the N needed grows with scale
    grows = {"small": (1e8, SHRINKS["small"][1]), "mid": SHRINKS["mid"], "large": (1e6, SHRINKS["large"][1])}
    res = scale_analysis(_studies(tmp_path / "b", grows))
    assert [m["n_needed"] for m in res["models"]] == [4, 8, 16] and res["verdict"] == "contradicted"
    # the largest model's interval overlaps the smallest's: unclear, though the estimates fall
    vague = {**SHRINKS, "large": (1e8, [(4, 0.5, 0.2, 0.8), (8, 0.95, 0.8, 1.1), (16, 0.99, 0.95, 1.03)])}
    res = scale_analysis(_studies(tmp_path / "c", vague))
    assert [m["n_needed"] for m in res["models"]] == [16, 8, 8] and res["verdict"] == "unclear"
    assert "does not surely change" in res["reason"]
    # the smallest model's interval starts at the smallest N it ran (censored: a smaller N might reach F), so the
    # largest model's cannot lie surely below it, though every number says so
    censored = {**SHRINKS, "small": (1e6, [(8, 0.5, 0.3, 0.95), (16, 0.95, 0.92, 1.0)])}
    res = scale_analysis(_studies(tmp_path / "e", censored))
    small = res["models"][0]
    assert (small["n_low"], small["low_censored"], res["models"][-1]["n_high"]) == (8, True, 4)
    assert res["verdict"] == "unclear"
    # --fraction changes what "reaches" means: at 0.5 the small model needs 8, the others 4
    res = scale_analysis(_studies(tmp_path / "d", SHRINKS), fraction=0.5)
    assert [m["n_needed"] for m in res["models"]] == [8, 4, 4] and res["fraction"] == 0.5


def test_a_verdict_needs_three_sizes_and_one_reference(tmp_path):
    two = {k: SHRINKS[k] for k in ("small", "large")}
    res = scale_analysis(_studies(tmp_path / "a", two))
    assert (res["verdict"], res["reason"]) == ("unclear", "needs 3 model sizes (got 2)")
    buf = io.StringIO()
    show_scale(res, console=Console(file=buf, width=200))
    assert "the N needed shrinks with model scale: unclear: needs 3 model sizes (got 2)" in buf.getvalue()
    dirs = _studies(tmp_path / "b", {k: SHRINKS[k] for k in ("small", "mid")})
    dirs.append(_study(tmp_path / "b", "large", *SHRINKS["large"], reference=16))
    res = scale_analysis(dirs)
    assert res["verdict"] == "unclear" and "reference ES populations differ (16, 32)" in res["reason"]


def test_studies_under_different_alpha_rules_are_not_compared(tmp_path):
    # a study written before --population-alpha existed reads as fixed: three of them still give the verdict
    assert scale_analysis(_studies(tmp_path / "a", SHRINKS))["models"][0]["population_alpha"] == "fixed"
    res = scale_analysis(_studies(tmp_path / "b", SHRINKS, alpha="scaled"))
    assert res["verdict"] == "reproduced" and {m["population_alpha"] for m in res["models"]} == {"scaled"}
    dirs = _studies(tmp_path / "c", {k: SHRINKS[k] for k in ("small", "mid")})
    dirs.append(_study(tmp_path / "c", "large", *SHRINKS["large"], alpha="scaled"))
    res = scale_analysis(dirs)
    assert res["verdict"] == "unclear" and "different --population-alpha rules (fixed, scaled)" in res["reason"]


def test_parameter_count_from_the_base_config_when_not_recorded(tmp_path):
    d = _study(tmp_path, "tiny", 0, SHRINKS["small"][1], diff=False, base=str(MODEL_DIR))
    res = scale_analysis([d, *_studies(tmp_path, {k: SHRINKS[k] for k in ("mid", "large")})])
    tiny = next(m for m in res["models"] if m["study"] == str(d))
    assert tiny["params"] == 763_776 and tiny["params_from"] == "the base model's config.json"  # 0.76M
    # Qwen2.5-0.5B's layout: 494M with tied embeddings, 630M with its lm_head untied (docs/models.md)
    qwen = {"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24, "vocab_size": 151936,
            "intermediate_size": 4864, "num_attention_heads": 14, "num_key_value_heads": 2, "tie_word_embeddings": True}
    assert config_parameters(qwen) == 494_032_768
    assert config_parameters({**qwen, "tie_word_embeddings": False}) == 630_167_424
    with pytest.raises(DeltalensError, match="model_type 'gemma3'"):
        config_parameters({**qwen, "model_type": "gemma3"})
    gguf = _study(tmp_path, "gguf", 0, SHRINKS["small"][1], diff=False, base="no-such-model")
    with pytest.raises(DeltalensError, match="no parameter count"):
        scale_analysis([gguf])


def _cli(args):
    app = typer.Typer(add_completion=False)
    app.command("scale")(common.guard(study_scale))
    app.command("other")(lambda: None)  # two commands: `scale` is a subcommand, as under `deltalens study`
    return CliRunner().invoke(app, ["scale", *map(str, args)])


def test_cli_table_fits_80_columns_and_writes_json(tmp_path):
    dirs = _studies(tmp_path, SHRINKS)
    out = tmp_path / "scale.json"
    r = _cli([*dirs, "--json", out])
    assert r.exit_code == 0, r.output
    assert "the N needed shrinks with model scale: reproduced" in r.output
    saved = json.loads(out.read_text())
    assert saved["verdict"] == "reproduced" and [m["n_needed"] for m in saved["models"]] == [16, 8, 4]
    buf = io.StringIO()
    show_scale(saved, console=Console(file=buf, width=80))
    lines = buf.getvalue().splitlines()
    assert max(len(x) for x in lines) <= 80
    row = next(x for x in lines if " 1M " in x)  # the small model's row: 1e6 parameters, reference N = 32
    assert "32" in row and "[16, 16]" in row and "0.95 [0.91, 1]" in row
    assert any(" 100M " in x and "≤4" in x and "[≤4, 4]" in x for x in lines)  # 4, the smallest N run: at most


def test_cli_refuses_in_one_line_and_overwrites_nothing(tmp_path):
    dirs = _studies(tmp_path, SHRINKS)
    bare = _study(tmp_path, "bare", 5e8, [], claim6=False)
    r = _cli([*dirs, bare])
    assert r.exit_code == 2 and f"error: {bare}: the study has no population-size runs (claim 6)" in r.output
    assert "--population-sizes 4,8,16" in r.output and len(r.output.strip().splitlines()) == 1
    r = _cli([tmp_path / "nowhere"])
    assert r.exit_code == 2 and "no analysis.json or analysis.json.gz" in r.output
    same = _study(tmp_path, "same", SHRINKS["small"][0], SHRINKS["mid"][1])
    r = _cli([dirs[0], same])
    assert r.exit_code == 2 and "have the same parameter count" in r.output
    r = _cli([*dirs, "--fraction", "0"])
    assert r.exit_code == 2 and "--fraction must lie in (0, 1]" in r.output
    before = (dirs[0] / "analysis.json").read_bytes()
    r = _cli([*dirs, "--json", dirs[0] / "analysis.json"])  # an input is never the output
    assert r.exit_code == 2 and "error:" in r.output and (dirs[0] / "analysis.json").read_bytes() == before
    out = tmp_path / "x.json"
    r = _cli([*dirs, bare, "--json", out])
    assert r.exit_code == 2 and not out.exists()  # refused before anything is written


def test_reads_the_published_tiny_study_from_its_gzipped_analysis():
    """docs/tiny-study-2026-12-03/ holds analysis.json.gz only: read as published, it gives what
    docs/reproduction.md states (N needed 32, interval [8, 32]; one model size, so the verdict is unclear)."""
    d = Path(__file__).parents[2] / "docs" / "tiny-study-2026-12-03"
    assert (d / "analysis.json.gz").is_file() and not (d / "analysis.json").exists()
    r = scale_analysis([d])
    [m] = r["models"]
    assert (m["reference_population"], m["n_needed"], m["n_low"], m["n_high"]) == (32, 32, 8, 32)
    assert m["params"] == 763_776 and m["population_alpha"] == "fixed"
    assert r["verdict"] == "unclear"


def test_cli_never_replaces_or_shadows_a_published_gzipped_analysis(tmp_path):
    """A study directory holding only analysis.json.gz (as docs/ publishes): --json may not write over it, nor
    an analysis.json beside it (which later reads would take instead)."""
    import gzip

    dirs = _studies(tmp_path, SHRINKS)
    for d in dirs:
        (d / "analysis.json.gz").write_bytes(gzip.compress((d / "analysis.json").read_bytes()))
        (d / "analysis.json").unlink()
    before = {d: (d / "analysis.json.gz").read_bytes() for d in dirs}
    r = _cli(dirs)
    assert r.exit_code == 0 and "reproduced" in r.output, r.output  # read from the .gz files
    for target in (dirs[0] / "analysis.json.gz", dirs[1] / "analysis.json"):
        r = _cli([*dirs, "--json", target])
        assert r.exit_code == 2 and "error:" in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert {d: (d / "analysis.json.gz").read_bytes() for d in dirs} == before
    assert not any((d / "analysis.json").exists() for d in dirs)
