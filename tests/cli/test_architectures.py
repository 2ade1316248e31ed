"""The named models' architectures end to end, on small random stand-ins (issue #33): Gemma 3 (norms acting as
1 + w, a √hidden-scaled embedding, q/k norms, a sliding-window layer, tied) and Qwen2 (untied LM head, q/k/v
biases). Each trains ES with its members batched in bf16 with a shared prompt prefix (the `smollm2`/`qwen2.5`
presets' path) and GRPO for a step, then `diff` and `report` read the runs. Until 2026-12-07 ES's population
batching refused Gemma's norms, and had they been excluded it would have dropped the embedding's scale
without an error (tests/training/es/test_population.py checks the arithmetic; this checks the commands).
The real files are exercised by tests/io/test_named_models_real.py where they are assembled."""

from __future__ import annotations

import json

import pytest
from support import run_cli, small_gemma3, small_qwen2

from deltalens.schema import validate

ES = ["--task", "arith", "--iterations", "2", "--population", "4", "--prompts", "4", "--population-batch", "4",
      "--compute-dtype", "bf16", "--shared-prefix", "--eval-every", "0", "--max-new-tokens", "12", "--sigma", "0.05"]
GRPO = ["--task", "arith", "--steps", "1", "--prompts", "4", "--num-generations", "4", "--eval-every", "0",
        "--save-every", "0", "--max-new-tokens", "12"]


@pytest.fixture(scope="module", params=["gemma3", "qwen2"])
def arch(request, tmp_path_factory):
    model, tok = small_gemma3(sliding=True) if request.param == "gemma3" else small_qwen2()
    d = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(d / "base")
    tok.save_pretrained(d / "base")
    return request.param, d


def test_train_diff_and_report(arch):
    name, d = arch
    base = str(d / "base")
    r = run_cli(["train", "es", "--model", base, "--out", d / "es", *ES])
    assert r.exit_code == 0, r.output
    r = run_cli(["train", "grpo", "--model", base, "--out", d / "grpo", *GRPO])
    assert r.exit_code == 0, r.output
    cfg = json.loads((d / "es" / "config.json").read_text())
    assert cfg["population_batch"] == 4 and cfg["shared_prefix"] is True and cfg["compute_dtype"] == "bf16"
    r = run_cli(["diff", base, d / "es", d / "grpo", "--json", d / "diff.json"])
    assert r.exit_code == 0, r.output
    groups = json.loads((d / "diff.json").read_text())["diff"]["es"]
    if name == "qwen2":  # untied: the LM head is a group of its own, the q/k/v biases another
        assert {"embed", "lm_head", "attn_bias"} <= set(groups["groups"])
    else:  # tied, and the norms' two conventions reported
        assert "lm_head" not in groups["groups"] and "norm_convention" in groups
    r = run_cli(["report", base, d / "es", d / "grpo", "--task", "arith", "--limit", "2", "--samples", "2",
                 "--k", "1,2", "-o", d / "report"])
    assert r.exit_code == 0, r.output
    doc = json.loads((d / "report" / "analysis.json").read_text())
    validate(doc)
    assert [m["label"] for m in doc["models"]] == ["es", "grpo"]
    assert (d / "report" / "report.html").stat().st_size > 10_000
