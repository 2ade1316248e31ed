"""diff, sparsify, diversity and the study resolve each model spec once into a `ModelRef` at their entry point
(`deltalens.io.tensors.references`, `Measures.ref`) and pass the reference down, as the report does
(tests/analysis/test_report.py): counted at `deltalens.io.spec._classify`, where a spec is classified."""

from __future__ import annotations

import json

import pytest
import torch
from support import run_cli, tiny_spec

import deltalens.io.spec as spec_mod
from deltalens.analysis.delta import diff_analysis
from deltalens.analysis.diversity import diversity_analysis
from deltalens.analysis.sparsify import sparsify_analysis
from deltalens.io.atomic import save_state_dict
from deltalens.io.models import load_model


@pytest.fixture
def calls(monkeypatch):
    seen: list[str] = []
    classify = spec_mod._classify

    def counted(spec, fetch):
        seen.append(spec)
        return classify(spec, fetch)

    monkeypatch.setattr(spec_mod, "_classify", counted)
    return seen


@pytest.fixture
def bare_finetune(tmp_path):
    """A bare safetensors fine-tune of tiny (its architecture only through --arch)."""
    model, _ = load_model(tiny_spec())
    g = torch.Generator().manual_seed(0)
    sd = {k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
    return save_state_dict(sd, tmp_path / "ft.safetensors")


def test_diff_resolves_each_spec_and_the_arch_once(bare_finetune, calls):
    doc = diff_analysis("tiny", [str(bare_finetune)], ["ft"], arch="tiny", progress=False)
    assert doc["diff"]["ft"]["whole"]["rel_l2"] > 0 and doc["models"][0]["kind"] == "checkpoint"
    assert calls.count("tiny") == 2 and calls.count(str(bare_finetune)) == 1, calls  # the base, and --arch


def test_a_weights_directory_without_config_is_still_diffed(tmp_path, bare_finetune):
    d = tmp_path / "weights"
    d.mkdir()
    bare_finetune.rename(d / "model.safetensors")  # no config.json: no model spec, but open_tensors reads it
    doc = diff_analysis("tiny", [str(d)], ["w"], progress=False)
    assert doc["diff"]["w"]["whole"]["rel_l2"] > 0 and doc["models"][0]["path"] == str(d)


def test_sparsify_resolves_the_base_and_checkpoint_once(bare_finetune, calls):
    doc = sparsify_analysis("tiny", str(bare_finetune), [1e-3], lambda sd: {"pass_at_k": {"1": 0.5}}, task="arith")
    assert doc["sparsify"]["ft"]["points"] and doc["models"][0]["path"] == str(bare_finetune)
    assert calls.count("tiny") == 1 and calls.count(str(bare_finetune)) == 1, calls


def test_the_sparsify_command_resolves_the_bare_base_once(tmp_path, bare_finetune, calls):
    model, _ = load_model(tiny_spec())
    base = save_state_dict(model.state_dict(), tmp_path / "base.safetensors")  # bare: its architecture is --arch
    calls.clear()
    r = run_cli(["sparsify", str(bare_finetune), "--base", str(base), "--arch", "tiny", "--thresholds", "1e-3",
                 "--sparsity", "", "--limit", "2", "--samples", "1", "--k", "1", "--json", tmp_path / "s.json"])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "s.json").read_text())["base"]["path"] == str(base)
    # the base once (the guard, its architecture and the sweep take the reference); the checkpoint by the
    # guard (a spec string, as on the report's path) and once in the sweep
    assert calls.count(str(base)) == 1 and calls.count(str(bare_finetune)) == 2, calls


def test_diversity_resolves_the_model_once(calls, rand_model_dir):
    doc = diversity_analysis(str(rand_model_dir), "arith", members=2, sigma=0.0, prompts=1, samples=1,
                             max_new_tokens=4)
    assert doc["models"][0]["path"] == str(rand_model_dir) and doc["base"]["path"] == str(rand_model_dir)
    assert calls.count(str(rand_model_dir)) == 1, calls


def test_a_studys_measures_resolve_each_spec_once(calls, tmp_path):
    from deltalens.study.config import StudyConfig
    from deltalens.study.measures import Measures

    m = Measures(StudyConfig(model=tiny_spec(), task="arith"), tmp_path, log=lambda s: None)
    h = m.hash(tiny_spec())
    m.model(tiny_spec())
    assert m.hash(tiny_spec()) == h and calls.count(tiny_spec()) == 1, calls
