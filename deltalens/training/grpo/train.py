"""GRPO fine-tuning through TRL's `GRPOTrainer`, writing the same run directory as ES.

We do not implement GRPO here: `train_grpo` drives `trl.GRPOTrainer` with a deltalens model, task and
reward function (`Task.reward_fn()`, already in TRL's `(prompts, completions, answer=..., **cols)`
interface) and makes its run look like an ES run to the rest of deltalens (`deltalens.io.runs.RunDir`):

    out/config.json        {"method": "grpo", ...GRPOConfig fields, "deltalens_version"}
    out/metrics.jsonl      one row per optimizer step, from TRL's logs (a TrainerCallback): "iteration"
                           (= step, so reports treat ES and GRPO alike), reward_mean/std/min/max, kl,
                           entropy, clip_ratio, loss, grad_norm, learning_rate, completion_length,
                           units (compute units so far, `deltalens.training.budget`), timing.iteration_s, the raw
                           TRL log under "trl", and "eval" (held-out greedy Pass@1) every eval_every steps;
                           a row {"iteration": 0, "eval": ...} before the first step, as ES writes
    out/state.json         {"method": "grpo", "iteration": k, "checkpoint": "iter-00000k", "checksum", ...}
    out/checkpoints/iter-XXXXXX/       HF format (RunDir.save), every save_every steps (keep_checkpoints off:
                                       the latest only, `RunDir.prune`)
    out/checkpoints/iter-XXXXXX.trainer.pt   optimizer + LR-scheduler state of the latest checkpoint (of every
                                             one with keep_optimizer_states; a resume reads the latest only)
    out/checkpoints/final/ (+ final.trainer.pt)   the last weights; `load_model(out)` loads them

With `report_to`, each row is also mirrored to TensorBoard / W&B in the run directory
(`deltalens.training.tracking`): TRL's logged numbers under the names TRL's own `report_to` gives them
(train/reward, train/kl, ...) plus the names ES shares (eval/pass_at_1, time/iteration_s, train/rewards),
at the run's step. TRL's TrainingArguments keep `report_to="none"`: its callbacks would count a resumed
run's steps from 1 again.

Every file is written atomically and state.json last, so it only ever names a checkpoint whose weights
and optimizer state are both complete; it also holds the weights' checksum
(`deltalens.io.models.weights_checksum`, as ES stores), which a resume verifies before continuing.

One GRPO step (TRL, `loss_type="grpo"`, μ = num_iterations = 1): draw P prompts, sample G completions
each at `temperature`, score them with the task reward, advantages A = (r - mean_group) / std_group,
and take one AdamW step on the clipped surrogate (ε) minus β·KL(π || π_ref) (the k3 estimator) against
the frozen starting weights, each sequence's token losses averaged over its length. TRL batches
completions, not prompts: a step generates P·G completions (`generation_batch_size`) and back-props them
in micro-batches of `micro_batch_size` (gradient accumulation), so one step = one generation = one
optimizer update.

Prompts: step t uses the P problems `task.train(P, Random("deltalens-grpo-prompts/<seed>/<t>"))`, in
order (TRL's shuffling is off), so the data of a step is a function of (seed, t) only.

Exact resume: a GRPO state is the weights + the AdamW moments + the LR-scheduler position + the step
(unlike ES, whose state is weights + (seed, step)). Checkpoints store the optimizer and scheduler state
with `torch.save` beside the HF directory and resume reloads them with `torch.load(weights_only=True)`.
Sampling is reseeded at every step from (seed, step) (`step_seed`), prompts are a function of (seed,
step), and the KL reference is always the run's starting weights (never the checkpoint being resumed), so
a killed and resumed run ends with the same weights as an uninterrupted one (bit-identical on the same
machine and thread count, tested). Not covered: vLLM generation (its sampler has its own seeds), and
changing settings that decide the trajectory (`trajectory=True` fields of `GRPOConfig`; `steps` may grow only with a
constant LR schedule).

Precision (`dtype`). TRL/Trainer's `bf16`/`fp16` flags are *mixed precision*: autocast around the
forward passes (plus loss scaling for fp16); parameters, gradients and AdamW state keep the dtype the
model was loaded in (TRL's `model_init_kwargs={"dtype": ...}`), and TRL turns bf16 autocast on by
default. Here, as for ES, `dtype` is the weight dtype: fp32 = fp32 weights, no autocast; bf16 = bf16
weights, gradients and Adam state + bf16 autocast (TRL's usual bf16 setup; updates far below a weight's
bf16 resolution are lost, so prefer `dtype=fp32, autocast=bf16` at lr 1e-6); fp16 = fp32 master weights +
fp16 autocast with loss scaling (Trainer cannot step fp16 weights; GPU only; checkpoints are fp32).
`autocast` overrides the mixed-precision part.

Rollout dtype (`compute_dtype`, apart from all of the above). With fp32 weights and `compute_dtype` bf16
(or auto where bf16 matmuls are fast, for hidden size >= 512: SmolLM2, Qwen2.5, Gemma-3 on an AMX CPU;
`tiny` stays fp32) the P·G training completions of a step are sampled by deltalens's HF backend on a bf16
copy of the policy (`deltalens.generation.dtype`: norm weights and Linear biases kept fp32), refreshed
from the fp32 policy at the start of every step, instead of by TRL's `generate` on the fp32 policy
(`DeltalensGRPOTrainer._generate_single_turn`, `sample_rollouts`). Everything after the sampling (the
log-probabilities, the KL reference, the loss, gradients, AdamW) stays fp32 and is TRL's. The rollouts are
then slightly off-policy, as vLLM rollouts are in TRL: with μ = 1 TRL takes the "old" log-probabilities
from the fp32 policy itself (ratio 1), so the difference between the bf16 sampler and the fp32 policy is
not corrected for (TRL's `vllm_importance_sampling_correction` is a vLLM-only option). The sampling is
deltalens's (prompt prefilled once per group, inverse-CDF draw, seeded from (seed, step)), not TRL's, so an
fp32 and a bf16 run of one seed draw different completions from the first step; the held-out greedy
evaluation runs in the same dtype. Raw few-shot prompts' stop strings end these rollouts
(`cut_ids_at_stop`: through the token completing the stop string). auto is resolved when the run starts
and kept in state.json and every metrics row (`compute_dtype`); a resume samples as the run began (runs
from before the option: fp32).

GPU path (not exercised in the CPU tests): `device="cuda"` lets Trainer place the model on the GPU;
`use_vllm=True` generates with vLLM (`vllm_mode="colocate"` shares the training GPUs, "server" talks to
`trl vllm-serve`); several GPUs: `accelerate launch [--config_file deepspeed_zero2.yaml] -m
deltalens.cli.main train grpo --device cuda ...` (DDP or DeepSpeed ZeRO-1/2; only rank 0
writes the run directory; ZeRO-3/FSDP are not supported by this checkpoint writer).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import os
import random
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from deltalens.errors import DeltalensError
from deltalens.generation import HFBackend
from deltalens.generation.dtype import machine, model_compute_dtype
from deltalens.generation.params import SamplingParams, cut_at_stop, cut_ids_at_stop
from deltalens.generation.prompts import problem_prompts, uses_chat
from deltalens.io.atomic import atomic_dir, atomic_path
from deltalens.io.heap import release_freed_memory
from deltalens.io.models import dtype_name, load_model, weights_checksum
from deltalens.io.quiet import quiet_transformers
from deltalens.io.runs import RunDir, checkpoint_name
from deltalens.io.spec import resolve
from deltalens.tasks import CORRECT, problem_columns
from deltalens.training.budget import grpo_units
from deltalens.training.grpo.config import GRPOConfig
from deltalens.training.run import held_out_pass_at_1, make_task, open_run, run_config
from deltalens.training.tracking import Tracker, require

# ----------------------------------------------------------------------------------------------
# data, seeds, rewards


def _key32(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "little")


def step_seed(seed: int, step: int) -> int:
    """The torch seed of step `step`'s sampling: a function of (run seed, step) only (32 bits, since
    torch's CPU generator keeps only the low 32 bits of a seed)."""
    return _key32(f"deltalens-grpo-sampling/{seed}/{step}")


