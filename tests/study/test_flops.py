"""A study's measured FLOP accounting (issue #34 item 8): GRPO's reference forward pass and its actual
completion lengths, read from a run's config.json and metrics.jsonl; what is not recorded is named."""

from __future__ import annotations

import json

import pytest

from deltalens.study.flops import run_flops


def _run(tmp_path, name, config, rows):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def test_grpo_counts_its_reference_pass_and_completion_lengths(tmp_path):
    rows = [{"iteration": 0, "units": 0, "eval": {"pass_at_1": 0.1}},
            *({"iteration": i, "reward_mean": 0.5, "completion_length": length, "units": 8 * 4 * 2 * i}
              for i, length in ((1, 30.0), (2, 50.0)))]
    d = _run(tmp_path, "grpo", {"method": "grpo", "beta": 1e-3, "prompts_per_step": 2, "num_generations": 4}, rows)
    f = run_flops(d, "grpo")
    # 2 steps x 2 prompts x 4 generations = 16 responses: 8 units each charged, 2 each for the reference
    assert (f["nominal_units"], f["reference_units"], f["completion_tokens"]) == (128.0, 32.0, 40.0)
    assert f["token_units"] == pytest.approx(160 * 40) and f["missing"] == []
    d0 = _run(tmp_path, "grpo0", {"method": "grpo", "beta": 0.0, "prompts_per_step": 2, "num_generations": 4}, rows)
    assert run_flops(d0, "grpo")["reference_units"] == 0.0  # beta = 0: no reference model


def test_es_charges_its_units_and_names_the_missing_lengths(tmp_path):
    rows = [{"iteration": i, "reward_mean": 0.5, "rewards": [0.5] * 4} for i in (1, 2, 3)]
    d = _run(tmp_path, "es", {"method": "es", "prompts_per_iteration": 5, "population": 4}, rows)
    f = run_flops(d, "es")
    assert f["nominal_units"] == 3 * 5 * 2 * 4 and f["completion_tokens"] is None and f["token_units"] is None
    assert f["missing"] == ["completion lengths (ES metrics rows do not record them)"]
