"""GRPO through TRL: config, TRL arguments, run format, init_from, exact resume, ES->GRPO sequences."""

from __future__ import annotations

import json

import pytest
import torch

from deltalens.errors import DeltalensError

pytest.importorskip("trl")
pytest.importorskip("datasets")

from support import max_weight_diff, tiny_spec

from deltalens.training.grpo.config import GRPOConfig
from deltalens.training.grpo.train import (
    build_dataset,
    load_trainer_state,
    step_problems,
    train_grpo,
    trl_args,
)


def fast(**kw) -> GRPOConfig:
    """~0.5 s/step on one core: 4 prompts x 4 completions, short completions, no evaluation."""
    base = {"model": tiny_spec(), "prompts_per_step": 4, "num_generations": 4, "learning_rate": 1e-3,
            "steps": 2, "eval_every": 0, "eval_limit": 4, "save_every": 1, "max_new_tokens": 48}
    return GRPOConfig(**{**base, **kw})


def _weights(spec) -> dict[str, torch.Tensor]:
    from deltalens.io.models import load_model

    model, _ = load_model(str(spec))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------------------------- config


def test_paper_defaults_are_set_explicitly_in_trl_args(tmp_path):
    cfg = GRPOConfig()
    assert (cfg.num_generations, cfg.loss_type, cfg.epsilon, cfg.beta, cfg.temperature, cfg.prompts_per_step,
            cfg.learning_rate) == (8, "grpo", 0.2, 0.001, 1.0, 64, 1e-6)
    a = trl_args(cfg, tmp_path, world_size=1)
    # TRL's own defaults differ (dapo, beta 0, linear LR, bf16 autocast, gradient checkpointing, shuffling)
    assert a.loss_type == "grpo" and a.beta == 0.001 and a.epsilon == 0.2 and a.temperature == 1.0
    assert a.num_generations == 8 and a.generation_batch_size == 64 * 8  # one generation = one step
    assert a.per_device_train_batch_size * a.gradient_accumulation_steps == 512
    assert a.steps_per_generation == a.gradient_accumulation_steps
    assert a.learning_rate == 1e-6 and a.lr_scheduler_type == "constant"
    assert not a.bf16 and not a.fp16 and not a.gradient_checkpointing
    assert a.shuffle_dataset is False and a.use_cpu and a.report_to in ([], "none", ["none"])
    assert a.save_strategy == "no"
    a = trl_args(GRPOConfig(micro_batch_size=64), tmp_path, world_size=1)
    assert (a.per_device_train_batch_size, a.gradient_accumulation_steps, a.generation_batch_size) == (64, 8, 512)
    a = trl_args(GRPOConfig(dtype="bf16"), tmp_path, world_size=1)
    assert a.bf16 and not a.fp16


@pytest.mark.parametrize("kw, msg", [
    ({"num_generations": 1}, "num_generations must be >= 2"),
    ({"micro_batch_size": 7}, "--micro-batch"),
    ({"loss_type": "ppo"}, "loss_type must be one of"),
    ({"dtype": "fp16"}, "needs a GPU"),
    ({"use_vllm": True}, "--device cuda"),
    ({"temperature": 0.0}, "temperature must be > 0"),
    ({"learning_rate": 0.0}, "--lr"),
    ({"num_iterations": 2, "steps": 3}, "multiples"),
    ({"lr_scheduler": "step"}, "lr_scheduler"),
])
def test_config_validation_says_what_to_change(kw, msg):
    with pytest.raises(DeltalensError, match=msg):
        GRPOConfig(**kw)