def step_problems(task, seed: int, step: int, n: int):
    """The `n` training problems of step `step` (a function of (seed, step): resume needs no data state)."""
    return task.train(n, random.Random(f"deltalens-grpo-prompts/{seed}/{step}"))


def run_problems(task, config: GRPOConfig, first_step: int, last_step: int) -> list:
    """The training problems of steps first_step..last_step, in order (one draw per μ = num_iterations steps)."""
    return [p for step in range(first_step, last_step + 1, config.num_iterations)
            for p in step_problems(task, config.seed, step, config.prompts_per_step)]


def build_dataset(task, config: GRPOConfig, first_step: int, last_step: int, chat: bool = False):
    """A `datasets.Dataset` with the prompts of steps first_step..last_step, in order.

    Columns: prompt (text, or with `chat` the problem's conversation: few-shot turns, then the question;
    TRL applies the tokenizer's chat template to it), answer, and the task's
    extra columns (`problem_columns`, e.g. countdown's numbers), which TRL passes to the reward function.
    With num_iterations = μ > 1 one generation serves μ steps, so only every μ-th step draws prompts.
    """
    from datasets import Dataset

    problems = run_problems(task, config, first_step, last_step)
    prompts = problem_prompts(problems, chat)
    return Dataset.from_dict({"prompt": prompts, **problem_columns(problems)})


