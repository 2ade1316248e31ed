"""`deltalens report`: analysis assembled from checkpoints, cached by content hash, rendered to HTML."""

import json

import torch
from deltalens.cli.main import app
from typer.testing import CliRunner

from deltalens.io.atomic import save_state_dict
from deltalens.io.models import load_model
from deltalens.schema import validate


def test_report_end_to_end_and_cache(rand_model_dir, tmp_path):
    base, _ = load_model(str(rand_model_dir))
    sd = {k: v.clone() for k, v in base.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    for k, v in sd.items():
        v.add_(torch.randn(v.shape, generator=g) * (1e-2 if "norm" in k else 1e-3))
    ck = tmp_path / "ft.safetensors"
    save_state_dict(sd, ck)
    out = tmp_path / "rep"
    args = ["report", str(rand_model_dir), str(ck), "--config", str(rand_model_dir), "--task", "arith",
            "--limit", "3", "--samples", "4", "--k", "1,4", "--sparsify", "1e-3,5e-3", "--held-out", "arith-3",
            "-o", str(out), "--label", "ft"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "analysis.json").read_text())
    validate(doc)  # the analysis.json contract
    assert {"diff", "evals", "sparsify", "held_out"} <= set(doc)
    assert set(doc["evals"]) == {"base", "ft"}
    d = doc["diff"]["ft"]
    assert d["whole"]["rel_l2"] > 0 and d["groups"]["norm"]["max_abs"] > d["groups"]["mlp_up"]["max_abs"]
    assert [p["tau"] for p in doc["sparsify"]["ft"]["points"]] == [1e-3, 5e-3]
    html = (out / "report.html").read_text()
    assert "<script src" not in html and "plotly" in html.lower()
    cached = sorted(p.name for p in (out / "cache").iterdir())
    assert any(n.startswith("eval-") for n in cached) and any(n.startswith("sparsify-") for n in cached)
    # second run: everything from the cache
    r2 = CliRunner().invoke(app, args)
    assert r2.exit_code == 0 and r2.output.count("cached:") >= 4, r2.output
    # a changed checkpoint is recomputed (content hash, not path)
    sd["model.norm.weight"].add_(0.5)
    save_state_dict(sd, ck)
    r3 = CliRunner().invoke(app, args)
    assert r3.exit_code == 0
    doc3 = json.loads((out / "analysis.json").read_text())
    assert doc3["diff"]["ft"]["groups"]["norm"]["max_abs"] > d["groups"]["norm"]["max_abs"]


def test_report_bad_input(tmp_path):
    r = CliRunner().invoke(app, ["report", "tiny", str(tmp_path / "missing.pt")])
    assert r.exit_code == 2 and "no such file" in r.output
    r = CliRunner().invoke(app, ["report", "tiny", "tiny", "--sparsify", "1e-3"])
    assert r.exit_code == 2 and "--task" in r.output
    r = CliRunner().invoke(app, ["report", "tiny", "tiny", "--task", "arith", "--sparsify", "abc"])
    assert r.exit_code == 2 and "--thresholds" in r.output
