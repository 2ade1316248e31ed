"""`deltalens report`: analysis assembled from checkpoints, cached by content hash, rendered to HTML."""

import json
from pathlib import Path

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
    args = ["report", str(rand_model_dir), str(ck), "--arch", str(rand_model_dir), "--task", "arith",
            "--limit", "3", "--samples", "4", "--k", "1,4", "--thresholds", "1e-3,5e-3", "--held-out", "arith-3",
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


def _tiny_copy_and_finetune(tmp_path):
    """An HF directory (a copy of tiny) as the base and a bare safetensors fine-tune of it."""
    import shutil

    from deltalens.tiny import MODEL_DIR

    base = tmp_path / "base"
    shutil.copytree(MODEL_DIR, base)
    model, _ = load_model(str(base))
    g = torch.Generator().manual_seed(0)
    sd = {k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
    ft = save_state_dict(sd, tmp_path / "ft.safetensors")
    return base, ft


def test_each_spec_is_resolved_once_on_the_report_path(tmp_path, monkeypatch):
    """build_analysis resolves the base, every model and --arch once (diff, hashes, evaluations,
    sparsification and training curves take the references; the bare input carries the architecture's:
    its hash, its tensors' config and its loading use that), and the output guard takes references as
    they are. Not
    counted: deltalens.evaluation's own look-ups (the cost lines' model identity and the sparsified state
    dicts' architecture take a spec string there, not yet a reference)."""
    import traceback

    import deltalens.io.spec as spec_mod
    from deltalens.analysis.report import build_analysis
    from deltalens.io.outputs import Output, check_outputs
    from deltalens.io.spec import resolve

    base, ft = _tiny_copy_and_finetune(tmp_path)
    calls: list[str] = []
    classify = spec_mod._classify

    def counted(spec, fetch):
        if not any("deltalens/evaluation/" in f.filename for f in traceback.extract_stack()):
            calls.append(spec)
        return classify(spec, fetch)

    monkeypatch.setattr(spec_mod, "_classify", counted)
    doc = build_analysis(str(base), [str(ft)], labels=["ft"], arch="tiny", task="arith", limit=2, samples=2, ks="1,2",
                         sparsify=[1e-3], cache_dir=tmp_path / "cache")
    assert set(doc["evals"]) == {"base", "ft"} and doc["sparsify"]["ft"]["points"]
    assert calls.count(str(base)) == 1 and calls.count(str(ft)) == 1 and calls.count("tiny") == 1, calls
    assert len(calls) == 3, calls
    calls.clear()
    refs = [resolve(str(base)), resolve(str(ft), arch="tiny")]
    check_outputs([Output(tmp_path / "rep", "-o", directory=True)], models=refs)
    assert calls == [str(base), str(ft)]  # resolving only: the guard classified nothing again


def test_the_base_is_read_once_on_a_cold_cache(tmp_path, monkeypatch):
    """Cold cache: the content hash of the base comes from the diff's own reads (before: hashed, then
    diffed, 2x its bytes). What is read again: the header (a few KB, parsed by its own reader) and the
    untied embedding / LM head pair, which the tie check reads ahead of the diff (each again by the diff,
    and the LM head, which sits first, once more: 3 embedding-sized tensors, 5% of tiny). The hashes are
    those of `weights_hash` (the cache keys of earlier reports still match); with a warm cache the base is
    read once, for its hash (the diff is cached)."""
    import builtins

    from deltalens.analysis.report import Cache, build_analysis, weights_hash

    base, ft = _tiny_copy_and_finetune(tmp_path)
    weights = base / "model.safetensors"
    read = [0]
    real_open = builtins.open

    class Counted:
        def __init__(self, f):
            self.f = f

        def read(self, *a):
            b = self.f.read(*a)
            read[0] += len(b)
            return b

        def readinto(self, buf):
            n = self.f.readinto(buf)
            read[0] += n
            return n

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def counted_open(file, mode="r", *a, **kw):
        f = real_open(file, mode, *a, **kw)
        return Counted(f) if "b" in mode and Path(file) == weights else f

    monkeypatch.setattr(builtins, "open", counted_open)
    cache = tmp_path / "cache"
    doc = build_analysis(str(base), [str(ft)], labels=["ft"], arch="tiny", cache_dir=cache)
    size = weights.stat().st_size
    embed = load_model(str(base))[0].model.embed_tokens.weight
    assert size <= read[0] <= size + 3 * embed.numel() * embed.element_size() + 8192, (read[0], size)
    monkeypatch.setattr(builtins, "open", real_open)
    key = Cache(cache).key("diff", base=weights_hash(str(base)), models=[weights_hash(str(ft), "tiny")], labels=["ft"])
    assert json.loads((cache / f"{key}.json").read_text())["diff"] == doc["diff"]
    monkeypatch.setattr(builtins, "open", counted_open)
    read[0] = 0
    assert build_analysis(str(base), [str(ft)], labels=["ft"], arch="tiny", cache_dir=cache)["diff"] == doc["diff"]
    assert read[0] == size
