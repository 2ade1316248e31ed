"""`deltalens train`: every option of every method reaches its config field (table-driven), unused options
and unknown YAML keys are refused with exit 2 before anything is written, --budget sets iterations/steps,
and the old `--method` form still works."""

from __future__ import annotations

import dataclasses
import json

import pytest
from support import run_cli

from deltalens.config import flag_name
from deltalens.training import chain as chain_mod
from deltalens.training import launch, methods
from deltalens.training.chain import ChainConfig, stage_configs
from deltalens.training.es.config import ESConfig
from deltalens.training.grpo.config import GRPOConfig

# field -> (command-line words, expected value). Every CLI field of each config must be here.
ES_TABLE = {
    "model": (["--model", "some/dir"], "some/dir"),
    "task": (["--task", "countdown"], "countdown"),
    "data": (["--data", "x.jsonl"], "x.jsonl"),
    "question_field": (["--question-field", "q"], "q"),
    "answer_field": (["--answer-field", "a"], "a"),
    "population": (["--population", "6"], 6),
    "sigma": (["--sigma", "0.01"], 0.01),
    "alpha": (["--alpha", "0.002"], 0.002),
    "prompts_per_iteration": (["--prompts", "5"], 5),
    "temperature": (["--temperature", "0.5"], 0.5),
    "max_new_tokens": (["--max-new-tokens", "12"], 12),
    "chat_template": (["--chat-template", "off"], "off"),
    "antithetic": (["--antithetic", "--population", "6"], True),
    "fitness": (["--fitness", "centered_rank"], "centered_rank"),
    "params": (["--params", "*.mlp.*,!*.bias"], ("*.mlp.*", "!*.bias")),
    "dtype": (["--dtype", "bf16"], "bf16"),
    "compute_dtype": (["--compute-dtype", "bf16"], "bf16"),  # members generate in bf16 (fp32 weights)
    "restore": (["--restore", "subtract"], "subtract"),
    "arithmetic": (["--arithmetic", "reference", "--restore", "subtract"], "reference"),
    "iterations": (["--iterations", "7"], 7),
    "budget": (["--budget", "1.5M"], 1.5e6),
    "eval_every": (["--eval-every", "3"], 3),
    "eval_limit": (["--eval-limit", "9"], 9),
    "checkpoint_every": (["--checkpoint-every", "4"], 4),
    "keep_checkpoints": (["--no-keep-checkpoints"], False),
    "seed": (["--seed", "11"], 11),
    "backend": (["--backend", "ray"], "ray"),
    "noise_threads": (["--noise-threads", "2"], 2),
    "workers": (["--workers", "3", "--backend", "ray"], 3),
    "threads_per_worker": (["--threads-per-worker", "2", "--backend", "ray"], 2),
    "save_pt": (["--save-pt"], True),
    "noise": (["--noise", "lowrank"], "lowrank"),
    "rank": (["--rank", "4", "--noise", "lowrank"], 4),
    "population_batch": (["--population-batch", "8"], 8),
    "shared_prefix": (["--no-shared-prefix", "--population-batch", "8"], False),
    "device": (["--device", "auto"], "auto"),
    "report_to": (["--report-to", "tensorboard"], "tensorboard"),
}
GRPO_TABLE = {
    "model": (["--model", "some/dir"], "some/dir"),
    "init_from": (["--init-from", "runs/es"], "runs/es"),
    "task": (["-t", "countdown"], "countdown"),
    "data": (["--data", "x.jsonl"], "x.jsonl"),
    "question_field": (["--question-field", "q"], "q"),
    "answer_field": (["--answer-field", "a"], "a"),
    "num_generations": (["-G", "4"], 4),
    "prompts_per_step": (["--prompts", "16"], 16),
    "learning_rate": (["--lr", "3e-5"], 3e-5),
    "lr_scheduler": (["--lr-scheduler", "cosine"], "cosine"),
    "warmup_steps": (["--warmup-steps", "2", "--lr-scheduler", "linear"], 2),
    "beta": (["--beta", "0"], 0.0),
    "epsilon": (["--epsilon", "0.3"], 0.3),
    "epsilon_high": (["--epsilon-high", "0.28"], 0.28),
    "loss_type": (["--loss-type", "dapo"], "dapo"),
    "scale_rewards": (["--scale-rewards", "none"], "none"),
    "num_iterations": (["--num-iterations", "2", "--steps", "4", "--save-every", "2"], 2),
    "temperature": (["--temperature", "0.7"], 0.7),
    "top_p": (["--top-p", "0.9"], 0.9),
    "max_new_tokens": (["--max-new-tokens", "20"], 20),
    "micro_batch_size": (["--micro-batch", "8"], 8),
    "max_micro_batch": (["--max-micro-batch", "4"], 4),
    "max_grad_norm": (["--max-grad-norm", "0.5"], 0.5),
    "weight_decay": (["--weight-decay", "0.01"], 0.01),
    "dtype": (["--dtype", "bf16"], "bf16"),
    "autocast": (["--autocast", "bf16"], "bf16"),
    "compute_dtype": (["--compute-dtype", "bf16"], "bf16"),
    "gradient_checkpointing": (["--gradient-checkpointing"], True),
    "chat_template": (["--chat-template", "on"], "on"),
    "steps": (["--steps", "9"], 9),
    "budget": (["--budget", "1e6"], 1e6),
    "eval_every": (["--eval-every", "5"], 5),
    "eval_limit": (["--eval-limit", "7"], 7),
    "save_every": (["--checkpoint-every", "5"], 5),
    "seed": (["--seed", "3"], 3),
    "keep_optimizer_states": (["--keep-optimizer-states"], True),
    "keep_checkpoints": (["--no-keep-checkpoints"], False),
    "save_pt": (["--save-pt"], True),
    "device": (["--device", "cuda"], "cuda"),
    "use_vllm": (["--use-vllm", "--device", "cuda"], True),
    "vllm_mode": (["--vllm-mode", "server", "--use-vllm", "--device", "cuda"], "server"),
    "report_to": (["--report-to", "wandb,tensorboard"], "wandb,tensorboard"),
}
CHAIN_TABLE = {
    "methods": (["--methods", "grpo,es"], ("grpo", "es")),
    "model": (["--model", "some/dir"], "some/dir"),
    "task": (["--task", "countdown"], "countdown"),
    "data": (["--data", "x.jsonl"], "x.jsonl"),
    "question_field": (["--question-field", "q"], "q"),
    "answer_field": (["--answer-field", "a"], "a"),
    "budget": (["--budget", "2e5"], 2e5),
    "fractions": (["--fractions", "0.25,0.75", "--budget", "2e5"], (0.25, 0.75)),
    "report_to": (["--report-to", "tensorboard"], "tensorboard"),  # handed to every stage
}