class RewardRecorder:
    """Wraps a TRL-style reward function and keeps the rewards of the current step (TRL logs only their
    mean and std; the metrics rows also want min/max and the fraction correct). `stop`: the task's stop
    strings (raw few-shot prompts, `Task.stop_strings`): each text completion is scored cut before the
    first of them, as evaluation and ES generate it. Rollouts sampled in bf16 (`sample_rollouts`) already
    end at the stop string; TRL's own fp32 `generate` gets no tokenizer, which transformers' `stop_strings`
    needs, so there the tokens a base model writes past the stop string still share the completion's
    advantage and KL term (only its reward is computed on the cut text)."""

    def __init__(self, fn: Callable[..., list[float]], stop: tuple[str, ...] = ()):
        self.fn, self.rewards = fn, []

        def reward(*args, completions=None, **kwargs):
            if stop and completions is not None:
                completions = [cut_at_stop(c, stop)[0] if isinstance(c, str) else c for c in completions]
            out = fn(*args, completions=completions, **kwargs)
            self.rewards.extend(float(r) for r in out if r is not None)
            return out

        reward.__name__ = getattr(fn, "__name__", "reward")
        self.reward = reward

    def take(self) -> list[float]:
        out, self.rewards = self.rewards, []
        return out


# ----------------------------------------------------------------------------------------------
# TRL glue


def batching(config: GRPOConfig, world_size: int | None = None) -> tuple[int, int]:
    """(micro batch per process, gradient accumulation steps) so that one step is one generation of
    prompts_per_step x num_generations completions; a one-line error when they do not divide."""
    world = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    total = config.completions_per_step
    micro = config.micro_batch_size or total // world
    cap = config.max_micro_batch if config.loss_type != "bnpo" else None  # bnpo: token mean per micro-batch
    if config.micro_batch_size is None and cap and micro > cap and total % world == 0:
        micro = max(d for d in range(1, cap + 1) if micro % d == 0)  # the largest divisor of P·G / world <= cap
    if micro < 1 or total % (micro * world):
        raise DeltalensError(f"prompts_per_step x num_generations ({total}) must be a multiple of micro_batch_size "
                             f"({micro}) x processes ({world}); change --micro-batch or --prompts")
    return micro, total // (micro * world)


