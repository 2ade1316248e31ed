"""deltalens.sparsify: exact global quantiles, reset math, sweep with a fake evaluator, CLI."""

import json
import math

import pytest
import torch
import typer
from typer.testing import CliRunner

from deltalens.analysis import sparsify as sp
from deltalens.analysis.sparsify import (
    apply_threshold,
    gain_retained,
    sparsify_sweep,
    thresholds_for_sparsity,
)
from deltalens.errors import DeltalensError
from deltalens.io.atomic import save_state_dict
from deltalens.io.tensors import load_state_dict
from deltalens.schema import validate


def _pair(seed=0):
    g = torch.Generator().manual_seed(seed)
    base = {"model.embed_tokens.weight": torch.randn(50, 8, generator=g),
            "model.layers.0.mlp.up_proj.weight": torch.randn(64, 33, generator=g),
            "model.norm.weight": torch.randn(17, generator=g).bfloat16(),
            "pos": torch.arange(4)}
    ckpt = {}
    for k, v in base.items():
        if v.is_floating_point():
            mask = torch.rand(v.shape, generator=g) < 0.6             # 40% of coordinates unchanged
            ckpt[k] = (v.float() + 1e-3 * torch.randn(v.shape, generator=g) * mask).to(v.dtype)
        else:
            ckpt[k] = v.clone()
    return base, ckpt


def _changed_abs(base, ckpt):
    a = torch.cat([(ckpt[k].float() - base[k].float()).abs().reshape(-1)
                   for k in base if base[k].is_floating_point()])
    return a[a > 0]


@pytest.mark.parametrize("chunk", [1 << 22, 13])
def test_thresholds_are_exact_quantiles(monkeypatch, chunk):
    monkeypatch.setattr(sp, "CHUNK", chunk)
    base, ckpt = _pair()
    a = _changed_abs(base, ckpt)
    n = a.numel()
    targets = [0.0, 0.1, 0.25, 0.5, 0.9, 0.999, 1.0]
    taus = thresholds_for_sparsity(base, ckpt, targets)
    for s, tau in zip(targets, taus):
        if s == 0:
            assert tau == 0.0
            continue
        m = math.ceil(s * n)  # the m-th smallest changed |Δ|: smallest τ with sparsity >= s
        assert tau == torch.sort(a).values[m - 1].item()
        # the same order statistic through torch.quantile ("lower" picks index floor(q (n-1)))
        assert tau == torch.quantile(a.double(), (m - 1) / (n - 1), interpolation="lower").item()
        assert (a <= tau).float().mean() >= s and (a < tau).float().mean() < s


def test_thresholds_edge_cases():
    same = {"w": torch.ones(3)}
    assert thresholds_for_sparsity(same, {"w": torch.ones(3)}, [0.5, 1.0]) == [0.0, 0.0]
    with pytest.raises(DeltalensError, match="outside"):
        thresholds_for_sparsity(same, same, [1.5])


def test_apply_threshold_math():
    base = {"w": torch.zeros(6), "lm_head.weight": torch.ones(2), "model.embed_tokens.weight": torch.ones(2)}
    ckpt = {"w": torch.tensor([0.0, 1.0, -2.0, 3.0, 0.5, float("nan")])}
    ckpt["model.embed_tokens.weight"] = torch.tensor([1.0, 5.0])
    ckpt["lm_head.weight"] = ckpt["model.embed_tokens.weight"]        # tied: thresholded once
    new, st = apply_threshold(base, ckpt, 2.0)
    # changed finite: 1, -2, 3, 0.5 (w) and 4 (embed) -> 5; reset |Δ| <= 2: 1, -2, 0.5 -> 3
    assert st["n_changed"] == 5 and st["n_reset"] == 3 and st["sparsity"] == pytest.approx(0.6)
    assert st["kept_l2_frac"] == pytest.approx(math.sqrt((9 + 16) / (1 + 4 + 9 + 0.25 + 16)))
    assert torch.equal(new["w"][:5], torch.tensor([0.0, 0.0, 0.0, 3.0, 0.0])) and new["w"][5].isnan()
    assert new["lm_head.weight"] is new["model.embed_tokens.weight"]
    assert list(new) == list(ckpt)
    _, st0 = apply_threshold(base, ckpt, 0.0)
    assert st0["n_reset"] == 0 and st0["kept_l2_frac"] == 1.0
    with pytest.raises(DeltalensError):
        apply_threshold(base, ckpt, -1.0)