def test_presets_and_roundtrip():
    tiny = GRPOConfig.preset("tiny")
    assert tiny.prompts_per_step == 8 and tiny.num_generations == 8 and tiny.learning_rate > 1e-6
    assert tiny.loss_type == "grpo" and tiny.beta == 0.001  # only scale-related settings change
    assert GRPOConfig.preset("paper") == GRPOConfig()
    smol = GRPOConfig.preset("smollm2")  # micro-batches for memory: 4 x 8 completions, at most 8 per backward
    assert (smol.completions_per_step, smol.micro_batch_size, smol.max_micro_batch) == (32, None, 8)
    d = tiny.to_dict()
    assert d["method"] == "grpo"
    assert GRPOConfig.from_dict({**d, "deltalens_version": "x"}) == tiny
    with pytest.raises(DeltalensError, match="unknown GRPO preset"):
        GRPOConfig.preset("huge")
    with pytest.raises(DeltalensError, match="is a 'es' config, not 'grpo'"):
        GRPOConfig.from_dict({"method": "es", "sigma": 0.1})
    with pytest.raises(DeltalensError, match="unknown GRPO option"):
        GRPOConfig.from_dict({"method": "grpo", "sigma": 0.1})


def test_prompts_are_a_function_of_seed_and_step():
    from deltalens.tasks import get_task

    task = get_task("arith")
    a = step_problems(task, 0, 3, 5)
    assert a == step_problems(task, 0, 3, 5)
    assert a != step_problems(task, 0, 4, 5) and a != step_problems(task, 1, 3, 5)
    cfg = GRPOConfig(prompts_per_step=5, num_generations=2)
    ds = build_dataset(task, cfg, 3, 4)  # steps 3 and 4, in order
    assert ds.column_names == ["prompt", "answer"]
    assert ds["prompt"] == [p.prompt for p in a + step_problems(task, 0, 4, 5)]
    test_prompts = {p.prompt for p in task.test()}
    assert not test_prompts & set(ds["prompt"])  # never trains on held-out problems
    chat = build_dataset(task, GRPOConfig(prompts_per_step=5, num_generations=2), 3, 3, chat=True)
    assert chat["prompt"][0] == a[0].chat() and chat["prompt"][0][-1]["role"] == "user"
    assert "#### <answer>" in chat["prompt"][0][-1]["content"]  # the chat form states the answer format
    assert GRPOConfig.from_dict({**GRPOConfig().to_dict(), "chat_template": True}).chat_template == "on"  # old runs


def test_countdown_dataset_passes_numbers_to_the_reward():
    from deltalens.tasks import get_task

    task = get_task("countdown")
    ds = build_dataset(task, GRPOConfig(task="countdown", prompts_per_step=2, num_generations=2), 1, 1)
    assert ds.column_names == ["prompt", "answer", "numbers"]
    reward = task.reward_fn()
    sol = step_problems(task, 0, 1, 2)[0].solution
    assert reward(prompts=ds["prompt"][:1], completions=[sol], answer=ds["answer"][:1],
                  numbers=ds["numbers"][:1]) == [1.0]


# ---------------------------------------------------------------------------------------------- training