def trl_args(config: GRPOConfig, output_dir: str | Path, world_size: int | None = None):
    """TRL's `GRPOConfig` for `config`: every setting whose TRL default differs is set explicitly."""
    try:
        from trl import GRPOConfig as TRLGRPOConfig
    except ImportError as e:
        raise DeltalensError("GRPO needs TRL: pip install 'deltalens[trl]' (trl and datasets)") from e
    micro, accum = batching(config, world_size)
    mp = config.mixed_precision
    kwargs = dict(
        output_dir=str(output_dir),
        use_cpu=config.device == "cpu",
        report_to="none",
        seed=config.seed,
        data_seed=config.seed,
        max_steps=config.steps,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accum,  # steps_per_generation defaults to this: one generation per step
        num_generations=config.num_generations,
        num_iterations=config.num_iterations,
        loss_type=config.loss_type,
        beta=config.beta,
        epsilon=config.epsilon,
        epsilon_high=config.epsilon_high,
        scale_rewards=config.scale_rewards,
        temperature=config.temperature,
        top_p=config.top_p,
        max_completion_length=None,  # set below (the task's budget)
        learning_rate=config.learning_rate,
        lr_scheduler_type=config.lr_scheduler,
        warmup_steps=config.warmup_steps,
        weight_decay=config.weight_decay,
        max_grad_norm=config.max_grad_norm,
        optim="adamw_torch",
        bf16=mp == "bf16",
        fp16=mp == "fp16",
        **_checkpointing_arg(config.gradient_checkpointing),
        shuffle_dataset=False,  # step t's prompts are rows [(t-1)P, tP) of the dataset
        remove_unused_columns=False,  # the reward function needs answer (+ task columns)
        logging_strategy="steps",
        logging_steps=1,
        save_strategy="no",  # checkpoints are ours (RunDir), see _RunCallback
        disable_tqdm=True,
        dataloader_num_workers=0,
        use_vllm=config.use_vllm,
        vllm_mode=config.vllm_mode,
        log_completions=False,
    )
    return TRLGRPOConfig(**kwargs)


def _checkpointing_arg(on: bool) -> dict:
    """transformers 5 renamed gradient_checkpointing to activation_checkpointing (the old name warns)."""
    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return {"activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing": on}


def grpo_compute_dtype(config: GRPOConfig, model: torch.nn.Module, pinned: str | None = None) -> str:
    """The dtype the training completions are sampled in ("fp32", "bf16", ...): weights loaded in bf16/fp16
    and vLLM rollouts generate as they are (the weights' dtype); fp32 weights in `config.compute_dtype`,
    auto = bf16 where bf16 matmuls are fast on `config.device` for hidden size >= 512
    (`deltalens.generation.dtype`). `pinned`: what the run resolved when it started (a resume), so auto
    cannot change mid-run; runs from before the option read "fp32"."""
    param = next(model.parameters())
    if param.dtype != torch.float32 or config.use_vllm:
        return dtype_name(param.dtype)
    if pinned is not None:
        return pinned
    return dtype_name(model_compute_dtype(config.compute_dtype, model, config.device))


def sample_rollouts(backend: HFBackend, prompt_ids: list[list[int]], group: int, params: SamplingParams) -> list[list[int]]:
    """The completions (new token ids) of TRL's rows `prompt_ids`, one per row, from a deltalens HF backend.

    TRL's sampler lays a step's rows out as each prompt `group` times in a row; such a batch is generated
    as its distinct prompts with n = group (each prompt prefilled once), anything else row by row with
    n = 1. Each completion runs through its first EOS (kept, as TRL's own generate keeps it, so the policy
    learns to stop) or through the token that completes a stop string (`params.stop`,
    `cut_ids_at_stop`), else to `params.max_new_tokens`."""
    grouped = group >= 1 and len(prompt_ids) % group == 0 and all(
        prompt_ids[i] == prompt_ids[i - i % group] for i in range(len(prompt_ids)))
    if grouped:
        out = backend.generate_ids([list(p) for p in prompt_ids[::group]], dataclasses.replace(params, n=group))
    else:
        out = backend.generate_ids([list(p) for p in prompt_ids], dataclasses.replace(params, n=1))
    return [cut_ids_at_stop(backend.tok, ids, params.stop) for rows in out for ids in rows]