def test_apply_threshold_keeps_dtype_and_base_values():
    base, ckpt = _pair()
    tau = thresholds_for_sparsity(base, ckpt, [0.5])[0]
    new, st = apply_threshold(base, ckpt, tau)
    assert st["sparsity"] == pytest.approx(0.5, abs=1e-3)
    for k in base:
        assert new[k].dtype == ckpt[k].dtype
        if k == "pos":
            continue
        d = (ckpt[k].float() - base[k].float()).abs()
        reset = (d > 0) & (d <= tau)
        assert torch.equal(new[k][reset], base[k][reset]) and torch.equal(new[k][~reset], ckpt[k][~reset])


def test_gain_retained():
    assert gain_retained(0.35, 0.3, 0.4) == pytest.approx(0.5)
    assert gain_retained(0.35, 0.4, 0.4) is None and gain_retained(None, 0.1, 0.2) is None


def _mass(sd, base):
    """Σ |θ - θ0| over the float tensors."""
    return sum(float((sd[k].float() - v.float()).abs().sum())
               for k, v in base.items() if v.is_floating_point())


def test_sweep_with_fake_evaluator(tmp_path):
    base, ckpt = _pair()
    full = _mass(ckpt, base)
    calls = []

    def fake(sd):  # pass@1 grows linearly with the |Δ| mass kept: base 0.2, full checkpoint 0.6
        calls.append(1)
        p = 0.2 + 0.4 * _mass(sd, base) / full
        return {"pass_at_k": {"1": p, "16": min(1.0, 2 * p)}}

    b = save_state_dict(base, tmp_path / "base.safetensors")
    c = save_state_dict(ckpt, tmp_path / "es.safetensors")
    out = tmp_path / "sparse"
    sec = sparsify_sweep(b, c, [0.0, 1e-3, 1.0], fake, out_dir=out, sparsities=[0.5], task="arith")
    s = sec["es"]
    assert s["task"] == "arith" and s["ks"] == [1, 16]
    assert s["base_pass_at_k"]["1"] == pytest.approx(0.2) and s["full_pass_at_k"]["1"] == pytest.approx(0.6)
    taus = [p["tau"] for p in s["points"]]
    assert taus == sorted(taus) and len(taus) == 4
    first, last = s["points"][0], s["points"][-1]
    assert first["tau"] == 0 and first["sparsity"] == 0 and first["gain_retained"] == pytest.approx(1.0)
    assert last["tau"] == 1.0 and last["sparsity"] == 1.0 and last["gain_retained"] == pytest.approx(0.0)
    assert last["kept_l2_frac"] == 0.0
    half = next(p for p in s["points"] if p.get("target_sparsity") == 0.5)
    assert half["sparsity"] == pytest.approx(0.5, abs=1e-3) and 0 < half["gain_retained"] < 1
    p1, pb, pf = half["pass_at_k"]["1"], 0.2, 0.6
    assert half["gain_retained"] == pytest.approx((p1 - pb) / (pf - pb))
    assert half["gain_retained_at_k"]["16"] == gain_retained(half["pass_at_k"]["16"], 0.4, 1.0)
    # base + full evaluated once each; τ=0 and τ=1 reuse them: only 2 more evaluations
    assert len(calls) == 2 + 2
    saved = sorted(p.name for p in out.iterdir())
    assert len(saved) == 4 and all(n.startswith("tau-") and n.endswith(".safetensors") for n in saved)
    reset_all = load_state_dict(out / "tau-1.safetensors")
    assert torch.equal(reset_all["model.norm.weight"], base["model.norm.weight"])


