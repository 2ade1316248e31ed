"""Issue #30 part A: a new user's commands on bare weights (`torch.save` of state dicts), end to end.

Train tiny ES for 1 iteration and GRPO for 1 step, save each final state dict bare (`es.pt`, `grpo.pt`,
and a `.safetensors` copy), save the tiny model's own as `base.pt`, then run the commands the issue ran:
`sparsify es.pt --base base.pt --arch tiny ...`, `report base.pt es.pt grpo.pt --arch tiny --task arith ...`,
`diff` and `diversity` with the same `--arch`. Each must exit 0 with every section present; without
`--arch` the one-line error names it; the report goes to ./deltalens-report/{report.html,analysis.json}.
Evaluations use a few problems and samples, so the whole module stays within a minute or two on tiny.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support import final_weights, run_cli, tiny_spec

from deltalens.schema import validate

FAST_EVAL = ["--limit", "2", "--samples", "2", "--k", "1,2"]
# long enough completions that rewards differ within a population / group: else the update is zero
ES_FAST = ["--population", "4", "--prompts", "4", "--eval-every", "0"]
GRPO_FAST = ["--prompts", "4", "--num-generations", "4", "--eval-every", "0", "--steps", "1", "--save-every", "0"]


@pytest.fixture(scope="module")
def bare(tmp_path_factory) -> Path:
    """A directory holding only bare weight files: base.pt (tiny), es.pt, grpo.pt, grpo.safetensors."""
    from safetensors.torch import save_file

    from deltalens.io.models import load_model

    spec = tiny_spec()
    runs = tmp_path_factory.mktemp("runs")
    r = run_cli(["train", "es", "--model", spec, "--out", runs / "es", "--iterations", "1", *ES_FAST])
    assert r.exit_code == 0, r.output
    r = run_cli(["train", "grpo", "--model", spec, "--out", runs / "grpo", *GRPO_FAST])
    assert r.exit_code == 0, r.output
    d = tmp_path_factory.mktemp("bare")
    model, _ = load_model(spec)
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(base, d / "base.pt")
    es, grpo = final_weights(runs / "es"), final_weights(runs / "grpo")
    for sd in (es, grpo):  # each run moved the weights (a zero update would make every check below vacuous)
        assert any(not torch.equal(sd[k], base[k]) for k in base)
    torch.save(es, d / "es.pt")
    torch.save(grpo, d / "grpo.pt")
    save_file({k: v.contiguous() for k, v in grpo.items()}, d / "grpo.safetensors")
    assert not (d / "config.json").exists()  # bare: nothing names their architecture but --arch
    return d


def _listing(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


def test_without_arch_the_error_names_arch(bare, tmp_path):
    before = _listing(bare)
    for args in (["sparsify", bare / "es.pt", "--base", bare / "base.pt", "--json", tmp_path / "s.json"],
                 ["report", bare / "base.pt", bare / "es.pt", "--task", "arith", "-o", tmp_path / "r"]):
        r = run_cli(args)
        assert r.exit_code == 2, r
        assert r.output.strip() == (f"error: {bare / 'base.pt'} holds weights only; pass --arch to name its "
                                    "architecture (e.g. --arch tiny, or the HF directory it was trained from)")
    r = run_cli(["sparsify", bare / "es.pt", "--base", bare / "base.pt", "--arch", bare / "es.pt"])
    assert r.exit_code == 2 and r.output.strip().startswith(f"error: --arch {bare / 'es.pt'} is a bare weights file")
    assert list(tmp_path.iterdir()) == [] and _listing(bare) == before


def test_sparsify_bare_pt_with_arch(bare, tmp_path):
    out = tmp_path / "s.json"
    r = run_cli(["sparsify", bare / "es.pt", "--base", bare / "base.pt", "--arch", "tiny",
                 "--thresholds", "5e-4,10", "--sparsity", "", *FAST_EVAL, "--json", out])
    assert r.exit_code == 0, r.output
    # the cost before the work: base + full + 2 points
    assert "sparsify es: 1 model x 4 points x 2 problems x 2 samples = 16 generations" in " ".join(r.output.split())
    doc = json.loads(out.read_text())
    validate(doc)
    s = doc["sparsify"]["es"]
    assert [p["tau"] for p in s["points"]] == [5e-4, 10.0] and set(doc["evals"]) == {"base", "es"}
    assert s["points"][1]["sparsity"] == 1.0 and "gain_ci" in s and "gain_retained_ci" in s["points"][0]
    # τ = 10 resets every change: said, with the τ named
    assert s["warnings"] == [("tau=10 resets 100.0% of the changed coordinates of es: the sparsified model is "
                              "(nearly) the base; choose a smaller tau")]
    assert "tau=10 resets 100.0%" in " ".join(r.output.split())


def test_report_bare_pt_and_safetensors_with_arch(bare, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default output is ./deltalens-report
    before = _listing(bare)
    r = run_cli(["report", bare / "base.pt", bare / "es.pt", bare / "grpo.safetensors", "--arch", "tiny",
                 "--task", "arith", *FAST_EVAL, "--sparsify", "5e-4", "--held-out", "arith-long"])
    assert r.exit_code == 0, r.output
    out = tmp_path / "deltalens-report"
    assert (out / "report.html").is_file() and (out / "cache").is_dir()
    doc = json.loads((out / "analysis.json").read_text())
    validate(doc)
    assert {"diff", "evals", "sparsify", "held_out"} <= set(doc)
    assert set(doc["evals"]) == {"base", "es", "grpo"} and set(doc["sparsify"]) == {"es", "grpo"}
    assert set(doc["diff"]) == {"es", "grpo"} and doc["diff"]["es"]["whole"]["rel_l2"] > 0
    text = " ".join(r.output.split())
    assert "evaluate on arith: 3 models x 2 problems x 2 samples = 12 generations" in text
    assert _listing(bare) == before  # nothing written beside the inputs
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deltalens-report"]


def test_report_output_is_a_directory(bare, tmp_path):
    r = run_cli(["report", bare / "base.pt", bare / "es.pt", "-o", tmp_path / "r.html"])
    assert r.exit_code == 2
    assert r.output.strip() == (f"error: -o {tmp_path / 'r.html'}: -o names the report's directory (it writes "
                                f"report.html, analysis.json and cache/ there); try -o {tmp_path / 'r'}")
    assert list(tmp_path.iterdir()) == []


def test_diff_and_diversity_take_arch(bare, tmp_path):
    r = run_cli(["diff", bare / "base.pt", bare / "es.pt", bare / "grpo.pt", "--arch", "tiny",
                 "--json", tmp_path / "d.json"])
    assert r.exit_code == 0, r.output
    assert set(json.loads((tmp_path / "d.json").read_text())["diff"]) == {"es", "grpo"}
    # --arch may name a model's config.json (its directory, which holds the tokenizer too), nothing else
    from deltalens.tiny import MODEL_DIR

    r = run_cli(["diff", bare / "base.pt", bare / "es.pt", "--arch", MODEL_DIR / "config.json"])
    assert r.exit_code == 0, r.output
    other = tmp_path / "other.json"
    other.write_text("{}")
    r = run_cli(["diff", bare / "base.pt", bare / "es.pt", "--arch", other])
    assert r.exit_code == 2 and r.output.strip() == (f"error: --arch {other}: name a model's config.json (or its "
                                                     "directory), not other.json")
    r = run_cli(["diversity", bare / "es.pt", "--arch", "tiny", "--members", "2", "--prompts", "1",
                 "--samples", "1", "--max-new-tokens", "4", "--json", tmp_path / "v.json"])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "v.json").read_text())["diversity"]


def _fake_eval(base: dict, gains: list[int]):
    """evaluate_state_dict stand-in, 8 samples per problem: the base solves 2 of each problem, a state dict
    holding a share f of the changed coordinates round(f * gain) more (so sparsifying loses gain)."""
    total = sum(v.numel() for v in base.values() if v.is_floating_point())

    def fake(spec, sd, task, *, samples, ks, limit=None, **kw):
        f = sum(int((sd[k] != v).sum()) for k, v in base.items() if v.is_floating_point()) / total
        rows = [{"correct": 2 + round(f * g), "n": 8} for g in gains]
        p1 = sum(r["correct"] for r in rows) / (8 * len(rows))
        return {"task": task.spec, "n_problems": len(rows), "samples": 8, "pass_at_k": {"1": p1},
                "maj_at_k": {"1": p1}, "mean_reward": p1, "per_problem": rows}

    return fake


SIGNAL = [3 * (i % 2 + (i % 3 == 0)) for i in range(40)]           # +0.22 Pass@1: far from noise
NOISE = [1 if i % 4 == 0 or i == 1 else -1 if i % 4 == 2 else 0 for i in range(40)]  # +0.003: noise


@pytest.mark.parametrize(("gains", "noise"), [(SIGNAL, False), (NOISE, True)])
def test_gain_kept_has_an_interval_and_noise_is_flagged(bare, tmp_path, monkeypatch, gains, noise):
    """The table shows gain kept with its 95% interval; a gain whose own interval contains 0 is flagged."""
    import deltalens.evaluation

    base = torch.load(bare / "base.pt", weights_only=True)
    monkeypatch.setattr(deltalens.evaluation, "evaluate_state_dict", _fake_eval(base, gains))
    r = run_cli(["sparsify", bare / "es.pt", "--base", bare / "base.pt", "--arch", "tiny", "--thresholds", "",
                 "--sparsity", "0.5", "--samples", "8", "--k", "1", "--limit", "40", "--json", tmp_path / "s.json"])
    assert r.exit_code == 0, r.output
    s = json.loads((tmp_path / "s.json").read_text())["sparsify"]["es"]
    (p,) = s["points"]
    text = " ".join(r.output.split())
    assert s["gain_within_noise"] is noise
    assert ("warning (es): its gain at Pass@1 is within noise" in text) is noise
    lo, hi = s["gain_ci"]
    assert (lo <= 0 <= hi) is noise
    if not noise:
        assert 0.4 < p["gain_retained"] < 0.6
        lo, hi = p["gain_retained_ci"]
        assert lo < p["gain_retained"] < hi and hi - lo < 0.5
        assert f"{p['gain_retained']:.2f} [{lo:.2f},{hi:.2f}]" in r.output