def cli_fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.metadata.get("cli", True)}


@pytest.fixture
def captured(monkeypatch, tmp_path):
    """Replace the trainers by recorders: the configs a command would train with, nothing trained."""
    seen = {}

    def es(config, out, **kw):
        seen["config"] = config
        return out

    def chain(out, methods, **kw):
        seen.update(kw, methods=methods)
        seen.update({f"{m}_config": c for m, c in kw["configs"].items()})  # es_config, grpo_config
        return out

    for name in ("es", "grpo"):
        monkeypatch.setitem(methods.REGISTRY, name, dataclasses.replace(methods.get(name), train=es))
    monkeypatch.setattr(chain_mod, "train_chain", chain)
    # the chain's up-front model check loads the model: these tests only route options (e.g. --model some/dir)
    monkeypatch.setattr(launch, "_check_chain_start", lambda config, preset: None)
    return seen


def test_tables_cover_every_option():
    assert set(ES_TABLE) == cli_fields(ESConfig)
    assert set(GRPO_TABLE) == cli_fields(GRPOConfig)
    assert set(CHAIN_TABLE) == cli_fields(ChainConfig)


@pytest.mark.parametrize(("method", "field"), [("es", f) for f in ES_TABLE] + [("grpo", f) for f in GRPO_TABLE])
def test_each_option_reaches_its_field(method, field, captured, tmp_path):
    words, want = (ES_TABLE if method == "es" else GRPO_TABLE)[field]
    r = run_cli(["train", method, "--out", tmp_path / "run", *words])
    assert r.exit_code == 0, r.output
    assert getattr(captured["config"], field) == want


@pytest.mark.parametrize("field", list(CHAIN_TABLE))
def test_each_chain_option_reaches_its_field(field, captured, tmp_path):
    words, want = CHAIN_TABLE[field]
    r = run_cli(["train", "chain", "--out", tmp_path / "run", *words])
    assert r.exit_code == 0, r.output
    got = {"methods": tuple(captured["methods"]), "fractions": captured.get("fractions"),
           "report_to": " and ".join(dict.fromkeys(captured[f"{m}_config"].report_to for m in ("es", "grpo")))
           }.get(field, captured.get(field))
    assert got == want


STAGE_EXCLUDED = {"model", "task", "data", "question_field", "answer_field", "init_from", "budget", "report_to"}