def _trainer_class():
    from trl import GRPOTrainer

    class DeltalensGRPOTrainer(GRPOTrainer):
        """GRPOTrainer with three hooks: the LR schedule spans the whole run (also when resuming with fewer
        steps left), sampling is reseeded from (seed, step) before every generation, and with a bf16
        compute dtype (`rollouts` set) the training completions come from deltalens's HF backend on a bf16
        copy of the policy (`sample_rollouts`) instead of TRL's `generate` on the fp32 policy."""

        step_offset = 0  # steps done before this trainer started (resume)
        total_steps = 0
        run_seed = 0
        rollouts: HFBackend | None = None  # bf16 rollouts: the backend (its master is the policy)
        rollout_params: SamplingParams | None = None

        def create_scheduler(self, num_training_steps, optimizer=None):
            return super().create_scheduler(self.total_steps or num_training_steps, optimizer)

        def _generate_and_score_completions(self, inputs):
            if self.model.training:
                torch.manual_seed(step_seed(self.run_seed, self.step_offset + self.state.global_step + 1))
            return super()._generate_and_score_completions(inputs)

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations,
                                  has_tool_images=False):
            if self.rollouts is None or self.use_vllm or images is not None or multimodal_fields:
                return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                     has_tool_images)
            step = self.step_offset + self.state.global_step + 1
            policy = self.rollouts.model
            was_training = policy.training
            policy.eval()  # the copy is made (and kept) in eval mode: no dropout in the rollouts
            try:  # the bf16 copy is refreshed from the fp32 policy at the start of every call
                ids = sample_rollouts(self.rollouts, prompt_ids, num_generations,
                                      dataclasses.replace(self.rollout_params, seed=step_seed(self.run_seed, step)))
            finally:
                policy.train(was_training)
            return ids, None  # no sampling logprobs: with μ = 1 TRL takes the old logprobs from the fp32 policy

    return DeltalensGRPOTrainer


def _trainer_state_path(run, name: str) -> Path:
    return run.ckpt / f"{name}.trainer.pt"


def save_trainer_state(path: Path, optimizer, scheduler, step: int) -> None:
    """Optimizer + LR-scheduler state of a checkpoint (torch.save, atomic; tensors, numbers, lists only,
    so `torch.load(weights_only=True)` reads it back)."""
    obj = {"format": 1, "step": step, "optimizer": optimizer.state_dict(),
           "scheduler": scheduler.state_dict() if scheduler is not None else None}
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)


def prune_trainer_states(run, keep: str) -> list[Path]:
    """Delete the optimizer states of every checkpoint but `keep` (the one state.json names); returns them."""
    gone = [p for p in run.ckpt.glob("*.trainer.pt") if p != _trainer_state_path(run, keep)]
    for p in gone:
        p.unlink(missing_ok=True)
    return gone