def test_grpo_steps_change_weights_and_write_the_run_format(tmp_path):
    from deltalens.io.models import load_model, weights_checksum

    out = tmp_path / "grpo"
    calls = []
    cfg = fast(steps=3, save_every=2, eval_every=2)
    train_grpo(cfg, out, progress=lambda d, t, r: calls.append((d, t, r)))

    conf = json.loads((out / "config.json").read_text())
    assert conf["method"] == "grpo" and conf["loss_type"] == "grpo" and conf["beta"] == 0.001
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["iteration"] == 0 and "eval" in rows[0]  # held-out Pass@1 before training
    train_rows = [r for r in rows if "reward_mean" in r]
    assert [r["iteration"] for r in train_rows] == [1, 2, 3]
    for r in train_rows:
        assert 0.0 <= r["reward_min"] <= r["reward_max"] <= 1.0
        assert r["reward_min"] - 1e-9 <= r["reward_mean"] <= r["reward_max"] + 1e-9
        for key in ("reward_std", "kl", "entropy", "clip_ratio", "loss", "learning_rate", "units"):
            assert key in r
        assert r["timing"]["iteration_s"] > 0
        assert r["units"] == r["iteration"] * 4 * 8 * 4
    assert "eval" in train_rows[1] and "eval" in train_rows[2]  # step 2 (eval_every) and the last step
    assert 0.0 <= train_rows[2]["eval"]["pass_at_1"] <= 1.0
    assert [c[0] for c in calls] == [0, 1, 2, 3] and calls[0][2] is None and calls[-1][2]["iteration"] == 3

    ck = out / "checkpoints"
    assert (ck / "iter-000002" / "config.json").exists() and (ck / "final" / "config.json").exists()
    assert not (ck / "iter-000001").exists()
    st = json.loads((out / "state.json").read_text())
    checksum = st.pop("checksum")  # of the final weights (a resume verifies it)
    assert st == {"method": "grpo", "iteration": 3, "seed": 0, "checkpoint": "final", "compute_dtype": "fp32"}
    opt = load_trainer_state(ck / "final.trainer.pt")  # weights_only load of the optimizer state
    assert [p.name for p in ck.glob("*.trainer.pt")] == ["final.trainer.pt"]  # step 2's, never read again, pruned
    assert opt["step"] == 3 and opt["optimizer"]["state"] and opt["scheduler"]["last_epoch"] == 3
    assert not (out / ".trl").exists()

    model, _ = load_model(str(out))  # the run directory loads its final checkpoint
    assert weights_checksum(model) == checksum
    assert model.config.use_cache is not False
    assert max_weight_diff(_weights(out), _weights(cfg.model)) > 1e-4  # GRPO moved the weights
    assert max_weight_diff(_weights(ck / "iter-000002"), _weights(out)) > 0


def test_micro_batches_take_the_same_step(tmp_path):
    """--micro-batch k back-props P·G completions k at a time (gradient accumulation) and takes the same step:
    the same completions (one generation per step), the same update up to float rounding (the mean over
    sequences is the mean of equal-size micro-batch means). The smollm2/qwen2.5 presets use it for memory."""
    base = _weights(tiny_spec())
    runs = {m: train_grpo(fast(steps=1, save_every=0, micro_batch_size=m), tmp_path / f"m{m}") for m in (None, 4)}
    rows = {m: [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][-1] for m, out in runs.items()}
    assert rows[None]["reward_mean"] == rows[4]["reward_mean"] and rows[None]["completion_length"] == rows[4][
        "completion_length"]
    d_all, d_micro = ({k: w[k] - base[k] for k in base} for w in (_weights(runs[None]), _weights(runs[4])))
    norm = sum(float(v.pow(2).sum()) for v in d_all.values()) ** 0.5
    gap = sum(float((d_all[k] - d_micro[k]).pow(2).sum()) for k in base) ** 0.5
    assert norm > 1e-3 and gap < 1e-4 * norm, (norm, gap)  # measured: gap 4.6e-6 of norm 0.87


def test_recomputing_activations_takes_the_same_steps(tmp_path):
    """--gradient-checkpointing (the qwen2.5 preset's since 2026-12-07) recomputes the forward pass in backward:
    memory only. Two steps each way from the same weights and seed: the same completions and rewards at step 2
    (drawn from the weights step 1 wrote) and the same final weights, to the bit on one machine (no assertion
    looser than needed; were recomputation to round differently, this says so). Not a trajectory setting."""
    runs = {on: train_grpo(fast(steps=2, save_every=0, gradient_checkpointing=on), tmp_path / f"c{int(on)}")
            for on in (False, True)}
    rows = {on: [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()] for on, out in runs.items()}
    assert [(r["reward_mean"], r["completion_length"]) for r in rows[False]] == [
        (r["reward_mean"], r["completion_length"]) for r in rows[True]]
    w_off, w_on, base = _weights(runs[False]), _weights(runs[True]), _weights(tiny_spec())
    assert any(not torch.equal(w_off[k], base[k]) for k in base)  # the steps moved the weights
    assert all(torch.equal(w_off[k], w_on[k]) for k in base)
    assert json.loads((runs[True] / "config.json").read_text())["gradient_checkpointing"] is True