@pytest.mark.parametrize(("method", "field"),
                         [("es", f) for f in ES_TABLE if f not in STAGE_EXCLUDED]
                         + [("grpo", f) for f in GRPO_TABLE if f not in STAGE_EXCLUDED])
def test_each_stage_option_reaches_its_stage(method, field, captured, tmp_path):
    words, want = (ES_TABLE if method == "es" else GRPO_TABLE)[field]
    # stage flags are --es-<field> / --grpo-<field> (no short aliases); the extra words name fields too
    cls = ESConfig if method == "es" else GRPOConfig
    aliases = {flag: f.name for f in dataclasses.fields(cls) for flag in (flag_name(f.name), *f.metadata["flags"])}

    def stage(w):  # --no-<field> of a switch -> --no-<method>-<field>
        if w.startswith("--no-") and "--" + w[5:] in aliases:
            return "--no-" + flag_name(aliases["--" + w[5:]], f"{method}_")[2:]
        return flag_name(aliases[w], f"{method}_") if w in aliases else (
            "--" + method + "-" + w[2:] if w.startswith("--") else w)

    stage_words = [stage(w) for w in words]
    r = run_cli(["train", "chain", "--out", tmp_path / "run", *stage_words])
    assert r.exit_code == 0, r.output
    assert getattr(captured[f"{method}_config"], field) == want


@pytest.mark.parametrize(("args", "message"), [
    (["train", "grpo", "--sigma", "0.1"], "No such option: --sigma"),
    (["train", "es", "--lr", "1e-5"], "No such option: --lr"),
    (["train", "es", "--workers", "3"], "--workers is only used when --backend is ray"),
    (["train", "es", "--rank", "2"], "needs --noise lowrank"),
    (["train", "grpo", "--vllm-mode", "server"], "--vllm-mode is only used when --use-vllm is True"),
    (["train", "grpo", "--warmup-steps", "3"], "--warmup-steps is only used when --lr-scheduler is"),
    (["train", "chain", "--fractions", "0.5,0.5"], "--fractions is only used when --budget is set"),
    (["train", "chain", "--es-model", "x"], "No such option: --es-model"),
    (["train", "chain", "--methods", "es", "--grpo-lr", "1e-5"], "GRPO stage options given"),
    (["train", "es", "--budget", "1e6", "--iterations", "3"], "either --budget or --iterations"),
    (["train", "grpo", "--budget", "1e6", "--steps", "3"], "either --budget or --steps"),
    (["train", "chain", "--budget", "1e6", "--es-iterations", "3"], "either --budget or --es-iterations"),
    (["train", "es", "--population", "abc"], "population"),
    (["train", "es", "--preset", "nope"], "unknown ES preset 'nope'"),
])
def test_refusals_are_one_line_and_write_nothing(args, message, tmp_path):
    out = tmp_path / "run"
    r = run_cli([*args, "--out", out])
    assert r.exit_code == 2, r.output
    assert message.lower() in r.output.lower(), r.output
    assert len(r.output.strip().splitlines()) == 1, r.output
    assert not out.exists()


