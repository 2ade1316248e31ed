"""A run's own config.json is a valid `--config` and reproduces the run bit-identically (issue #31): ES (with
a budget, so budget and iterations are both stored), GRPO, and an ES->GRPO chain (with a budget split by
fractions) are trained, re-run from their config.json into a new --out, and must end with the same weights
checksum and write the same config.json. Also: older runs' config.json (every field stored), command-line
options above a run's config, and the refusals (another method's config, --preset, --resume)."""

from __future__ import annotations

import json

import pytest
from support import run_cli, tiny_spec

from deltalens.errors import DeltalensError
from deltalens.training.launch import make_config

ES_ARGS = ["--budget", "32", "--population", "4", "--prompts", "2", "--max-new-tokens", "48", "--eval-every", "0"]
GRPO_ARGS = ["--steps", "2", "--prompts", "2", "-G", "4", "--max-new-tokens", "48", "--eval-every", "0"]
# ES 2·N·P = 16 units per iteration, GRPO 8·G·P = 64 per step: 80 units at 0.2/0.8 = 1 iteration + 1 step
CHAIN_ARGS = ["--budget", "80", "--fractions", "0.2,0.8", "--es-population", "4", "--es-prompts", "2",
              "--es-max-new-tokens", "48", "--es-eval-every", "0", "--grpo-prompts", "2", "--grpo-num-generations",
              "4", "--grpo-max-new-tokens", "48", "--grpo-eval-every", "0"]


def checksum(run) -> str:
    from deltalens.io.models import load_model, weights_checksum

    return weights_checksum(load_model(str(run))[0])


def config(run) -> dict:
    return json.loads((run / "config.json").read_text())