def test_the_micro_batch_cap_takes_the_largest_divisor():
    """max_micro_batch (the smollm2/qwen2.5 presets' 8) never makes a valid P x G invalid: it takes the largest
    divisor of P·G / processes not above it; --micro-batch wins (both given explicitly is refused); bnpo, whose
    token mean is per micro-batch, is left at all completions at once."""
    from deltalens.training.grpo.train import batching

    def b(world=1, **kw):
        return batching(GRPOConfig.resolve(preset="smollm2", given=kw), world)

    assert b() == (8, 4)  # 32 completions
    assert b(prompts_per_step=3, num_generations=4) == (6, 2)  # 12: no multiple of 8 needed
    assert b(prompts_per_step=1, num_generations=4) == (4, 1)
    assert b(prompts_per_step=3, num_generations=6) == (6, 3)  # 18
    assert b(world=8) == (4, 1) and b(world=16) == (2, 1)  # multi-process: 32 / world each
    assert b(micro_batch_size=16) == (16, 2)
    assert b(loss_type="bnpo") == (32, 1)
    assert batching(GRPOConfig.preset("tiny"), 1) == (64, 1)  # no cap: all at once
    with pytest.raises(DeltalensError, match="--max-micro-batch is only used when --micro-batch-size is None"):
        GRPOConfig.resolve(preset="smollm2", given={"micro_batch_size": 16, "max_micro_batch": 4})
    with pytest.raises(DeltalensError, match="max_micro_batch must be >= 1"):
        GRPOConfig(max_micro_batch=0)


def test_init_from_starts_from_given_weights(tmp_path):
    """init_from = bare .pt weights on the model's architecture: training starts there (lr ~0 keeps it
    there), and the KL reference is written as an HF directory because TRL cannot load a .pt."""
    from deltalens.io.atomic import save_state_dict

    spec = tiny_spec()
    base = _weights(spec)
    g = torch.Generator().manual_seed(1)
    moved = {k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in base.items()}
    save_state_dict(moved, tmp_path / "start.pt")
    out = tmp_path / "run"
    train_grpo(fast(init_from=str(tmp_path / "start.pt"), learning_rate=1e-10, steps=1), out)
    final = _weights(out)
    assert max_weight_diff(final, moved) < 1e-6
    assert max_weight_diff(final, base) > 1e-2
    assert max_weight_diff(_weights(out / "checkpoints" / "reference"), moved) == 0.0
    assert json.loads((out / "config.json").read_text())["init_from"] == str(tmp_path / "start.pt")