def load_trainer_state(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise DeltalensError(f"{path} is missing: this checkpoint has no optimizer state, so the run cannot be "
                             "resumed exactly; start a new run with --init-from on that checkpoint") from None
    except Exception as e:
        raise DeltalensError(f"cannot read optimizer state {path} ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:160]}); it is corrupt: restore it or start a new run") from e


def _held_out(model, tok, task, config: GRPOConfig, compute_dtype: str = "fp32", backend=None) -> dict:
    """Greedy Pass@1 on the first `eval_limit` validation problems (the same measure ES logs), generated
    in the run's compute dtype (as ES's members and its held-out evaluation are); `backend`: the trainer's
    rollout backend when it has one (its bf16 copy, refreshed from `model`), else a new one."""
    if backend is None:
        backend = HFBackend(model, tok, chat_template=config.chat_template,
                            compute_dtype="bf16" if compute_dtype == "bf16" else "fp32")
    return held_out_pass_at_1(model, tok, task, limit=config.eval_limit,
                              max_new_tokens=config.max_new_tokens or task.max_new_tokens, backend=backend)


def _num(v):
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return None if isinstance(v, float) and not math.isfinite(v) else v
    return None


def metrics_row(step: int, logs: dict, rewards: list[float], config: GRPOConfig, iteration_s: float) -> dict:
    """One metrics.jsonl row from TRL's log of a step (+ our recorded rewards)."""
    if rewards:
        n = len(rewards)
        mean = math.fsum(rewards) / n
        stats = {"reward_mean": mean, "reward_std": math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / n),
                 "reward_min": min(rewards), "reward_max": max(rewards),
                 "frac_correct": sum(r == CORRECT for r in rewards) / n}
    else:  # another process generated this step's completions: fall back to TRL's aggregates
        mean = _num(logs.get("reward")) or 0.0
        stats = {"reward_mean": mean, "reward_std": _num(logs.get("reward_std")), "reward_min": None,
                 "reward_max": mean, "frac_correct": None}
    return {
        "iteration": step,
        **stats,
        "kl": _num(logs.get("kl")),
        "entropy": _num(logs.get("entropy")),
        "clip_ratio": _num(logs.get("clip_ratio/region_mean")),
        "clip_ratio_low": _num(logs.get("clip_ratio/low_mean")),
        "clip_ratio_high": _num(logs.get("clip_ratio/high_mean")),
        "loss": _num(logs.get("loss")),
        "grad_norm": _num(logs.get("grad_norm")),
        "learning_rate": _num(logs.get("learning_rate")),
        "completion_length": _num(logs.get("completions/mean_length")),
        "frac_reward_zero_std": _num(logs.get("frac_reward_zero_std")),
        "units": grpo_units(step, config.prompts_per_step, config.num_generations),
        "timing": {"iteration_s": round(iteration_s, 4), "trl_step_s": _num(logs.get("step_time"))},
        "machine": machine(config.device),  # this process's (`dtype.machine`)
        "trl": {k: _num(v) for k, v in logs.items() if _num(v) is not None},
    }


def _run_callback_class():
    from transformers import TrainerCallback

    class RunCallback(TrainerCallback):
        """Turns TRL's per-step logs into metrics rows, evaluations, checkpoints and progress calls."""

        def __init__(self, run, config, task, tok, start, recorder, progress, resume_state, tracker,
                     compute_dtype="fp32"):
            self.run, self.config, self.task, self.tok, self.tracker = run, config, task, tok, tracker
            self.compute_dtype = compute_dtype
            self.start, self.recorder, self.progress = start, recorder, progress
            self.resume_state = resume_state
            self.trainer = None
            self.t_last = time.perf_counter()

        def _model(self, model):
            return self.trainer.accelerator.unwrap_model(model) if self.trainer is not None else model

        def on_train_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kw):
            if self.resume_state is not None:  # exact resume: AdamW moments + LR position
                optimizer.load_state_dict(self.resume_state["optimizer"])
                if lr_scheduler is not None and self.resume_state.get("scheduler") is not None:
                    lr_scheduler.load_state_dict(self.resume_state["scheduler"])
            self.t_last = time.perf_counter()

        def on_log(self, args, state, control, logs=None, model=None, optimizer=None, lr_scheduler=None, **kw):
            logs = logs or {}
            if "loss" not in logs and "reward" not in logs:
                return  # the end-of-training summary (train_runtime, ...)
            step = self.start + state.global_step
            cfg = self.config
            rewards = self.recorder.take()
            row = metrics_row(step, logs, rewards, cfg, time.perf_counter() - self.t_last)
            row["compute_dtype"] = self.compute_dtype
            if not state.is_world_process_zero:
                return
            m = self._model(model)
            if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
                row["eval"] = _held_out(m, self.tok, self.task, cfg, self.compute_dtype,
                                        getattr(self.trainer, "rollouts", None))
            self.run.log(row)
            self.tracker.log_row(row, rewards=rewards)
            name = "final" if step == cfg.steps else (
                checkpoint_name(step) if cfg.save_every and step % cfg.save_every == 0 else None)
            if name is not None:  # the checksum lets a resume verify the weights it continues from
                save_trainer_state(_trainer_state_path(self.run, name), optimizer, lr_scheduler, step)
                _save_weights(self.run, m, self.tok, name, {"method": "grpo", "iteration": step, "seed": cfg.seed,
                                                            "checksum": weights_checksum(m),
                                                            "compute_dtype": self.compute_dtype}, cfg.save_pt,
                              prune=not cfg.keep_checkpoints)
                if not cfg.keep_optimizer_states:  # state.json now names `name`: older states are never read
                    prune_trainer_states(self.run, keep=name)
            if self.progress:
                self.progress(step, cfg.steps, row)
            release_freed_memory()  # a no-op while the heap is kept, unless memory runs short (`io.heap`)
            self.t_last = time.perf_counter()

    return RunCallback


