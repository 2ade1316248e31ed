"""The method registry (`deltalens.training.methods`, names in `deltalens.methods`): it lists es, grpo and
their chains with their config classes and budget units, and a third method registered in this file only
(a toy that moves every weight by a fixed step) trains through the launch path the CLI uses, resumes,
re-runs from its config.json, is a chain stage (3+ stages resume too), is sweepable, and is recognised by
`--trained-on` and analysis documents."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from support import tiny_spec

from deltalens import methods as names
from deltalens.analysis.document import model_entry
from deltalens.config import Config, option
from deltalens.errors import DeltalensError
from deltalens.io.models import load_model
from deltalens.io.runs import RunDir
from deltalens.study import sweep
from deltalens.training import launch, methods
from deltalens.training.chain import ChainConfig
from deltalens.training.es.config import ESConfig
from deltalens.training.grpo.config import GRPOConfig
from deltalens.training.run import make_task, open_run
from deltalens.training.trained import trained_problems

# ---------------------------------------------------------------------------------------------- es, grpo


def test_the_registry_lists_es_grpo_and_their_chains():
    assert names.names() == names.stage_names() == ("es", "grpo")
    assert names.chains() == ("es-grpo", "grpo-es")
    assert names.run_methods() == ("es", "grpo", "es-grpo", "grpo-es")
    assert names.chain_name(["es", "grpo", "es"]) == "es-grpo-es"
    assert names.chain_stages("grpo-es") == ("grpo", "es") and names.chain_stages("es-grpo-es") == ("es", "grpo", "es")
    for not_a_chain in ("es", "es-", "es-ppo", "chain", None, ["es", "grpo"]):
        assert names.chain_stages(not_a_chain) is None
    assert [names.is_run_method(m) for m in ("es", "grpo-es", "grpo-grpo", "ppo", "es-ppo", "", 3)] == \
        [True, True, True, False, False, False, False]
    assert [m.name for m in methods.registered()] == ["es", "grpo"]
    es, gr = methods.get("es"), methods.get("grpo")
    assert (es.config, es.count, es.start_from) == (ESConfig, "iterations", "model")
    assert (gr.config, gr.count, gr.start_from) == (GRPOConfig, "steps", "init_from")
    # a chain's stage options: one mapping, keyed by stage method (YAML: under the method's name)
    assert [f.name for f in dataclasses.fields(ChainConfig) if f.type == "dict"] == ["stage_options"]
    cfg = ChainConfig.resolve(yaml={"es": {"sigma": 0.01}}, given={"grpo": {"learning_rate": 1e-5}})
    assert cfg.stage_options == {"es": {"sigma": 0.01}, "grpo": {"learning_rate": 1e-5}}
    assert cfg.to_dict()["es"] == {"sigma": 0.01} and "stage_options" not in cfg.to_dict()
    with pytest.raises(DeltalensError, match="under its method's name"):
        ChainConfig.resolve(yaml={"stage_options": {"es": {}}})
    assert launch.commands() == ("es", "grpo", "chain")
    assert methods.find("es-grpo") is None and methods.find(["es"]) is None
    with pytest.raises(DeltalensError, match=r"unknown method 'ppo'; use one of es, grpo$"):
        methods.get("ppo")


def test_budget_units_and_counts_are_the_budget_modules():
    es = ESConfig(population=4, prompts_per_iteration=3)
    gr = GRPOConfig(prompts_per_step=2, num_generations=2)
    m_es, m_gr = methods.get("es"), methods.get("grpo")
    assert m_es.units(es, 2) == 2 * 3 * 2 * 4 and m_gr.units(gr, 3) == 3 * 2 * 8 * 2
    assert m_es.count_for_budget(es, 100) == 4 and m_gr.count_for_budget(gr, 100) == 3  # 24 and 32 units each
    assert m_es.total(dataclasses.replace(es, iterations=7)) == 7 and m_gr.total(dataclasses.replace(gr, steps=5)) == 5
    with pytest.raises(DeltalensError, match="below one ES iteration"):
        m_es.count_for_budget(es, 23)


def test_register_refuses_what_the_seam_cannot_hold():
    es = methods.get("es")
    with pytest.raises(DeltalensError, match="already registered"):
        methods.register(es)
    with pytest.raises(DeltalensError, match="METHOD = 'ppo'"):
        methods.register(dataclasses.replace(es, name="ppo"))  # ESConfig says "es"
    for bad in ("a-b", "chain", "resume", "Es", ""):
        with pytest.raises(DeltalensError, match="a method name is"):
            names.declare(bad)
    with pytest.raises(DeltalensError, match="built-in method and chain stage"):
        methods.unregister("es")
    assert names.names() == ("es", "grpo")


# ------------------------------------------------------------------------------------ a third method


@dataclass
class StepConfig(Config):
    """A toy method: every step adds `size` to every weight (nothing is learned)."""

    METHOD: ClassVar[str] = "step"
    NAME: ClassVar[str] = "step"
    COUNT: ClassVar[str] = "steps"
    PRESETS: ClassVar[dict[str, dict]] = {"paper": {}, "tiny": {}}

    model: str = option("tiny", "base model spec")
    task: str = option("arith", "task name")
    data: str | None = option(None, "jsonl data")
    question_field: str = option("question", "jsonl question field")
    answer_field: str = option("answer", "jsonl answer field")
    seed: int = option(0, "prompt seed")
    chat_template: str = option("auto", "chat template: auto, on, off")
    report_to: str = option("none", "trackers (none only)")
    steps: int = option(2, "steps")
    size: float = option(1e-3, "what each step adds to every weight", trajectory=True)
    prompts: int = option(2, "training problems drawn per step", trajectory=True)


def step_problems(task, config: StepConfig, n: int) -> list:
    return [p for s in range(1, n + 1) for p in task.train(config.prompts, random.Random(f"step/{config.seed}/{s}"))]


def train_step(config: StepConfig, out, resume=False, progress=None, *, overwrite=False) -> Path:
    run = RunDir(out)
    task = make_task(config)
    with run.writing():
        state = open_run(run, config, resume=resume, overwrite=overwrite, reopen_final=True)
        model, tok = load_model(str(run.latest()) if state else config.model)
        for step in range((state or {}).get("iteration", 0) + 1, config.steps + 1):
            step_problems(task, config, 1)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(config.size)
            row = {"iteration": step, "reward_mean": 0.0}
            run.log(row)
            if progress:
                progress(step, config.steps, row)
        run.save(model, tok, "final", {"method": "step", "iteration": config.steps})
    return Path(out)


@pytest.fixture
def toy():
    m = methods.register(methods.Method(
        "step", StepConfig, train_step, units=lambda c, n: n * c.prompts,
        count_for_budget=lambda c, b: int(b // c.prompts), problems=step_problems, summary="a toy"))
    yield m
    methods.unregister("step")
    assert "step" not in names.names() and methods.find("step") is None


def _weights(spec) -> dict:
    model, _ = load_model(str(spec))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_third_method_trains_resumes_and_reruns_through_the_launch_path(toy, tmp_path):
    assert names.names() == names.stage_names() == ("es", "grpo", "step")
    assert launch.commands() == ("es", "grpo", "step", "chain")
    spec = tiny_spec()
    out = tmp_path / "run"
    seen = []
    assert launch.start("step", out=out, given={"model": spec, "steps": 3, "size": 1e-3},
                        progress=lambda d, t, r: seen.append((d, t))) == out
    assert seen == [(1, 3), (2, 3), (3, 3)]
    conf = json.loads((out / "config.json").read_text())
    assert conf["method"] == "step" and conf["steps"] == 3 and conf["model"] == spec
    base, w3 = _weights(spec), _weights(out)
    assert all(torch.allclose(w3[k], base[k] + 3e-3, atol=1e-6) for k in base)  # three fixed steps

    # recognised where runs are looked up: the analysis document, --trained-on, resume
    assert model_entry("toy", out) == {"label": "toy", "path": str(out), "kind": "run", "method": "step"}
    task, problems = trained_problems(out)
    assert task.spec == "arith" and len(problems) == 3 * 2
    assert [p.prompt for p in problems] == [p.prompt for p in step_problems(task, StepConfig(), 3)]
    assert launch.resume_run(out, given={"steps": 5}) == out
    w5 = _weights(out)
    with pytest.raises(DeltalensError, match="is a step run; continue it with `deltalens train resume"):
        launch.start("es", resume=out)

    # its config.json is a valid --config: the same run again, bit-identical to the resumed one
    again = launch.start("step", out=tmp_path / "again", yaml_path=out / "config.json")
    assert json.loads((again / "config.json").read_text()) == json.loads((out / "config.json").read_text())
    assert all(torch.equal(w5[k], v) for k, v in _weights(again).items())
    with pytest.raises(DeltalensError, match="for method 'step'; use `deltalens train step` for it"):
        launch.start("es", out=tmp_path / "x", yaml_path=out / "config.json")
    assert not (tmp_path / "x").exists()

    # a chain holds only stage methods
    with pytest.raises(DeltalensError, match="unknown method in --methods es,ppo; use es, grpo, step$"):
        ChainConfig(methods=("es", "ppo"))


def test_a_third_method_is_a_chain_stage_and_a_chain_of_three_resumes(toy, tmp_path):
    spec, out = tiny_spec(), tmp_path / "chain"
    given = {"methods": ("step", "step", "step"), "model": spec, "step": {"steps": 2, "size": 1e-3}}

    class Killed(Exception):
        pass

    def kill_in_stage_3(done, total, row):
        if done == 5:  # the third stage's first step: logged, nothing saved yet
            raise Killed

    with pytest.raises(Killed):
        launch.start("chain", out=out, given=given, progress=kill_in_stage_3)
    conf = json.loads((out / "config.json").read_text())
    assert conf["method"] == "step-step-step" and [s["dir"] for s in conf["stages"]] == ["1-step", "2-step", "3-step"]
    assert conf["stages"][1]["config"]["model"] == str((out / "1-step").resolve())  # start_from: the previous run
    assert launch.resume_run(out) == out  # `deltalens train resume` takes a chain of three stages
    base, w = _weights(spec), _weights(out)
    assert all(torch.allclose(w[k], base[k] + 6e-3, atol=1e-6) for k in base)  # 3 stages x 2 fixed steps
    rows = RunDir(out).metrics()  # (the toy logs the killed step again when it resumes)
    assert [r["stage_index"] for r in rows][:4] == [0, 0, 1, 1] and rows[-1]["iteration"] == 6
    assert model_entry("c", out)["method"] == "step-step-step"
    assert len(trained_problems(out)[1]) == 3 * 2 * 2

    # its config.json is a valid --config: the same chain again
    again = launch.start("chain", out=tmp_path / "again", yaml_path=out / "config.json")
    assert all(torch.equal(w[k], v) for k, v in _weights(again).items())

    # a chain of a built-in method and the third one: ES's final weights are where the step stage starts
    mixed = launch.start("chain", out=tmp_path / "mixed", given={
        "methods": ("es", "step"), "model": spec, "task": "arith",
        "es": {"iterations": 1, "population": 2, "prompts_per_iteration": 2, "max_new_tokens": 8, "eval_every": 0},
        "step": {"steps": 1, "size": 1e-3}})
    es_w, end = _weights(mixed / "es"), _weights(mixed)
    assert all(torch.allclose(end[k], es_w[k] + 1e-3, atol=1e-6) for k in es_w)
    assert RunDir(mixed).method() == "es-step" and names.chain_stages("es-step") == ("es", "step")


def test_a_chain_copied_before_it_finished_resumes_from_its_own_earlier_stage(toy, tmp_path):
    spec, out, copy = tiny_spec(), tmp_path / "chain", tmp_path / "copy"
    given = {"methods": ("step", "step"), "model": spec, "step": {"steps": 2, "size": 1e-3}}

    class Killed(Exception):
        pass

    def kill_in_stage_2(done, total, row):
        if done == 3:  # the second stage's first step: its config.json written, nothing saved yet
            raise Killed

    with pytest.raises(Killed):
        launch.start("chain", out=out, given=given, progress=kill_in_stage_2)
    shutil.copytree(out, copy)
    # the original's first stage changes after the copy: a resumed copy must not start from it
    model, tok = load_model(str(out / "1-step"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    RunDir(out / "1-step").save(model, tok, "final", {"method": "step", "iteration": 2})
    stage_2 = copy / "2-step" / "config.json"
    assert json.loads(stage_2.read_text())["model"] == str((out / "1-step").resolve())

    assert launch.resume_run(copy) == copy
    assert json.loads(stage_2.read_text())["model"] == str((copy / "1-step").resolve())
    assert json.loads((copy / "config.json").read_text())["stages"][1]["config"]["model"] == str(
        (copy / "1-step").resolve())
    base, w = _weights(spec), _weights(copy)
    assert all(torch.allclose(w[k], base[k] + 4e-3, atol=1e-6) for k in base)  # 2 stages x 2 steps, its own


def test_a_third_method_is_sweepable(toy, tmp_path):
    assert sweep.parse_grid("step", ["size=1e-3,2e-3"]) == {"size": [1e-3, 2e-3]}
    with pytest.raises(DeltalensError, match="step has no option --sigma"):
        sweep.parse_grid("step", ["sigma=1"])
    out = tmp_path / "sw"
    doc = sweep.run_sweep("step", {"size": [0.0, 1e-3]}, {"model": tiny_spec(), "steps": 1}, out,
                          ev=sweep.Evaluation(limit=2, samples=1, temperature=0.0), log=lambda s: None)
    assert doc["method"] == "step" and sorted(p["name"] for p in doc["points"]) == ["size=0", "size=0.001"]
    assert RunDir(out / "runs" / "size=0.001-s0").method() == "step"
    # size 0 leaves the base's weights: its score is the base's (known answer)
    assert {p["name"]: p["pass_at_1"] for p in doc["points"]}["size=0"] == doc["base"]["pass_at_1"]
    with pytest.raises(DeltalensError, match="sweep trains one of es, grpo, step"):
        sweep.run_sweep("es-grpo", {"size": [0.0]}, {}, tmp_path / "no")
    assert not (tmp_path / "no").exists()
