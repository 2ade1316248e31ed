"""ES metrics rows record the members' mean completion length in tokens (FLOP accounting measures with it:
deltalens.study.flops), sequential and population-batched alike."""

from __future__ import annotations

import pytest
from support import tiny_spec

from deltalens.io.models import load_model
from deltalens.io.runs import RunDir
from deltalens.training.es.config import ESConfig
from deltalens.training.es.train import train_es

FAST = {"population": 4, "prompts_per_iteration": 4, "sigma": 0.01, "alpha": 0.005, "eval_every": 0,
        "max_new_tokens": 12, "antithetic": True}


@pytest.mark.parametrize("batch", [1, 4])
def test_rows_carry_the_mean_completion_length(tmp_path, batch):
    cfg = ESConfig(model=tiny_spec(), iterations=1, population_batch=batch, **FAST)
    out = train_es(cfg, tmp_path / "run")
    (row,) = RunDir(out).metrics()
    assert 1 <= row["completion_length"] <= 12  # tokens, within max_new_tokens
    assert "completion_tokens" not in row["timing"] and "completions" not in row["timing"]


def test_the_count_is_the_tokenizers(tmp_path):
    """mean_reward counts each completion's tokens as the tokenizer splits it (no special tokens)."""
    from deltalens.training.es.engine import ESEngine, new_timing
    from deltalens.training.run import make_task

    model, tok = load_model(tiny_spec())
    cfg = ESConfig(**FAST)
    eng = ESEngine(model, tok, make_task(cfg), cfg)
    timing = new_timing()
    problems = eng.task.test(2)
    eng.mean_reward(["12", "345"], problems, timing)
    want = sum(len(tok(c, add_special_tokens=False).input_ids) for c in ("12", "345"))
    assert (timing["completion_tokens"], timing["completions"]) == (want, 2)
