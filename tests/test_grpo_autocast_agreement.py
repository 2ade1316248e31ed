"""benchmarks/grpo_autocast_agreement.py: what it reads from a finished autocast sweep, on a constructed sweep
directory (known answers; the weight distances are es_compute_dtype_agreement.distances', replaced here)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from support import load_benchmark


def _point(name, value, p1, vs_best, ci, seeds=(0, 1)):
    return {"name": name, "values": {"autocast": value}, "seeds": list(seeds), "pass_at_1": p1, "vs_base": p1 - 0.3,
            "vs_base_ci": [p1 - 0.35, p1 - 0.25], "vs_best": vs_best, "vs_best_ci": ci}


def _sweep(tmp_path, best_is_fp32: bool):
    root = tmp_path / "sweep"
    fp32 = _point("autocast=none", "none", 0.6, 0.0 if best_is_fp32 else -0.05,
                  [0.0, 0.0] if best_is_fp32 else [-0.09, -0.01])
    bf16 = _point("autocast=bf16", "bf16", 0.55 if best_is_fp32 else 0.65, -0.05 if best_is_fp32 else 0.0,
                  [-0.09, -0.01] if best_is_fp32 else [0.0, 0.0])
    doc = {"model": "tiny", "task": "arith", "preset": "tiny", "fixed": {"steps": 2}, "evaluation": {"problems": 4},
           "base": {"pass_at_1": 0.3}, "best": (fp32 if best_is_fp32 else bf16)["name"], "points": [fp32, bf16]}
    root.mkdir()
    (root / "sweep.json").write_text(json.dumps(doc))
    for p in (fp32, bf16):
        for seed in (0, 1):
            run = root / "runs" / f"{p['name']}-s{seed}"
            run.mkdir(parents=True)
            (run / "state.json").write_text("{}")
            rows = [{"iteration": i + 1, "reward_mean": 0.1 * (i + 1), "kl": 0.01, "completion_length": 17.0,
                     "timing": {"iteration_s": 2.0 + i}, "compute_dtype": "bf16"} for i in range(3)]
            (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


@pytest.mark.parametrize("best_is_fp32", [True, False])
def test_it_reports_bf16_minus_fp32_with_the_sign_of_the_difference(tmp_path, monkeypatch, best_is_fp32):
    mod = load_benchmark("grpo_autocast_agreement")
    seen = []
    monkeypatch.setattr(mod, "distances", lambda base, runs: seen.append((base, dict(runs))) or {"cosine": 1.0})
    monkeypatch.setattr(mod, "per_seed", lambda *a: {})  # reads the sweep's cached scores, which this one lacks
    out = tmp_path / "agreement.json"
    monkeypatch.setattr(sys, "argv", ["x", str(_sweep(tmp_path, best_is_fp32)), "--out", str(out)])
    mod.main()
    res = json.loads(out.read_text())
    # fp32 best at 0.60, bf16 0.55 (vs best -0.05): bf16 - fp32 = -0.05; bf16 best at 0.65 (fp32 vs best -0.05):
    # bf16 - fp32 = +0.05 and its interval the negated, swapped one
    want = (-0.05, [-0.09, -0.01]) if best_is_fp32 else (0.05, [0.01, 0.09])
    assert (res["bf16_minus_fp32"]["mean"], res["bf16_minus_fp32"]["ci95"]) == want
    assert res["bf16_minus_fp32"]["zero_in_interval"] is False
    assert res["seeds"] == [0, 1] and list(res["distance"]) == ["seed 0", "seed 1"]
    # each seed's distances compare that seed's two runs, against the sweep's base model
    assert [(b, {k: Path(v).name for k, v in r.items()}) for b, r in seen] == [
        ("tiny", {"fp32": f"autocast=none-s{s}", "bf16": f"autocast=bf16-s{s}"}) for s in (0, 1)]
    facts = res["runs"]["bf16 seed 1"]
    assert (facts["steps"], facts["train_seconds"], facts["median_step_s"]) == (3, 9.0, 3.0)
    assert facts["reward_mean_per_step"] == [0.1, 0.2, 0.3]


def test_an_unfinished_run_or_a_missing_point_is_said_in_one_line(tmp_path, monkeypatch):
    mod = load_benchmark("grpo_autocast_agreement")
    root = _sweep(tmp_path, True)
    (root / "runs" / "autocast=bf16-s1" / "state.json").unlink()
    monkeypatch.setattr(sys, "argv", ["x", str(root)])
    with pytest.raises(SystemExit, match="autocast=bf16-s1 is not a finished run"):
        mod.main()
    doc = json.loads((root / "sweep.json").read_text())
    doc["points"] = doc["points"][:1]
    (root / "sweep.json").write_text(json.dumps(doc))
    with pytest.raises(SystemExit, match="no point with autocast=bf16"):
        mod.main()