def test_sweep_needs_points_and_pass_at_k():
    base, ckpt = _pair()
    with pytest.raises(DeltalensError, match="at least one threshold"):
        sparsify_sweep(base, ckpt, [], lambda sd: {"pass_at_k": {"1": 0.1}})
    with pytest.raises(DeltalensError, match="no pass_at_k"):
        sparsify_sweep(base, ckpt, [1e-4], lambda sd: {})


def test_cli_sparsify(tmp_path, monkeypatch):
    import deltalens.evaluation
    from cli import common
    from cli.diff import sparsify

    base, ckpt = _pair()
    b = save_state_dict(base, tmp_path / "base.safetensors")
    c = save_state_dict(ckpt, tmp_path / "run.safetensors")
    seen = []

    def fake_evaluate_state_dict(spec, sd, task, *, samples, ks, temperature=0.6, limit=None, seed=0,
                                 model_cache=None, chat_template="auto", backend=None, compute_dtype="fp32"):
        assert backend is None and compute_dtype in ("auto", "fp32", "bf16")
        seen.append((spec, task.spec, samples, tuple(ks), limit, id(task)))
        changed = sum(int((sd[k].float() != base[k].float()).sum())
                      for k in base if base[k].is_floating_point())
        p = {str(k): 0.1 + changed / 10000 for k in ks}
        return {"task": task.spec, "n_problems": 3, "samples": samples, "temperature": temperature, "pass_at_k": p,
                "maj_at_k": p, "mean_reward": 0.1}

    monkeypatch.setattr(deltalens.evaluation, "evaluate_state_dict", fake_evaluate_state_dict)
    app = typer.Typer()
    app.command("sparsify")(common.guard(sparsify))
    app.command("noop")(lambda: None)
    res = CliRunner().invoke(app, ["sparsify", str(c), "--base", str(b), "--arch", "tiny", "--thresholds", "5e-4",
                                   "--sparsity", "0.9", "--samples", "4", "--k", "1,4", "--limit", "3",
                                   "--json", str(tmp_path / "s.json")])
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "s.json").read_text())
    validate(doc)  # the analysis.json contract
    s = doc["sparsify"]["run"]
    assert s["ks"] == [1, 4] and len(s["points"]) == 2 and s["task"] == "arith"
    assert doc["models"][0]["label"] == "run" and set(doc["evals"]) == {"base", "run"}
    assert seen[0][:5] == ("tiny", "arith", 4, (1, 4), 3)  # a bare base is evaluated on its --arch
    assert len(seen) == 4 and len({x[5] for x in seen}) == 1  # base, full, 2 points: one Task object for all
    res = CliRunner().invoke(app, ["sparsify", str(c), "--base", str(b), "--sparsity", "0.5,x"])
    assert res.exit_code == 2 and "comma-separated" in res.output
    res = CliRunner().invoke(app, ["sparsify", str(c), "--base", str(b), "--backend", "onnx"])
    assert res.exit_code == 2 and "--backend must be hf or vllm" in res.output


def test_controls_match_the_threshold_in_sparsity_and_norm():
    from deltalens.analysis.sparsify import random_mask, uniform_shrink

    base, ckpt = _pair(0)
    tau = thresholds_for_sparsity(base, ckpt, [0.9])[0]
    _, st = apply_threshold(base, ckpt, tau)
    rnd, rs = random_mask(base, ckpt, st["sparsity"], seed=1)
    assert rs["sparsity"] == pytest.approx(st["sparsity"], abs=0.01)
    # dropping the 90% smallest changes keeps far more of the norm than dropping a random 90%
    assert rs["kept_l2_frac"] < st["kept_l2_frac"]
    shr, _ = uniform_shrink(base, ckpt, st["kept_l2_frac"])
    floats = [k for k in base if base[k].dtype == torch.float32]
    norm = sum(float((shr[k].float() - base[k].float()).square().sum()) for k in floats) ** 0.5
    full = sum(float((ckpt[k].float() - base[k].float()).square().sum()) for k in floats) ** 0.5
    assert norm == pytest.approx(st["kept_l2_frac"] * full, rel=1e-3)
    assert torch.equal(shr["pos"], ckpt["pos"]) and torch.equal(rnd["pos"], ckpt["pos"])
