"""The plan line (what an evaluation will generate, and how long that took here before) and the measured
rates behind it: keyed by a model identity that survives copies, tolerant of any cache failure."""

from __future__ import annotations

import json
import shutil

import pytest

from deltalens.evaluation.cost import model_identity, plan_line, rates_path, record_rate

NO_RATE = "no rate measured yet on this machine for {where}: the progress line gives an ETA"


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DELTALENS_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def plan(**kw):
    args = {"what": "eval", "models": 2, "problems": 100, "samples": 32, "max_new_tokens": 64, "model": "tiny",
            "device": "cpu"}
    return plan_line(**{**args, **kw})


def test_plan_line_without_a_measurement():
    assert plan() == ("eval: 2 models x 100 problems x 32 samples = 6,400 generations (<= 64 new tokens each); "
                      + NO_RATE.format(where="tiny/hf"))
    assert plan(what="sparsify", models=1, points=4, samples=1, problems=1).startswith(
        "sparsify: 1 model x 4 points x 1 problem x 1 sample = 4 generations (<= 64 new tokens each); ")


def test_a_recorded_rate_gives_an_estimate():
    record_rate(model="tiny", backend="hf", max_new_tokens=64, sequences=640, seconds=12.8, device="cpu")
    assert plan() == ("eval: 2 models x 100 problems x 32 samples = 6,400 generations (<= 64 new tokens each); "
                      "~2.1 min at 50 seq/s measured here on tiny/hf")
    assert plan(max_new_tokens=40).endswith("~2.1 min at 50 seq/s measured here on tiny/hf")  # same bucket (<= 64)
    assert plan(max_new_tokens=65).endswith(NO_RATE.format(where="tiny/hf"))  # twice the budget: not this rate
    assert plan(backend="vllm").endswith(NO_RATE.format(where="tiny/vllm"))
    assert plan(dtype="bf16").endswith(NO_RATE.format(where="tiny/hf in bf16"))
    assert json.loads(rates_path().read_text())[f"{model_identity('tiny')}|hf|cpu|fp32|<=64"]["sequences"] == 640


def test_small_runs_do_not_replace_a_representative_rate():
    record_rate(model="tiny", backend="hf", max_new_tokens=64, sequences=640, seconds=12.8, device="cpu")
    record_rate(model="tiny", backend="hf", max_new_tokens=64, sequences=100, seconds=10.0, device="cpu")  # < 1/4
    record_rate(model="tiny", backend="hf", max_new_tokens=64, sequences=6400, seconds=0.1, device="cpu")  # < 0.2 s
    assert plan().endswith("at 50 seq/s measured here on tiny/hf")
    record_rate(model="tiny", backend="hf", max_new_tokens=64, sequences=200, seconds=10.0, device="cpu")
    assert plan().endswith("~5.3 min at 20 seq/s measured here on tiny/hf")


def test_identity_is_stable_across_copies_and_loads(tmp_path):
    from transformers import AutoConfig

    from deltalens.tiny import MODEL_DIR

    copy = tmp_path / "copy"
    shutil.copytree(MODEL_DIR, copy)

    class Loaded:  # what evaluate() sees: a model with its config
        config = AutoConfig.from_pretrained(MODEL_DIR)

    ident = model_identity("tiny")
    assert ident.startswith("arch-") and model_identity(str(copy)) == ident == model_identity(Loaded())
    weights = tmp_path / "w" / "model.safetensors"
    weights.parent.mkdir()
    shutil.copy(MODEL_DIR / "model.safetensors", weights)
    assert model_identity(str(weights), config="tiny") == ident  # bare weights: their architecture's
    assert model_identity("smollm2") == "smollm2"
    assert model_identity("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    # a rate measured on the loaded model serves the plan of a copy
    record_rate(model=Loaded(), backend="hf", max_new_tokens=64, sequences=640, seconds=12.8, device="cpu")
    assert plan(model=str(copy)).endswith("~2.1 min at 50 seq/s measured here on copy/hf")


def test_cache_failures_never_break_anything(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("DELTALENS_CACHE_DIR", str(blocker / "cache"))
    record_rate(model="tiny", backend="hf", max_new_tokens=64, sequences=640, seconds=12.8, device="cpu")
    assert plan().endswith(NO_RATE.format(where="tiny/hf")) and blocker.read_text() == "not a directory"
    monkeypatch.setenv("DELTALENS_CACHE_DIR", str(tmp_path / "c2"))
    rates_path().parent.mkdir()
    rates_path().write_text("{torn")
    assert plan().endswith(NO_RATE.format(where="tiny/hf"))  # an unreadable file is no measurement
    record_rate(model="tiny", backend="hf", max_new_tokens=64, sequences=640, seconds=12.8, device="cpu")
    assert plan().endswith("at 50 seq/s measured here on tiny/hf")
    assert [p.name for p in rates_path().parent.iterdir()] == ["rates.json"]  # no temporary left


def test_rates_are_keyed_by_the_dtype_generation_runs_in(monkeypatch):
    """A bf16 compute copy of fp32 weights generates at bf16's rate: the evaluation records it under bf16, and a
    plan line finds it for --compute-dtype bf16 (or auto, where auto resolves to bf16), not for fp32."""
    from deltalens.evaluation import cost, evaluate
    from deltalens.evaluation.cost import generation_dtype
    from deltalens.generation import dtype as cd
    from deltalens.io.models import load_model
    from deltalens.tasks import get_task

    monkeypatch.setattr(cost, "_MIN_SECONDS", 0.0)  # record however fast this small pass is
    model, tok = load_model("tiny")
    ev = evaluate(model, tok, get_task("arith"), samples=2, ks=[1], limit=40, compute_dtype="bf16",
                  model_spec="tiny")
    assert ev["compute_dtype"] == "bf16"
    rates = json.loads(rates_path().read_text())
    assert [k.split("|")[3] for k in rates] == ["bf16"]
    mnt = ev["max_new_tokens"]
    assert "in bf16" in plan(compute_dtype="bf16", max_new_tokens=mnt) and "~" in plan(compute_dtype="bf16",
                                                                                     max_new_tokens=mnt)
    assert plan(compute_dtype="fp32", max_new_tokens=mnt).endswith(NO_RATE.format(where="tiny/hf"))
    # auto on tiny: fp32 (its width is under MIN_BF16_HIDDEN), so the bf16 rate is not its rate
    monkeypatch.setattr(cd, "cpu_flags", lambda: frozenset({"amx_bf16"}))
    assert generation_dtype(model="tiny", compute_dtype="auto") == "fp32"
    # weights in bf16 generate in bf16 whatever the compute dtype says; vLLM keys by its own dtype
    assert generation_dtype(model="tiny", dtype="bf16", compute_dtype="fp32") == "bf16"
    assert generation_dtype(model="tiny", backend="vllm", dtype="fp16", compute_dtype="bf16") == "fp16"
