"""Every numbered example runs end to end with --quick (tiny settings), so the examples never rot.

The examples share one run cache (module-scoped tmp dir), as they do in real use: 01 trains the quick
runs, 02-05 reuse them. Example 06 builds a second tiny model and trains 4 ES runs: marked slow.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(name: str):
    sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(name.replace(".py", ""), EXAMPLES / name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("examples")
    return root / "runs", root / "out"


def run(name, dirs, *extra):
    runs, out = dirs
    mod = load(name)
    result = mod.main(["--quick", "--seeds", "0", "--runs", str(runs), "--out", str(out), *extra])
    assert isinstance(result, dict)
    return result, out


def test_examples_have_docstring_and_quick_flag():
    scripts = sorted(EXAMPLES.glob("[0-9][0-9]_*.py"))
    assert [p.name[:2] for p in scripts] == [f"{i:02d}" for i in range(1, 11)]
    for p in scripts:
        text = p.read_text()
        assert text.startswith('"""') and "python examples/" in text and "--quick" in text, p.name
        assert "def main(argv=None)" in text, p.name


def test_01_passk_and_02_to_05_reuse_runs(dirs):
    r, out = run("01_passk_budget.py", dirs)
    assert set(r["summary"]) == {"base", "es", "grpo", "es-grpo", "grpo-es"}
    assert json.loads((out / "01_passk_budget_s0.json").read_text())["table_md"].startswith("Pass@K")
    for m in ("es", "grpo"):
        assert (dirs[0] / f"{m}-q64-N8-s0" / "checkpoints" / "final" / "config.json").exists()
    r2, _ = run("02_distance.py", dirs)
    assert r2["per_seed"][0]["es_rel_l2"] > 0 and r2["per_seed"][0]["grpo_rel_l2"] > 0
    r4, _ = run("04_topk_groups.py", dirs)
    assert sum(r4["summed"]["es"]["abs"].values()) == 100
    r3, _ = run("03_sparsify.py", dirs)
    pts = r3["per_seed"][0]["es"]["points"]
    assert [round(p["target_sparsity"], 2) for p in pts] == [0.5, 0.9]
    r5, _ = run("05_held_out.py", dirs, "--methods", "es,grpo", "--tasks", "arith-3")
    assert set(r5["results"]) == {"base", "es", "grpo"}


def test_07_two_point(dirs):
    r, _ = run("07_two_point.py", dirs)
    (row,) = r["results"]
    assert row["pairs"] == 4 and len(row["plus"]) == len(row["minus"]) == 4


def test_08_diversity_sigma(dirs):
    r, _ = run("08_diversity_sigma.py", dirs)
    assert [x["sigma"] for x in r["results"]] == [1e-3, 3e-3]
    assert all(x["js_max"] > 0 for x in r["results"])


def test_09_precision(dirs):
    r, _ = run("09_precision.py", dirs)
    rows = r["results"][0]
    assert {(x["method"], x["dtype"]) for x in rows} == {(m, d) for m in ("es", "grpo") for d in ("fp32", "bf16")}
    assert all(0 <= x["frac_changed"] <= 1 and sum(x["top_rel"].values()) <= 100 for x in rows)
    assert (dirs[0] / "base-bf16" / "config.json").exists()


@pytest.mark.slow
def test_06_population_scale(dirs):
    r, _ = run("06_population_scale.py", dirs)
    assert set(r["summary"]) == {"tiny", "large"}
    assert set(r["results"]["tiny"]) == {8, 16}


def test_10_arithmetic_replay(dirs):
    result, _ = run("10_arithmetic_replay.py", dirs)
    r = result["results"]
    assert set(r) == {"ours-fp32", "ours-bf16", "ref-fp32", "ref-bf16"}
    assert r["ours-fp32"]["restore_drift_max"] == 0.0 and r["ours-bf16"]["restore_drift_max"] == 0.0  # exact
    assert r["ref-bf16"]["restore_drift_max"] > 1e-3  # subtraction in bf16 leaves weights off by a bf16 step
    assert all(sum(x["top_abs"].values()) == 100 for x in r.values())
    # each arithmetic was kept as it finished; the same command reuses them (nothing replayed), other settings do not
    mod = load("10_arithmetic_replay.py")
    calls = []
    real = mod.replay
    mod.replay = lambda *a, **k: calls.append(a) or real(*a, **k)
    again = mod.main(["--quick", "--seeds", "0", "--out", str(dirs[1])])
    assert calls == [] and json.loads(json.dumps(again["results"])) == json.loads(json.dumps(r))
    mod.main(["--quick", "--seeds", "0", "--out", str(dirs[1]), "--population", "2"])
    assert len(calls) == 4
    sub = mod.main(["--quick", "--seeds", "0", "--out", str(dirs[1]), "--population", "2",
                    "--arithmetics", "ref-bf16,ours-fp32"])
    assert list(sub["results"]) == ["ref-bf16", "ours-fp32"] and len(calls) == 4  # both kept by the N = 2 run
    mod.code_fingerprint = lambda: "other code"  # the arithmetic changed: nothing kept is reused
    mod.main(["--quick", "--seeds", "0", "--out", str(dirs[1]), "--population", "2", "--arithmetics", "ours-fp32"])
    assert len(calls) == 5
    with pytest.raises(SystemExit) as e:
        mod.main(["--quick", "--arithmetics", "ours-fp16"])
    assert e.value.code == 2


def test_10_norm_scale_keeps_the_function_and_moves_the_norms():
    """--norm-scale: norm weights reach the asked median, consumers shrink by the same factor, logits stay."""
    import torch

    from deltalens.io.models import load_model

    mod = load("10_arithmetic_replay.py")
    model, tok = load_model("tiny")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = tok("12+7=19. 3+45=", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        ref = model(ids).logits
        info = mod.fold_norm_scale(model, 4.0)
        new = model(ids).logits
    after = model.state_dict()
    g0, g1 = before["model.layers.1.input_layernorm.weight"], after["model.layers.1.input_layernorm.weight"]
    c = float(g1[0] / g0[0])
    assert float(g1.abs().median()) == pytest.approx(4.0, rel=1e-5)
    assert torch.allclose(after["model.layers.1.self_attn.k_proj.weight"] * c,
                          before["model.layers.1.self_attn.k_proj.weight"], rtol=1e-5, atol=1e-7)
    assert torch.equal(after["model.layers.1.self_attn.o_proj.weight"], before["model.layers.1.self_attn.o_proj.weight"])
    assert info["final_norm_folded"] and 3.0 < info["factor_min"] <= info["factor_max"] < 5.0
    assert torch.allclose(new, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
    with pytest.raises(SystemExit) as e:
        mod.main(["--quick", "--norm-scale", "0"])
    assert e.value.code == 2


def test_10_drift_from_digests_never_reads_as_zero():
    """Restore-by-copy replays keep a digest per tensor, not a clone: a changed bit reads NaN, not 0 drift."""
    import torch

    mod = load("10_arithmetic_replay.py")
    params = [(0, "a", torch.zeros(5)), (1, "b", torch.ones(3))]
    for exact in (True, False):
        start = mod._snapshot(params, exact=exact)
        assert mod._drift(params, start) == (0.0, 0, 8)
    start = {True: mod._snapshot(params, exact=True), False: mod._snapshot(params, exact=False)}
    params[1][2][2] += 2.0 ** -20
    assert mod._drift(params, start[True]) == (2.0 ** -20, 1, 8)
    worst, changed, total = mod._drift(params, start[False])
    assert math.isnan(worst) and changed == -1 and total == 8