def test_yaml_supplies_values_and_flags_override(captured, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("sigma: 0.004\npopulation: 6\nparams: ['*.mlp.*']\npreset: paper\n")
    r = run_cli(["train", "es", "--config", cfg, "--population", "8", "--out", tmp_path / "run"])
    assert r.exit_code == 0, r.output
    c = captured["config"]
    assert (c.sigma, c.population, c.params, c.alpha) == (0.004, 8, ("*.mlp.*",), ESConfig().alpha)  # paper preset


@pytest.mark.parametrize(("text", "message"), [
    ("sigmaa: 0.1\n", "unknown ES option(s) 'sigmaa'"),
    ("population: many\n", "population must be an integer"),
    ("antithetic: 1\n", "antithetic must be true or false"),
    ("- 1\n- 2\n", "must be a mapping"),
    ("method: grpo\n", "is a 'grpo' config"),
    ("workers: 4\n", "--workers is only used when --backend is ray"),
    ("a: [\n", "not valid YAML"),
])
def test_bad_yaml_is_refused_before_anything_is_written(text, message, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(text)
    out = tmp_path / "run"
    r = run_cli(["train", "es", "--config", cfg, "--out", out])
    assert r.exit_code == 2 and message in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and not out.exists()


def test_chain_yaml_with_stage_options(captured, tmp_path):
    cfg = tmp_path / "chain.yaml"
    cfg.write_text("methods: [es, grpo]\nbudget: 1e5\nes: {sigma: 0.005, population: 8}\ngrpo: {learning_rate: 2e-5}\n")
    r = run_cli(["train", "chain", "--config", cfg, "--grpo-lr", "3e-5", "--out", tmp_path / "run"])
    assert r.exit_code == 0, r.output
    es, gr = captured["es_config"], captured["grpo_config"]
    assert (es.sigma, es.population, gr.learning_rate, captured["budget"]) == (0.005, 8, 3e-5, 1e5)
    cfg.write_text("es: {model: other}\n")
    r = run_cli(["train", "chain", "--config", cfg, "--out", tmp_path / "run2"])
    assert r.exit_code == 2 and "sets model of its es stage itself" in r.output


def test_budget_sets_es_iterations_and_grpo_steps(captured, tmp_path):
    # ES: 2·N·P units per iteration; N=4, P=4 -> 32 units; 1000 units -> 31 iterations
    r = run_cli(["train", "es", "--budget", "1000", "--population", "4", "--prompts", "4", "--out", tmp_path / "a"])
    assert r.exit_code == 0, r.output
    assert (captured["config"].iterations, captured["config"].budget) == (1000 // 32, 1000.0)
    # the tiny preset's 200 GRPO steps give way to the budget: 8·G·P = 8·8·8 = 512 units per step
    r = run_cli(["train", "grpo", "--budget", "1e4", "--out", tmp_path / "b"])
    assert r.exit_code == 0, r.output
    assert captured["config"].steps == 10_000 // 512 and captured["config"].learning_rate == 5e-5
    # a chain splits its budget (equal shares by default): ES 2·32·64 = 4096 per iteration, GRPO 512 per step
    r = run_cli(["train", "chain", "--budget", "1e5", "--out", tmp_path / "c"])
    assert r.exit_code == 0, r.output
    cfgs = stage_configs(tmp_path / "c", captured["methods"], "tiny", "arith",
                         {"es": captured["es_config"], "grpo": captured["grpo_config"]}, {}, captured["budget"])
    assert (cfgs[0].iterations, cfgs[1].steps) == (50_000 // 4096, 50_000 // 512)


def test_presets_follow_the_model(captured, tmp_path):
    assert run_cli(["train", "es", "--out", tmp_path / "a"]).exit_code == 0
    assert captured["config"].sigma == ESConfig.preset("tiny").sigma  # auto -> tiny for the tiny model
    assert run_cli(["train", "es", "--model", "some/dir", "--out", tmp_path / "b"]).exit_code == 0
    assert captured["config"].sigma == ESConfig().sigma  # the paper's for other models
    assert run_cli(["train", "es", "--preset", "tiny", "--model", "x", "--out", tmp_path / "c"]).exit_code == 0
    assert captured["config"].sigma == ESConfig.preset("tiny").sigma


@pytest.mark.parametrize(("old", "new_method"), [
    (["--method", "es", "--sigma", "0.02"], "es"),
    (["--method", "grpo", "--lr", "1e-5"], "grpo"),
    (["-m", "grpo-es", "--grpo-lr", "1e-5"], "chain"),
    (["--sigma", "0.02"], "es"),  # --method defaulted to es
])
def test_method_alias(old, new_method, captured, tmp_path):
    r = run_cli(["train", *old, "--out", tmp_path / "x"])
    assert r.exit_code == 0, r.output
    if new_method == "chain":
        assert tuple(captured["methods"]) == ("grpo", "es") and captured["grpo_config"].learning_rate == 1e-5
    else:
        assert captured["config"].METHOD == new_method


def test_resume_reads_the_method_from_the_run(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setitem(methods.REGISTRY, "grpo", dataclasses.replace(
        methods.get("grpo"), train=lambda config, out, resume=False, **kw: seen.update(config=config, resume=resume)
        or out))
    run = tmp_path / "g"
    run.mkdir()
    cfg = {**GRPOConfig.preset("tiny").to_dict(), "deltalens_version": "x"}
    (run / "config.json").write_text(json.dumps(cfg))
    (run / "metrics.jsonl").write_text("")
    r = run_cli(["train", "--resume", run])  # the old bare form: the method comes from the run
    assert r.exit_code == 0, r.output
    assert seen["resume"] and seen["config"].steps == 200
    r = run_cli(["train", "resume", run, "--steps", "300"])
    assert r.exit_code == 0 and seen["config"].steps == 300
    r = run_cli(["train", "resume", run, "--iterations", "3"])
    assert r.exit_code == 2 and "unknown GRPO option(s) 'iterations'" in r.output
    r = run_cli(["train", "es", "--resume", run])
    assert r.exit_code == 2 and "is a grpo run" in r.output
