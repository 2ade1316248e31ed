"""`deltalens probe`: the verdict on a model with reward signal (tiny on arith) and on one without (a random
model), and the CLI's JSON."""

from __future__ import annotations

import json

from support import run_cli, tiny_spec

from deltalens.analysis.probe import probe, verdict
from deltalens.schema import validate
from deltalens.tasks import get_task


def test_verdict_rule():
    assert verdict(0.5, 1.0) == "ES and GRPO have signal"
    assert verdict(0.0, 0.0) == "reward is constant: pick an easier task or another model"
    assert verdict(0.0, None).startswith("reward is constant")
    assert verdict(0.2, 0.0).startswith("GRPO has signal") and verdict(0.0, 0.5).startswith("ES has signal")
    assert verdict(0.2, None) == "GRPO has signal (ES not probed: --es-populations 0)"


def test_tiny_has_signal_and_a_random_model_has_none(rand_model_dir):
    res = probe(tiny_spec(), get_task("arith"), limit=8, samples=4, group=4, es_members=4, es_prompts=8,
                es_populations=1, es_preset="tiny")
    assert res["verdict"] == "ES and GRPO have signal"
    assert 0 < res["pass_at_k"]["1"] < 1 and res["format_rate"] > 0.5 and res["split"] == "validation"
    assert res["grpo"]["share_with_signal"] > 0 and res["es"]["share_with_signal"] == 1.0
    dead = probe(str(rand_model_dir), get_task("arith"), limit=4, samples=4, group=4, es_members=2, es_prompts=4,
                 es_populations=1, max_new_tokens=8)
    assert dead["mean_reward"] == 0 and dead["verdict"].startswith("reward is constant")


def test_cli_json(tmp_path):
    out = tmp_path / "p.json"
    r = run_cli(["probe", tiny_spec(), "--limit", "4", "--samples", "4", "--group", "2", "--es-populations", "0",
                 "--json", out])
    assert r.exit_code == 0, r.output
    assert "verdict:" in r.output
    doc = json.loads(out.read_text())
    validate(doc)
    assert doc["probe"]["model"]["task"] == "arith" and doc["probe"]["model"]["es"] is None
    r = run_cli(["probe", tiny_spec(), "--samples", "6", "--group", "4"])
    assert r.exit_code == 2 and "multiple of --group" in r.output


def test_preset_population_batch_is_capped_at_the_probe_population():
    """The smollm2 ES preset batches 16 members; the probe's populations are smaller (default 8) and must
    still run (before, `deltalens probe smollm2` stopped with "population_batch 16 exceeds the population 8";
    the probe now scores members one by one)."""
    res = probe(tiny_spec(), get_task("arith"), limit=2, samples=2, group=2, es_members=4, es_prompts=2,
                es_populations=1, es_preset="smollm2", max_new_tokens=8)
    assert res["es"]["members"] == 4 and len(res["es"]["rewards"][0]) == 4


def test_es_populations_score_members_one_by_one_in_the_probes_compute_dtype(monkeypatch):
    """The probe's ES populations go through `train es`'s local backend, one member at a time even where the
    preset batches them (smollm2: population-batched; a batch holds every member's KV cache), in the probe's
    compute dtype; with bf16 compute members are written into the bf16 copy, so the fp32 weights are never
    perturbed and no restore copy of them is taken."""
    from deltalens.training.es import population
    from deltalens.training.es.engine import ESEngine

    batched, engines = [], []
    monkeypatch.setattr("deltalens.training.es.backends.local.evaluate_batched",
                        lambda *a, **k: batched.append(a) or population.evaluate_batched(*a, **k))
    close = ESEngine.close
    monkeypatch.setattr(ESEngine, "close", lambda self: engines.append((self, self.es.base)) or close(self))
    res = probe(tiny_spec(), get_task("arith"), limit=2, samples=2, group=2, es_members=4, es_prompts=4,
                es_populations=2, es_preset="smollm2", max_new_tokens=8, compute_dtype="bf16")
    assert not batched and res["es"]["population_batch"] == 0 and res["es"]["compute_dtype"] == "bf16"
    assert [len(r) for r in res["es"]["rewards"]] == [4, 4]
    (_engine, base), = engines
    assert base is None  # no restore copy was ever taken