def _save_weights(run, model, tok, name: str, state: dict, save_pt: bool, prune: bool = False) -> None:
    """RunDir.save with the model's config as it was loaded (TRL turns use_cache off under gradient
    checkpointing; a checkpoint should generate with a KV cache)."""
    use_cache = getattr(model.config, "use_cache", None)
    try:
        if use_cache is False:
            model.config.use_cache = True
        run.save(model, tok, name, state, save_pt=save_pt, prune=prune)
    finally:
        if use_cache is not None:
            model.config.use_cache = use_cache


def _start_model(config: GRPOConfig):
    """(model, tokenizer, kind, location) of the starting weights: init_from, else model."""
    spec = config.init_from or config.model
    ref = resolve(spec)
    kind, loc = ref.kind, ref.location
    if kind == "weights":
        model, tok = load_model(spec, config=config.model, dtype=config.load_dtype)
    else:
        model, tok = load_model(spec, dtype=config.load_dtype)
    return model, tok, kind, loc


def _reference_dir(run, config: GRPOConfig, kind: str, loc, start: tuple | None) -> str:
    """Where TRL loads the KL reference (the starting weights) from: `from_pretrained(config._name_or_path)`.

    HF directories, run directories (their final checkpoint) and hub ids are loaded from where they are;
    starting weights TRL cannot load that way (.gguf, bare .pt/.safetensors) are written once as an HF
    directory `checkpoints/reference/` in the run. `start` = (model, tokenizer) of the starting weights
    when already loaded.
    """
    if kind in ("hf_dir", "hub"):
        return str(loc)
    ref = run.ckpt / "reference"
    if not (ref / "config.json").exists():
        model, tok = start if start is not None else _start_model(config)[:2]
        with atomic_dir(ref) as tmp, quiet_transformers():
            model.save_pretrained(tmp, safe_serialization=True)
            tok.save_pretrained(tmp)
    return str(ref)


def train_grpo(config: GRPOConfig, out: str | Path, resume: bool = False,
               progress: Callable[[int, int, dict | None], None] | None = None, *,
               overwrite: bool = False) -> Path:
    """Run (or resume) GRPO through TRL into the run directory `out`; returns its path.

    progress(done, total, row) is called once before the first step (row None) and after every step with
    its metrics row (reward_mean, reward_max, timing.iteration_s, eval...). With `resume`, the run
    continues from its last checkpoint (weights + optimizer state) and ends as an uninterrupted run would;
    only non-trajectory settings (steps with a constant LR, eval/save cadence, save_pt, device) may change.
    """
    try:
        import datasets  # noqa: F401
        import trl  # noqa: F401
    except ImportError as e:
        raise DeltalensError("GRPO needs TRL: pip install 'deltalens[trl]' (trl and datasets)") from e

    # everything that can be refused is refused before the run directory is created or touched
    require(config.report_to)  # a missing tracker package
    run = RunDir(out)
    main = int(os.environ.get("RANK", "0")) == 0  # under `accelerate launch` only rank 0 writes the run
    task = make_task(config)
    batching(config)
    loaded = None
    if not resume:
        if main:
            run.check_create(overwrite)
        loaded = _start_model(config)
        uses_chat(loaded[1], config.chat_template)  # `--chat-template on` without a template: before the run dir
    # one writer at a time (rank 0); stale temporaries of a killed writer are removed
    with run.writing() if main else contextlib.nullcontext():
        return _train(run, config, task, loaded, main, resume, progress, overwrite)