def rewards(run) -> list[float]:
    return [json.loads(line)["reward_mean"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def train(*args) -> None:
    r = run_cli(["train", *args])
    assert r.exit_code == 0, r.output


@pytest.fixture(scope="module")
def base_checksum():
    return checksum(tiny_spec())


@pytest.mark.parametrize(("method", "args"), [("es", ES_ARGS), ("grpo", GRPO_ARGS)])
def test_a_run_config_reproduces_the_run(method, args, tmp_path, base_checksum):
    first, again = tmp_path / "first", tmp_path / "again"
    train(method, "--model", tiny_spec(), "--out", first, *args)
    stored = config(first)
    assert stored["method"] == method and "deltalens_version" in stored
    if method == "es":  # what the budget gave is stored beside it; unused options are not stored
        assert (stored["budget"], stored["iterations"]) == (32.0, 2)
        assert not {"workers", "threads_per_worker", "rank"} & set(stored)
    train(method, "--config", first / "config.json", "--out", again)
    assert checksum(again) == checksum(first) != base_checksum  # bit-identical, and training moved the weights
    state = json.loads((again / "state.json").read_text())
    assert state["checksum"] == json.loads((first / "state.json").read_text())["checksum"]
    assert config(again) == stored
    assert rewards(again) == rewards(first)


def test_a_chain_config_reproduces_the_chain(tmp_path, base_checksum):
    first, again = tmp_path / "first", tmp_path / "again"
    train("chain", "--model", tiny_spec(), "--out", first, *CHAIN_ARGS)
    stored = config(first)
    assert [s["config"].get("iterations", s["config"].get("steps")) for s in stored["stages"]] == [1, 1]
    train("chain", "--config", first / "config.json", "--out", again)
    assert checksum(again) == checksum(first) != base_checksum
    assert checksum(again / "es") == checksum(first / "es") != base_checksum
    text = (again / "config.json").read_text().replace(str((again / "es").resolve()), str((first / "es").resolve()))
    assert json.loads(text) == stored  # the same chain, pointed at its own first stage

    # a chain without a budget keeps its stages' counts; a new budget on the command line replaces them
    stored.update(budget=None, fractions=None)
    (tmp_path / "nobudget.json").write_text(json.dumps(stored))
    cfg, preset = make_config("chain", yaml_path=tmp_path / "nobudget.json")
    stages = cfg.stage_presets(preset)
    assert (stages["es"].iterations, stages["grpo"].steps, stages["es"].population, cfg.budget) == (1, 1, 4, None)
    cfg, preset = make_config("chain", yaml_path=tmp_path / "nobudget.json", given={"budget": 160.0})
    stages = cfg.stage_presets(preset)
    assert cfg.budget == 160.0 and stages["es"].population == 4 and "iterations" not in cfg.stage_options["es"]


def old_run_config(cls, **kw) -> dict:
    """config.json as deltalens wrote it before issue #31: every field, unused ones included."""
    return {**cls(**kw).to_dict(), "deltalens_version": "0.0.9"}


def test_older_run_configs_are_accepted(tmp_path):
    from deltalens.training.es.config import ESConfig
    from deltalens.training.grpo.config import GRPOConfig

    es = old_run_config(ESConfig, budget=6400, population=4, prompts_per_iteration=8, sigma=0.01)
    assert {"workers", "threads_per_worker", "rank", "budget", "iterations"} <= set(es)
    (tmp_path / "es.json").write_text(json.dumps(es))
    cfg, _ = make_config("es", yaml_path=tmp_path / "es.json")
    assert cfg == ESConfig(budget=6400, population=4, prompts_per_iteration=8, sigma=0.01)
    assert cfg.iterations == 100 and cfg.alpha == ESConfig().alpha  # no preset under a run's config
    gr = old_run_config(GRPOConfig, learning_rate=3e-5)  # warmup_steps, vllm_mode stored though unused
    gr["chat_template"] = True  # the oldest runs stored a boolean
    (tmp_path / "grpo.json").write_text(json.dumps(gr))
    cfg, _ = make_config("grpo", yaml_path=tmp_path / "grpo.json")
    assert cfg == GRPOConfig(learning_rate=3e-5, chat_template="on")


def test_the_command_line_overrides_a_run_config(tmp_path):
    from deltalens.training.es.config import ESConfig

    path = tmp_path / "config.json"
    path.write_text(json.dumps(old_run_config(ESConfig, budget=6400, population=4, prompts_per_iteration=8)))
    cfg, _ = make_config("es", yaml_path=path, given={"iterations": 3})  # an explicit count replaces the budget
    assert (cfg.iterations, cfg.budget, cfg.population) == (3, None, 4)
    cfg, _ = make_config("es", yaml_path=path, given={"budget": 640})  # a new budget decides the count again
    assert (cfg.iterations, cfg.budget) == (10, 640.0)
    cfg, _ = make_config("es", yaml_path=path, given={"backend": "ray", "workers": 3})
    assert (cfg.backend, cfg.workers) == ("ray", 3)
    with pytest.raises(DeltalensError, match="--workers is only used when --backend is ray"):
        make_config("es", yaml_path=path, given={"workers": 3})


def write_run_configs(tmp_path) -> dict:
    from deltalens.training.chain import ChainConfig
    from deltalens.training.es.config import ESConfig
    from deltalens.training.grpo.config import GRPOConfig

    paths = {}
    for name, d in [("es", old_run_config(ESConfig)), ("grpo", old_run_config(GRPOConfig)),
                    ("bad-workers", old_run_config(ESConfig, workers=4)),
                    ("chain", {**ChainConfig().to_dict(), "method": "es-grpo", "deltalens_version": "0.1.0",
                               "stages": [{"method": "es", "dir": "es", "config": ESConfig().to_dict()},
                                          {"method": "grpo", "dir": "grpo", "config": GRPOConfig().to_dict()}]}),
                    ("chain-mixed", {**ChainConfig().to_dict(), "method": "es-grpo", "deltalens_version": "0.1.0",
                                     "stages": [{"method": "grpo", "dir": "grpo", "config": GRPOConfig().to_dict()}]})]:
        d.pop("es", None), d.pop("grpo", None)
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(d))
    return paths


@pytest.mark.parametrize(("args", "message"), [
    (["grpo", "--config", "es"], "for method 'es'; use `deltalens train es` for it"),
    (["chain", "--config", "grpo"], "for method 'grpo'; use `deltalens train grpo` for it"),
    (["es", "--config", "chain"], "for method 'es-grpo'; use `deltalens train chain` for it"),
    (["es", "--config", "es", "--preset", "tiny"], "--preset does not apply to"),
    (["es", "--config", "bad-workers"], "workers is 4, but it is only used when backend is ray"),
    (["chain", "--config", "chain-mixed"], "its method, methods and stages disagree"),
])
def test_run_config_refusals_are_one_line_and_write_nothing(args, message, tmp_path):
    paths = write_run_configs(tmp_path)
    out = tmp_path / "run"
    words = [str(paths[w]) if w in paths and args[i - 1] == "--config" else w for i, w in enumerate(args)]
    r = run_cli(["train", *words, "--out", out])
    assert r.exit_code == 2 and message in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and not out.exists()


def test_resume_refuses_a_run_config(tmp_path):
    paths = write_run_configs(tmp_path)
    run = tmp_path / "es-run"
    run.mkdir()
    (run / "config.json").write_text(paths["es"].read_text())
    (run / "metrics.jsonl").write_text("")
    r = run_cli(["train", "es", "--resume", run, "--config", paths["es"]])
    assert r.exit_code == 2 and "drop --config" in r.output, r.output
