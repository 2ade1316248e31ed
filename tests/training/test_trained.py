"""`deltalens eval --trained-on RUN`: the problems regenerated from a run's config are exactly those its trainer
drew (ES iterations, GRPO steps, a chain's stages in order), and the CLI scores them."""

from __future__ import annotations

import json

import pytest
from support import run_cli, tiny_spec

from deltalens.tasks.arith import ArithTask
from deltalens.training.chain import train_chain
from deltalens.training.es.config import ESConfig
from deltalens.training.grpo.config import GRPOConfig
from deltalens.training.trained import trained_problems


def test_trained_problems_are_the_ones_the_trainers_drew(tmp_path, monkeypatch):
    drawn = []
    real = ArithTask.train

    def spy(self, n, rng):
        out = real(self, n, rng)
        drawn.append(out)
        return out

    monkeypatch.setattr(ArithTask, "train", spy)
    es = ESConfig(population=4, prompts_per_iteration=3, sigma=0.01, alpha=0.005, eval_every=0, checkpoint_every=0,
                  max_new_tokens=16)
    gr = GRPOConfig(model=tiny_spec(), prompts_per_step=2, num_generations=2, learning_rate=1e-10, eval_every=0,
                    save_every=0, max_new_tokens=16)
    out = tmp_path / "chain"
    # 24 units per ES iteration (3 prompts x 2 x 4 members), 8 per GRPO step (2 prompts x 2 x G 2)
    train_chain(out, ["es", "grpo"], model=tiny_spec(), task="arith", budget=4 * 24, es_config=es,
                grpo_config=gr)
    used = [p.prompt for batch in drawn if len(batch) > 1 for p in batch]  # n = 1: make_task's data check
    task, problems = trained_problems(out)
    its = json.loads((out / "es" / "config.json").read_text())["iterations"]
    steps = json.loads((out / "grpo" / "config.json").read_text())["steps"]
    assert task.spec == "arith" and its >= 1 and steps >= 1 and len(problems) == its * 3 + steps * 2
    assert [p.prompt for p in problems] == used
    assert [p.prompt for p in trained_problems(out / "es")[1]] == used[:its * 3]

    r = run_cli(["eval", tiny_spec(), str(out), "--trained-on", str(out), "--samples", "1", "--temperature", "0",
                 "--k", "1", "--json", tmp_path / "e.json"])
    assert r.exit_code == 0, r.output
    assert "the prompts" in r.output and "Pass@1" in r.output
    doc = json.loads((tmp_path / "e.json").read_text())
    for ev in doc["evals"].values():
        assert ev["split"] == "trained" and [p["prompt"] for p in ev["per_problem"]] == used


@pytest.mark.parametrize(("args", "msg"), [
    (["--split", "test"], "--trained-on replaces --split"),
    (["--task", "countdown"], "differs from the task"),
])
def test_trained_on_refuses_conflicting_options(tmp_path, args, msg):
    run = tmp_path / "es"
    r = run_cli(["train", "es", "--model", tiny_spec(), "--iterations", "1", "--population", "2",
                 "--prompts-per-iteration", "2", "--eval-every", "0", "--out", run])
    assert r.exit_code == 0, r.output
    r = run_cli(["eval", tiny_spec(), "--trained-on", run, *args])
    assert r.exit_code == 2 and msg in r.output


def test_trained_on_a_directory_that_is_no_run(tmp_path):
    r = run_cli(["eval", tiny_spec(), "--trained-on", tmp_path])
    assert r.exit_code == 2 and "not a run directory (no config.json)" in r.output