def _train(run: RunDir, config: GRPOConfig, task, loaded, main: bool, resume: bool, progress,
           overwrite: bool) -> Path:
    """train_grpo (under the run's writer lock on rank 0); `loaded`: `_start_model` of a new run."""
    state = open_run(run, config, resume=resume, overwrite=overwrite, write=main)
    latest = run.latest() if state else None
    start = state["iteration"] if state and latest is not None else 0
    if main:
        run.truncate_metrics(start if start > 0 else -1)
    if start >= config.steps:
        return run.path

    resume_state = None
    if start > 0:
        resume_state = load_trainer_state(_trainer_state_path(run, latest.name))
        if resume_state.get("step") != start:
            raise DeltalensError(f"optimizer state of {latest} is for step {resume_state.get('step')}, "
                                 f"state.json says {start}; the run directory is inconsistent")
        ref = resolve(config.init_from or config.model)
        ref_dir = _reference_dir(run, config, ref.kind, ref.location, None) if config.beta > 0 else None
        model, tok = load_model(str(latest), dtype=config.load_dtype)
        if state.get("checksum") and weights_checksum(model) != state["checksum"]:
            raise DeltalensError(f"checkpoint {latest} does not match the checksum in state.json; it was "
                                 "modified or is corrupt: restore it or start a new run")
    else:
        model, tok, kind, loc = loaded if loaded is not None else _start_model(config)
        ref_dir = _reference_dir(run, config, kind, loc, (model, tok)) if config.beta > 0 else None
    if ref_dir is not None:
        model.config._name_or_path = ref_dir  # TRL builds the reference with from_pretrained(this)
    max_new = config.max_new_tokens or task.max_new_tokens
    # resolved once, when the run starts, and kept in state.json: a resume samples as the run began
    compute_dtype = grpo_compute_dtype(config, model, (state.get("compute_dtype") or "fp32") if start > 0 else None)

    out_trl = run.path / ".trl"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"(transformers|trl)\b")
        args = trl_args(config, out_trl)
    args.max_completion_length = max_new
    args.max_steps = config.steps - start
    chat = uses_chat(tok, config.chat_template)
    recorder = RewardRecorder(task.reward_fn(), stop=task.stop_strings(chat))
    # only rank 0 tracks (as only rank 0 writes the run directory)
    with Tracker(run.path, config.report_to if main else "none", start=start, config=run_config(config)) as tracker:
        callback = _run_callback_class()(run, config, task, tok, start, recorder, progress, resume_state, tracker,
                                         compute_dtype)

        model.train()
        if start == 0 and config.eval_every and main:
            row = {"iteration": 0, "units": 0, "compute_dtype": compute_dtype,
                   "eval": _held_out(model, tok, task, config, compute_dtype)}
            run.log(row)
            tracker.log_row(row)
        dataset = build_dataset(task, config, start + 1, config.steps, chat=chat)

        from transformers import PrinterCallback, ProgressCallback

        with warnings.catch_warnings():
            # transformers/TRL deprecation notices about their own internals: nothing a user can act on
            warnings.filterwarnings("ignore", category=FutureWarning, module=r"(transformers|trl)\b")
            with quiet_transformers():  # TRL loads the KL reference with from_pretrained: no "Loading weights" bar
                trainer = _trainer_class()(model=model, reward_funcs=recorder.reward, args=args,
                                           train_dataset=dataset, processing_class=tok, callbacks=[callback])
            trainer.step_offset, trainer.total_steps, trainer.run_seed = start, config.steps, config.seed
            if compute_dtype == "bf16" and next(model.parameters()).dtype == torch.float32:
                # rollouts on a bf16 copy of the policy (made on the first step, on the policy's device)
                trainer.rollouts = HFBackend(model, tok, chat_template=config.chat_template, compute_dtype="bf16")
                trainer.rollout_params = SamplingParams(temperature=config.temperature, top_p=config.top_p,
                                                        max_new_tokens=max_new, stop=task.stop_strings(chat))
            for cb in (PrinterCallback, ProgressCallback):
                trainer.remove_callback(cb)
            callback.trainer = trainer
            if progress:
                progress(start, config.steps, None)
            trainer.train()
    try:
        out_trl.rmdir()  # TRL writes nothing there with save_strategy="no"; keep it if it did
    except OSError:
        pass
    return run.path