def test_resume_is_exact_and_refuses_trajectory_changes(tmp_path):
    cfg = fast(steps=4, save_every=2)
    train_grpo(cfg, tmp_path / "straight")

    class Killed(Exception):
        pass

    def kill_at_3(done, total, row):
        if done == 3:
            raise Killed

    with pytest.raises(Killed):
        train_grpo(cfg, tmp_path / "killed", progress=kill_at_3)
    st = json.loads((tmp_path / "killed" / "state.json").read_text())
    assert st["iteration"] == 2 and st["checkpoint"] == "iter-000002"
    assert (tmp_path / "killed" / "checkpoints" / "iter-000002.trainer.pt").is_file()  # the latest: kept

    with pytest.raises(DeltalensError, match="learning_rate"):
        train_grpo(fast(steps=4, save_every=2, learning_rate=2e-3), tmp_path / "killed", resume=True)
    train_grpo(cfg, tmp_path / "killed", resume=True)
    a, b = _weights(tmp_path / "straight"), _weights(tmp_path / "killed")
    assert all(torch.equal(a[k], b[k]) for k in a)  # bit-identical to the uninterrupted run
    rows = [json.loads(x) for x in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]  # the rows past the checkpoint were redone
    straight = [json.loads(x) for x in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward_mean"] for r in rows] == [r["reward_mean"] for r in straight]

    # more steps on a constant LR schedule: allowed, from the final checkpoint's optimizer state; step 5's
    # save then step 6's final leave the final's state only
    train_grpo(fast(steps=6, save_every=1), tmp_path / "killed", resume=True)
    assert json.loads((tmp_path / "killed" / "state.json").read_text())["iteration"] == 6
    ck = tmp_path / "killed" / "checkpoints"
    assert (ck / "iter-000005").is_dir() and [p.name for p in ck.glob("*.trainer.pt")] == ["final.trainer.pt"]
    with pytest.raises(DeltalensError, match="nothing to resume"):
        train_grpo(cfg, tmp_path / "nothing", resume=True)
    with pytest.raises(DeltalensError, match="already holds a run"):
        train_grpo(cfg, tmp_path / "straight")


def test_every_optimizer_state_is_kept_when_asked(tmp_path):
    train_grpo(fast(steps=3, save_every=1, keep_optimizer_states=True), tmp_path / "keep")
    ck = tmp_path / "keep" / "checkpoints"
    assert sorted(p.name for p in ck.glob("*.trainer.pt")) == ["final.trainer.pt", "iter-000001.trainer.pt",
                                                               "iter-000002.trainer.pt"]
    assert load_trainer_state(ck / "iter-000001.trainer.pt")["step"] == 1


def test_without_keep_checkpoints_a_finished_run_holds_only_final(tmp_path):
    train_grpo(fast(steps=3, save_every=1, keep_checkpoints=False), tmp_path / "latest")
    ck = tmp_path / "latest" / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["final", "final.trainer.pt"]
    with pytest.raises(DeltalensError, match="drop one of them"):
        fast(keep_checkpoints=False, keep_optimizer_states=True)


def test_resume_verifies_the_weights_checksum(tmp_path):
    """Every GRPO save stores the weights' checksum; a resume from an edited checkpoint is refused in one line
    (through the CLI, whose bare `train --resume RUN` form also works for GRPO runs)."""
    from safetensors.torch import load_file
    from support import run_cli

    from deltalens.io.atomic import save_state_dict
    from deltalens.io.models import weights_checksum

    out = tmp_path / "g"
    train_grpo(fast(steps=1), out)
    state = json.loads((out / "state.json").read_text())
    assert state["checksum"] == weights_checksum(_model(out / "checkpoints" / "final"))
    r = run_cli(["train", "--resume", out])  # finished: nothing to do, but the alias resumes a GRPO run
    assert r.exit_code == 0, r.output

    weights = out / "checkpoints" / "final" / "model.safetensors"
    original = weights.read_bytes()
    sd = load_file(str(weights))
    name = min(sd)
    sd[name].view(-1)[0] += 1.0
    save_state_dict(sd, weights, metadata={"format": "pt"})
    r = run_cli(["train", "resume", out, "--steps", "2"])
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert "does not match the checksum in state.json" in r.output
    weights.write_bytes(original)
    r = run_cli(["train", "resume", out, "--steps", "2"])
    assert r.exit_code == 0, r.output
    assert json.loads((out / "state.json").read_text())["iteration"] == 2


def _model(spec):
    from deltalens.io.models import load_model

    return load_model(str(spec))[0]


# ---------------------------------------------------------------------------------------------- sequences


def test_es_then_grpo_chains_from_the_es_final_weights(tmp_path):
    from deltalens.io.models import load_model
    from deltalens.training.chain import train_chain
    from deltalens.training.es.config import ESConfig

    spec = tiny_spec()
    es = ESConfig(population=4, prompts_per_iteration=8, sigma=0.01, alpha=0.005, eval_every=0,
                  checkpoint_every=0, max_new_tokens=48)
    gr = fast(learning_rate=1e-10, save_every=0)
    out = tmp_path / "seq"
    calls = []
    # 64 units per ES iteration (8 prompts x 2 x population 4), 128 per GRPO step (4 prompts x 8 x G 4)
    train_chain(out, ["es", "grpo"], model=spec, task="arith", budget=2 * 64 + 2 * 128,
                   es_config=es, grpo_config=gr, progress=lambda d, t, r: calls.append((d, t, r)))
    es_cfg = json.loads((out / "es" / "config.json").read_text())
    gr_cfg = json.loads((out / "grpo" / "config.json").read_text())
    assert es_cfg["method"] == "es" and es_cfg["iterations"] == 3  # 192 units / 64 per iteration
    assert gr_cfg["method"] == "grpo" and gr_cfg["steps"] == 1  # 192 units / 128 per step
    assert gr_cfg["init_from"] == str((out / "es").resolve()) and gr_cfg["model"] == spec

    base, es_final, gr_final = _weights(spec), _weights(out / "es"), _weights(out / "grpo")
    assert max_weight_diff(es_final, base) > 1e-4  # ES moved the weights
    assert max_weight_diff(gr_final, es_final) < 1e-6  # GRPO (lr ~0) started from the ES final weights
    top = _weights(out)  # load_model(out) = the last stage's final
    assert all(torch.equal(top[k], gr_final[k]) for k in top)
    load_model(str(out))

    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["stage"], r["stage_iteration"], r["iteration"]) for r in rows] == \
        [("es", 1, 1), ("es", 2, 2), ("es", 3, 3), ("grpo", 1, 4)]
    assert [r["units"] for r in rows] == [64, 128, 192, 320]
    conf = json.loads((out / "config.json").read_text())
    assert conf["method"] == "es-grpo" and [s["dir"] for s in conf["stages"]] == ["es", "grpo"]
    assert json.loads((out / "state.json").read_text())["checkpoint"] == "final"
    assert [c[0] for c in calls if c[2] is not None] == [1, 2, 3, 4] and calls[-1][1] == 4
    assert calls[-1][2]["stage"] == "grpo"

    # resuming a finished sequence redoes nothing
    mtime = (out / "grpo" / "checkpoints" / "final" / "model.safetensors").stat().st_mtime_ns
    train_chain(out, ["es", "grpo"], resume=True)
    assert (out / "grpo" / "checkpoints" / "final" / "model.safetensors").stat().st_mtime_ns == mtime


def test_step_seed_differs_per_step_and_run():
    from deltalens.training.grpo.train import step_seed

    seeds = {step_seed(s, t) for s in range(3) for t in range(1, 200)}
    assert len(seeds) == 3 * 199
    assert all(0 <= x < 2**32 for x in seeds)
    assert step_seed(0, 1) == step_seed(0, 1)


def test_reward_recorder_scores_completions_cut_at_the_stop_string():
    """A base model's rollout on a raw few-shot prompt runs on into an invented example; its reward is
    that of the completion cut where evaluation and ES cut it."""
    from deltalens.tasks import get_task
    from deltalens.training.grpo.train import RewardRecorder

    task = get_task("add:digits=1-2,terms=2,shots=2")
    stop = task.stop_strings(chat=False)
    assert stop == ("\n\nQ:",)
    # no marker: the lenient reader takes the last number, which the invented example would supply
    rollouts = [" 3 + 4 = 7\n\nQ: What is 1 + 1?\nA: 1 + 1 = 2", " 3 + 4 = 8.\n#### 8\n\nQ: What is 7?\nA: #### 7"]
    plain, cut = RewardRecorder(task.reward_fn()), RewardRecorder(task.reward_fn(), stop=stop)
    assert plain.reward(prompts=["p", "p"], completions=rollouts, answer=["7", "7"]) == [0.0, 0.1]
    assert cut.reward(prompts=["p", "p"], completions=rollouts, answer=["7", "7"]) == [1.0, 0.1]
    assert cut.take() == [1.0, 0.1]
