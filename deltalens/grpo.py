"""GRPO fine-tuning through TRL's `GRPOTrainer`, writing the same run directory as ES.

We do not implement GRPO here: `train_grpo` drives `trl.GRPOTrainer` with a deltalens model, task and
reward function (`Task.reward_fn()`, already in TRL's `(prompts, completions, answer=..., **cols)`
interface) and makes its run look like an ES run to the rest of deltalens (`deltalens.runs.RunDir`):

    out/config.json        {"method": "grpo", ...GRPORunConfig fields, "deltalens_version"}
    out/metrics.jsonl      one row per optimizer step, from TRL's logs (a TrainerCallback): "iteration"
                           (= step, so reports treat ES and GRPO alike), reward_mean/std/min/max, kl,
                           entropy, clip_ratio, loss, grad_norm, learning_rate, completion_length,
                           units (compute units so far, `deltalens.budget`), timing.iteration_s, the raw
                           TRL log under "trl", and "eval" (held-out greedy Pass@1) every eval_every steps;
                           a row {"iteration": 0, "eval": ...} before the first step, as ES writes
    out/state.json         {"method": "grpo", "iteration": k, "checkpoint": "iter-00000k", ...}
    out/checkpoints/iter-XXXXXX/       HF format (RunDir.save), every save_every steps
    out/checkpoints/iter-XXXXXX.trainer.pt   optimizer + LR-scheduler state of that checkpoint
    out/checkpoints/final/ (+ final.trainer.pt)   the last weights; `load_model(out)` loads them

Every file is written atomically and state.json last, so it only ever names a checkpoint whose weights
and optimizer state are both complete.

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
changing settings that decide the trajectory (`GRPORunConfig.TRAJECTORY`; `steps` may grow only with a
constant LR schedule).

Precision (`dtype`). TRL/Trainer's `bf16`/`fp16` flags are *mixed precision*: autocast around the
forward passes (plus loss scaling for fp16); parameters, gradients and AdamW state keep the dtype the
model was loaded in (TRL's `model_init_kwargs={"dtype": ...}`), and TRL turns bf16 autocast on by
default. Here, as for ES, `dtype` is the weight dtype: fp32 = fp32 weights, no autocast; bf16 = bf16
weights, gradients and Adam state + bf16 autocast (TRL's usual bf16 setup; updates far below a weight's
bf16 resolution are lost, so prefer `dtype=fp32, autocast=bf16` at lr 1e-6); fp16 = fp32 master weights +
fp16 autocast with loss scaling (Trainer cannot step fp16 weights; GPU only; checkpoints are fp32).
`autocast` overrides the mixed-precision part.

GPU path (not exercised in the CPU tests): `device="cuda"` lets Trainer place the model on the GPU;
`use_vllm=True` generates with vLLM (`vllm_mode="colocate"` shares the training GPUs, "server" talks to
`trl vllm-serve`); several GPUs: `accelerate launch [--config_file deepspeed_zero2.yaml] -m
deltalens.cli.main train --method grpo --device cuda ...` (DDP or DeepSpeed ZeRO-1/2; only rank 0
writes the run directory; ZeRO-3/FSDP are not supported by this checkpoint writer).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import random
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from deltalens.errors import DeltalensError

LR_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine")
# schedules whose LR does not depend on the total number of steps (so `steps` may grow on resume)
_STEP_FREE_SCHEDULERS = ("constant", "constant_with_warmup")
LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")
SCALE_REWARDS = ("group", "batch", "none")


@dataclass
class GRPORunConfig:
    """Hyperparameters of a GRPO run (TRL GRPOConfig style: one help line per field).

    Defaults are the paper's (arXiv 2608.27351): group size G = 8, `loss_type="grpo"`, ε = 0.2,
    β = 0.001 (k3 KL to the starting weights), temperature 1.0, 64 prompts per step, lr 1e-6. TRL's own
    defaults differ (`loss_type="dapo"`, `beta=0.0`, linear LR decay, bf16 autocast, gradient
    checkpointing); every one of those is set explicitly from these fields.

    Presets: `GRPORunConfig.preset("tiny", **overrides)` for the bundled tiny model, see `PRESETS`.
    """

    model: str = "tiny"  # base model spec (tiny, HF dir, run dir, .gguf, hub id); architecture for .pt init_from
    init_from: str | None = None  # start (and KL reference) weights: checkpoint, run dir or .pt/.safetensors; None = model
    task: str = "arith"  # task name (deltalens.tasks.get_task)
    data: str | None = None  # jsonl file/directory for the gsm8k and jsonl tasks
    question_field: str = "question"  # jsonl task: question field
    answer_field: str = "answer"  # jsonl task: answer field
    num_generations: int = 8  # G: completions sampled per prompt (the group)
    prompts_per_step: int = 64  # P: prompts per optimizer step (P·G completions per step)
    learning_rate: float = 1e-6  # AdamW learning rate
    lr_scheduler: str = "constant"  # constant, constant_with_warmup, linear or cosine (TRL default: linear)
    warmup_steps: int = 0  # LR warmup steps
    beta: float = 1e-3  # β: KL coefficient (k3 estimator, reference = starting weights); 0 = no reference model
    epsilon: float = 0.2  # ε: clipping range of the importance ratio
    epsilon_high: float | None = None  # upper clipping range (None = epsilon; DAPO uses 0.28)
    loss_type: str = "grpo"  # grpo (per-sequence length mean), dr_grpo, dapo (TRL default), bnpo
    scale_rewards: str = "group"  # advantage scaling: group (GRPO), batch, none (Dr. GRPO)
    num_iterations: int = 1  # μ: optimizer steps per generation batch (>1 reuses completions, clipping active)
    temperature: float = 1.0  # sampling temperature of the training completions
    top_p: float = 1.0  # nucleus sampling of the training completions
    max_new_tokens: int | None = None  # completion length limit (None: the task's)
    micro_batch_size: int | None = None  # completions per forward/backward (None: all P·G at once); P·G % it == 0
    max_grad_norm: float = 1.0  # gradient clipping (0 = off)
    weight_decay: float = 0.0  # AdamW weight decay
    dtype: str = "fp32"  # weight dtype: fp32, bf16 (bf16 weights + autocast) or fp16 (fp32 master + fp16 autocast, GPU)
    autocast: str | None = None  # mixed precision override: none, bf16 or fp16 (None: implied by dtype)
    gradient_checkpointing: bool = False  # recompute activations in backward (saves memory; TRL default: True)
    chat_template: bool = False  # wrap prompts as a user message and apply the tokenizer's chat template
    steps: int = 100  # optimizer steps (total, also on resume)
    eval_every: int = 10  # held-out greedy Pass@1 every k steps and at the end (0 = never)
    eval_limit: int = 64  # number of held-out test problems in that evaluation
    save_every: int = 10  # HF checkpoint (+ optimizer state) every k steps (0 = only the final one)
    seed: int = 0  # run seed: prompts and sampling are functions of (seed, step)
    save_pt: bool = False  # also write a plain state dict (.pt) beside each checkpoint
    device: str = "cpu"  # cpu, or cuda (Trainer places the model; multi-GPU via `accelerate launch`)
    use_vllm: bool = False  # generate with vLLM (GPU only; TRL's use_vllm)
    vllm_mode: str = "colocate"  # colocate (vLLM on the training GPUs) or server (`trl vllm-serve`)

    # fields that decide the trajectory: a resumed run must keep them (the others may change)
    TRAJECTORY = ("model", "init_from", "task", "data", "question_field", "answer_field", "num_generations",
                  "prompts_per_step", "learning_rate", "lr_scheduler", "warmup_steps", "beta", "epsilon",
                  "epsilon_high", "loss_type", "scale_rewards", "num_iterations", "temperature", "top_p",
                  "max_new_tokens", "micro_batch_size", "max_grad_norm", "weight_decay", "dtype", "autocast",
                  "chat_template", "seed")

    def __post_init__(self):
        def finite(x):
            return isinstance(x, (int, float)) and math.isfinite(x)

        total = self.prompts_per_step * self.num_generations if (
            isinstance(self.prompts_per_step, int) and isinstance(self.num_generations, int)) else 0
        mu = self.num_iterations
        checks = [
            (self.num_generations >= 2, (f"num_generations must be >= 2: GRPO normalises rewards within a group "
                                        f"(got {self.num_generations}); set --num-generations")),
            (self.prompts_per_step >= 1, f"prompts_per_step must be >= 1 (got {self.prompts_per_step}); set --prompts"),
            (finite(self.learning_rate) and self.learning_rate > 0,
             f"learning_rate must be > 0 (got {self.learning_rate}); set --lr"),
            (self.lr_scheduler in LR_SCHEDULERS,
             f"lr_scheduler must be one of {', '.join(LR_SCHEDULERS)} (got {self.lr_scheduler!r})"),
            (self.warmup_steps >= 0, f"warmup_steps must be >= 0 (got {self.warmup_steps})"),
            (finite(self.beta) and self.beta >= 0, f"beta must be >= 0 (got {self.beta}); 0 drops the KL term"),
            (finite(self.epsilon) and self.epsilon > 0, f"epsilon must be > 0 (got {self.epsilon}); set --epsilon"),
            (self.epsilon_high is None or (finite(self.epsilon_high) and self.epsilon_high > 0),
             f"epsilon_high must be > 0 or unset (got {self.epsilon_high})"),
            (self.loss_type in LOSS_TYPES, f"loss_type must be one of {', '.join(LOSS_TYPES)} (got {self.loss_type!r})"),
            (self.scale_rewards in SCALE_REWARDS,
             f"scale_rewards must be one of {', '.join(SCALE_REWARDS)} (got {self.scale_rewards!r})"),
            (mu >= 1, f"num_iterations must be >= 1 (got {mu})"),
            (mu <= 1 or (self.steps % mu == 0 and self.save_every % mu == 0),
             (f"with num_iterations={mu}, steps ({self.steps}) and save_every ({self.save_every}) must be multiples "
             f"of it (a checkpoint must fall on a generation boundary)")),
            (finite(self.temperature) and self.temperature > 0,
             f"temperature must be > 0 (got {self.temperature}): GRPO needs sampled, varied completions"),
            (finite(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1] (got {self.top_p})"),
            (self.max_new_tokens is None or self.max_new_tokens >= 1,
             f"max_new_tokens must be >= 1 (got {self.max_new_tokens}); set --max-new-tokens"),
            (self.micro_batch_size is None or (self.micro_batch_size >= 1 and total % self.micro_batch_size == 0),
             (f"micro_batch_size ({self.micro_batch_size}) must divide prompts_per_step x num_generations ({total}); "
             "set --micro-batch to a divisor")),
            (finite(self.max_grad_norm) and self.max_grad_norm >= 0, f"max_grad_norm must be >= 0 (got {self.max_grad_norm})"),
            (finite(self.weight_decay) and self.weight_decay >= 0, f"weight_decay must be >= 0 (got {self.weight_decay})"),
            (self.dtype in ("fp32", "bf16", "fp16"), f"dtype must be fp32, bf16 or fp16 (got {self.dtype!r})"),
            (self.autocast in (None, "none", "bf16", "fp16"),
             f"autocast must be none, bf16 or fp16 (got {self.autocast!r})"),
            (not (self.dtype == "bf16" and self.autocast == "fp16"),
             "dtype bf16 cannot use fp16 autocast; use autocast bf16 or none"),
            (self.steps >= 1, f"steps must be >= 1 (got {self.steps}); set --steps"),
            (self.eval_every >= 0, f"eval_every must be >= 0 (got {self.eval_every}); 0 disables evaluation"),
            (self.eval_limit >= 1, f"eval_limit must be >= 1 (got {self.eval_limit}); set --eval-limit"),
            (self.save_every >= 0, f"save_every must be >= 0 (got {self.save_every}); 0 saves only the final weights"),
            (self.device in ("cpu", "cuda"), f"device must be cpu or cuda (got {self.device!r})"),
            (not self.use_vllm or self.device == "cuda", "use_vllm needs --device cuda (vLLM does not run on CPU)"),
            (self.vllm_mode in ("colocate", "server"), f"vllm_mode must be colocate or server (got {self.vllm_mode!r})"),
            (self.mixed_precision != "fp16" or self.device == "cuda",
             "fp16 training (dtype fp16 or autocast fp16) needs a GPU (--device cuda); on CPU use fp32 or bf16"),
        ]
        for ok, message in checks:
            if not ok:
                raise DeltalensError(message)

    @property
    def mixed_precision(self) -> str:
        """The autocast dtype Trainer runs under: none, bf16 or fp16."""
        if self.autocast is not None:
            return self.autocast
        return {"bf16": "bf16", "fp16": "fp16"}.get(self.dtype, "none")

    @property
    def load_dtype(self) -> str:
        """The dtype the weights are loaded, trained and saved in (fp16 trains fp32 master weights)."""
        return "fp32" if self.dtype == "fp16" else self.dtype

    @property
    def completions_per_step(self) -> int:
        return self.prompts_per_step * self.num_generations

    @classmethod
    def preset(cls, name: str, **overrides) -> GRPORunConfig:
        """A named preset (`paper` = the defaults, `tiny` = for the bundled tiny model) plus overrides."""
        if name not in PRESETS:
            raise DeltalensError(f"unknown GRPO preset {name!r}; use one of {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    @classmethod
    def from_dict(cls, d: dict) -> GRPORunConfig:
        """Rebuild from a run's config.json (ignores the run-level keys `method` and `deltalens_version`)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names - {"method", "deltalens_version"})
        if unknown:
            raise DeltalensError(f"config has unknown GRPO fields {unknown}; was it written by another method?")
        if d.get("method", "grpo") != "grpo":
            raise DeltalensError(f"this run was made with method {d.get('method')!r}, not grpo")
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_dict(self) -> dict:
        return {"method": "grpo", **asdict(self)}


# `tiny`: for the 0.76M-parameter bundled model on CPU. P = 8 prompts x G = 8 completions per step
# (~1 s/step on one core) instead of the paper's 64 x 8; β, ε, temperature and the loss stay the
# paper's (the paper's lr 1e-6 barely moves this model in hundreds of steps). Chosen by held-out
# sampled Pass@1 (T = 0.6, 8 samples on the first 200 test problems, which training never sees), not by
# training reward, starting from a TRL prototype (0.66M model: lr 5e-5 for 60 steps raised Pass@1
# 0.58 -> 0.63, lr 1e-4 for 300 steps collapsed it). Sweep on the bundled model (base Pass@1 0.264,
# Pass@8 0.685), Pass@1 / Pass@8 at steps 50/100/150/200:
#   lr 5e-5, P 8:   0.353/0.730  0.418/0.775  0.438/0.770  0.492/0.775   (300: 0.507/0.790, 400: 0.493/0.760)
#   lr 1e-4, P 8:   0.375/0.710  0.377/0.705  0.343/0.620  0.429/0.710   unstable, Pass@8 below base at 150
#   lr 5e-5, P 16:  steps 25/50/75/100 (same prompts seen): 0.349/0.770  0.397/0.790  0.444/0.820  0.471/0.815
# On a less trained snapshot (SFT step 500, base 0.144/0.565) lr 2e-5 gained +0.02 in 200 steps, 5e-5
# +0.02, and 1e-4 lowered both Pass@1 and Pass@8. So: lr 5e-5, 200 steps (Pass@1 has plateaued by
# 200-300 steps; Pass@8 rises and then stays flat).
# Measured with that preset (`deltalens train --method grpo --model tiny`, 2.7 CPU-minutes on one core),
# `deltalens eval` 200 test problems x 32 samples, T = 0.6: Pass@1/16/32 0.275/0.788/0.855 (base) ->
# 0.498/0.840/0.880, Maj@32 0.365 -> 0.590.
PRESETS: dict[str, dict] = {
    "paper": {},
    "tiny": {"learning_rate": 5e-5, "prompts_per_step": 8, "num_generations": 8, "steps": 200,
             "eval_every": 20, "save_every": 20},
}


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


def make_task(config: GRPORunConfig):
    from deltalens.tasks import get_task

    return get_task(config.task, data=config.data, question_field=config.question_field,
                    answer_field=config.answer_field)


def build_dataset(task, config: GRPORunConfig, first_step: int, last_step: int):
    """A `datasets.Dataset` with the prompts of steps first_step..last_step, in order.

    Columns: prompt (text, or a one-message conversation with chat_template), answer, and the task's
    extra columns (`problem_columns`, e.g. countdown's numbers), which TRL passes to the reward function.
    With num_iterations = μ > 1 one generation serves μ steps, so only every μ-th step draws prompts.
    """
    from datasets import Dataset

    from deltalens.tasks import problem_columns

    mu = config.num_iterations
    problems = []
    for step in range(first_step, last_step + 1, mu):
        problems.extend(step_problems(task, config.seed, step, config.prompts_per_step))
    prompts = [p.prompt for p in problems]
    if config.chat_template:
        prompts = [[{"role": "user", "content": p}] for p in prompts]
    return Dataset.from_dict({"prompt": prompts, **problem_columns(problems)})


class RewardRecorder:
    """Wraps a TRL-style reward function and keeps the rewards of the current step (TRL logs only their
    mean and std; the metrics rows also want min/max and the fraction correct)."""

    def __init__(self, fn: Callable[..., list[float]]):
        self.fn, self.rewards = fn, []

        def reward(*args, **kwargs):
            out = fn(*args, **kwargs)
            self.rewards.extend(float(r) for r in out if r is not None)
            return out

        reward.__name__ = getattr(fn, "__name__", "reward")
        self.reward = reward

    def take(self) -> list[float]:
        out, self.rewards = self.rewards, []
        return out


# ----------------------------------------------------------------------------------------------
# TRL glue


def trl_args(config: GRPORunConfig, output_dir: str | Path, world_size: int | None = None):
    """TRL's `GRPOConfig` for `config`: every setting whose TRL default differs is set explicitly."""
    try:
        from trl import GRPOConfig
    except ImportError as e:
        raise DeltalensError("GRPO needs TRL: pip install 'deltalens[trl]' (trl and datasets)") from e
    world = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    total = config.completions_per_step
    micro = config.micro_batch_size or total // world
    if total % (micro * world):
        raise DeltalensError(f"prompts_per_step x num_generations ({total}) must be a multiple of micro_batch_size "
                             f"({micro}) x processes ({world}); change --micro-batch or --prompts")
    accum = total // (micro * world)
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
    return GRPOConfig(**kwargs)


def _checkpointing_arg(on: bool) -> dict:
    """transformers 5 renamed gradient_checkpointing to activation_checkpointing (the old name warns)."""
    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return {"activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing": on}


def _trainer_class():
    from trl import GRPOTrainer

    class DeltalensGRPOTrainer(GRPOTrainer):
        """GRPOTrainer with two hooks: the LR schedule spans the whole run (also when resuming with fewer
        steps left), and sampling is reseeded from (seed, step) before every generation."""

        step_offset = 0  # steps done before this trainer started (resume)
        total_steps = 0
        run_seed = 0

        def create_scheduler(self, num_training_steps, optimizer=None):
            return super().create_scheduler(self.total_steps or num_training_steps, optimizer)

        def _generate_and_score_completions(self, inputs):
            if self.model.training:
                torch.manual_seed(step_seed(self.run_seed, self.step_offset + self.state.global_step + 1))
            return super()._generate_and_score_completions(inputs)

    return DeltalensGRPOTrainer


def _trainer_state_path(run, name: str) -> Path:
    return run.ckpt / f"{name}.trainer.pt"


def save_trainer_state(path: Path, optimizer, scheduler, step: int) -> None:
    """Optimizer + LR-scheduler state of a checkpoint (torch.save, atomic; tensors, numbers, lists only,
    so `torch.load(weights_only=True)` reads it back)."""
    from deltalens.checkpoint import atomic_path

    obj = {"format": 1, "step": step, "optimizer": optimizer.state_dict(),
           "scheduler": scheduler.state_dict() if scheduler is not None else None}
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)


def load_trainer_state(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise DeltalensError(f"{path} is missing: this checkpoint has no optimizer state, so the run cannot be "
                             "resumed exactly; start a new run with --init-from on that checkpoint") from None
    except Exception as e:
        raise DeltalensError(f"cannot read optimizer state {path} ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:160]}); it is corrupt: restore it or start a new run") from e


def held_out_pass_at_1(model, tok, task, config: GRPORunConfig) -> dict:
    """Greedy Pass@1 on the first `eval_limit` test problems (the same measure ES logs)."""
    from deltalens.evaluation import evaluate
    from deltalens.generation import HFBackend

    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    try:
        r = evaluate(model, tok, task, samples=1, ks=[1], temperature=0.0, limit=config.eval_limit,
                     max_new_tokens=config.max_new_tokens or task.max_new_tokens,
                     backend=HFBackend(model, tok, chat_template=config.chat_template))
    finally:
        model.train(was_training)
    return {"pass_at_1": r["pass_at_k"]["1"], "mean_reward": r["mean_reward"], "n_problems": r["n_problems"],
            "eval_s": round(time.perf_counter() - t0, 3)}


def _num(v):
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return None if isinstance(v, float) and not math.isfinite(v) else v
    return None


def metrics_row(step: int, logs: dict, rewards: list[float], config: GRPORunConfig, iteration_s: float) -> dict:
    """One metrics.jsonl row from TRL's log of a step (+ our recorded rewards)."""
    from deltalens.budget import grpo_units
    from deltalens.tasks import CORRECT

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
        "trl": {k: _num(v) for k, v in logs.items() if _num(v) is not None},
    }


def _run_callback_class():
    from transformers import TrainerCallback

    class RunCallback(TrainerCallback):
        """Turns TRL's per-step logs into metrics rows, evaluations, checkpoints and progress calls."""

        def __init__(self, run, config, task, tok, start, recorder, progress, resume_state):
            self.run, self.config, self.task, self.tok = run, config, task, tok
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
            row = metrics_row(step, logs, self.recorder.take(), cfg, time.perf_counter() - self.t_last)
            if not state.is_world_process_zero:
                return
            m = self._model(model)
            if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
                row["eval"] = held_out_pass_at_1(m, self.tok, self.task, cfg)
            self.run.log(row)
            name = "final" if step == cfg.steps else (
                f"iter-{step:06d}" if cfg.save_every and step % cfg.save_every == 0 else None)
            if name is not None:
                save_trainer_state(_trainer_state_path(self.run, name), optimizer, lr_scheduler, step)
                _save_weights(self.run, m, self.tok, name, {"method": "grpo", "iteration": step, "seed": cfg.seed},
                              cfg.save_pt)
            if self.progress:
                self.progress(step, cfg.steps, row)
            self.t_last = time.perf_counter()

    return RunCallback


def _save_weights(run, model, tok, name: str, state: dict, save_pt: bool) -> None:
    """RunDir.save with the model's config as it was loaded (TRL turns use_cache off under gradient
    checkpointing; a checkpoint should generate with a KV cache)."""
    use_cache = getattr(model.config, "use_cache", None)
    try:
        if use_cache is False:
            model.config.use_cache = True
        run.save(model, tok, name, state, save_pt=save_pt)
    finally:
        if use_cache is not None:
            model.config.use_cache = use_cache


def _start_model(config: GRPORunConfig):
    """(model, tokenizer, kind, location) of the starting weights: init_from, else model."""
    from deltalens.models import load_model, resolve

    spec = config.init_from or config.model
    kind, loc = resolve(spec)
    if kind == "weights":
        model, tok = load_model(spec, config=config.model, dtype=config.load_dtype)
    else:
        model, tok = load_model(spec, dtype=config.load_dtype)
    return model, tok, kind, loc


def _reference_dir(run, config: GRPORunConfig, kind: str, loc, start: tuple | None) -> str:
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
        from deltalens.checkpoint import atomic_dir

        with atomic_dir(ref) as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            tok.save_pretrained(tmp)
    return str(ref)


def _check_resume(stored: GRPORunConfig, given: GRPORunConfig, run_dir: Path) -> None:
    diff = [f for f in GRPORunConfig.TRAJECTORY if getattr(stored, f) != getattr(given, f)]
    if stored.steps != given.steps and stored.lr_scheduler not in _STEP_FREE_SCHEDULERS:
        diff.append("steps")
    if diff:
        pairs = ", ".join(f"{f}: run has {getattr(stored, f)!r}, given {getattr(given, f)!r}" for f in diff)
        raise DeltalensError(f"cannot resume {run_dir} with different settings ({pairs}); "
                             "resume with the run's settings or start a new run with --out")


def train_grpo(config: GRPORunConfig, out: str | Path, resume: bool = False,
               progress: Callable[[int, int, dict | None], None] | None = None, *,
               overwrite: bool = False) -> Path:
    """Run (or resume) GRPO through TRL into the run directory `out`; returns its path.

    progress(done, total, row) is called once before the first step (row None) and after every step with
    its metrics row (reward_mean, reward_max, timing.iteration_s, eval...). With `resume`, the run
    continues from its last checkpoint (weights + optimizer state) and ends as an uninterrupted run would;
    only non-trajectory settings (steps with a constant LR, eval/save cadence, save_pt, device) may change.
    """
    from deltalens import __version__
    from deltalens.models import load_model
    from deltalens.runs import RunDir

    try:
        import datasets  # noqa: F401
        import trl  # noqa: F401
    except ImportError as e:
        raise DeltalensError("GRPO needs TRL: pip install 'deltalens[trl]' (trl and datasets)") from e

    run = RunDir(out)
    main = int(os.environ.get("RANK", "0")) == 0  # under `accelerate launch` only rank 0 writes the run
    state = None
    if resume:
        if not (run.path / "config.json").exists():
            raise DeltalensError(f"nothing to resume in {run.path} (no config.json); drop --resume to start a run")
        _check_resume(GRPORunConfig.from_dict(run.config()), config, run.path)
        state = run.state()
        from deltalens.checkpoint import write_json_atomic

        if main:
            write_json_atomic({**config.to_dict(), "deltalens_version": __version__}, run.path / "config.json")
    elif main:
        run.create({**config.to_dict(), "deltalens_version": __version__}, overwrite=overwrite)

    latest = run.latest() if state else None
    start = state["iteration"] if state and latest is not None else 0
    if main:
        run.truncate_metrics(start if start > 0 else -1)
    if start >= config.steps:
        if start > config.steps:
            raise DeltalensError(f"{run.path} already has {start} steps; pass --steps > {start}")
        return run.path

    resume_state = None
    if start > 0:
        resume_state = load_trainer_state(_trainer_state_path(run, latest.name))
        if resume_state.get("step") != start:
            raise DeltalensError(f"optimizer state of {latest} is for step {resume_state.get('step')}, "
                                 f"state.json says {start}; the run directory is inconsistent")
        from deltalens.models import resolve

        kind, loc = resolve(config.init_from or config.model)
        ref_dir = _reference_dir(run, config, kind, loc, None) if config.beta > 0 else None
        model, tok = load_model(str(latest), dtype=config.load_dtype)
    else:
        model, tok, kind, loc = _start_model(config)
        ref_dir = _reference_dir(run, config, kind, loc, (model, tok)) if config.beta > 0 else None
    if ref_dir is not None:
        model.config._name_or_path = ref_dir  # TRL builds the reference with from_pretrained(this)
    task = make_task(config)
    max_new = config.max_new_tokens or task.max_new_tokens

    out_trl = run.path / ".trl"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"(transformers|trl)\b")
        args = trl_args(config, out_trl)
    args.max_completion_length = max_new
    args.max_steps = config.steps - start
    recorder = RewardRecorder(task.reward_fn())
    callback = _run_callback_class()(run, config, task, tok, start, recorder, progress, resume_state)

    model.train()
    if start == 0 and config.eval_every and main:
        run.log({"iteration": 0, "units": 0, "eval": held_out_pass_at_1(model, tok, task, config)})
    dataset = build_dataset(task, config, start + 1, config.steps)

    from transformers import PrinterCallback, ProgressCallback

    with warnings.catch_warnings():
        # transformers/TRL deprecation notices about their own internals: nothing a user can act on
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"(transformers|trl)\b")
        trainer = _trainer_class()(model=model, reward_funcs=recorder.reward, args=args, train_dataset=dataset,
                                   processing_class=tok, callbacks=[callback])
        trainer.step_offset, trainer.total_steps, trainer.run_seed = start, config.steps, config.seed
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


# ----------------------------------------------------------------------------------------------
# CLI adapter (cli/train.py METHODS["grpo"])


# GRPORunConfig field -> `deltalens train` option (opts key): options only GRPO has ...
GRPO_ONLY_CLI = {"init_from": "init_from", "num_generations": "num_generations", "learning_rate": "lr",
                 "lr_scheduler": "lr_scheduler", "beta": "beta", "epsilon": "epsilon", "loss_type": "loss_type",
                 "micro_batch_size": "micro_batch", "autocast": "autocast", "device": "device",
                 "use_vllm": "use_vllm", "gradient_checkpointing": "gradient_checkpointing"}
# ... and all of them, including those ES shares (--steps/--iterations and --budget are handled apart)
CLI_FIELDS = {"model": "model", "task": "task", "data": "data", "question_field": "question_field",
              "answer_field": "answer_field", "prompts_per_step": "prompts", "temperature": "temperature",
              "max_new_tokens": "max_new_tokens", "dtype": "dtype", "eval_every": "eval_every",
              "eval_limit": "eval_limit", "save_every": "checkpoint_every", "seed": "seed", "save_pt": "save_pt",
              **GRPO_ONLY_CLI}


def cli_fields(opts: dict) -> dict:
    """GRPORunConfig fields from the `deltalens train` options that were given (None = not given)."""
    given = {f: opts[o] for f, o in CLI_FIELDS.items() if opts.get(o) is not None}
    steps = opts.get("steps") if opts.get("steps") is not None else opts.get("iterations")
    if steps is not None:
        given["steps"] = steps
    return given


def auto_preset(preset: str | None, model: str | None) -> str:
    preset = preset or "auto"
    if preset == "auto":
        return "tiny" if (model or "tiny") == "tiny" else "paper"
    return preset


def train_cli(opts: dict, progress) -> Path:
    """`deltalens train --method grpo`: a GRPORunConfig from the preset + the options given (or from the
    run being resumed); `--budget B` sets the steps to the most that fit in B units (deltalens.budget)."""
    from deltalens.budget import steps_for_budget
    from deltalens.runs import RunDir

    given = cli_fields(opts)
    if opts.get("resume") is not None:
        stored = GRPORunConfig.from_dict(RunDir(opts["out"]).config()).to_dict()
        stored.pop("method")
        stored.pop("deltalens_version", None)
        config = GRPORunConfig(**{**stored, **given})
        return train_grpo(config, opts["out"], resume=True, progress=progress)
    config = GRPORunConfig.preset(auto_preset(opts.get("preset"), given.get("model")), **given)
    if opts.get("budget") is not None:
        if "steps" in given:
            raise DeltalensError("pass either --budget or --steps/--iterations, not both")
        config = dataclasses.replace(config, steps=steps_for_budget(
            opts["budget"], config.prompts_per_step, config.num_generations))
    return train_grpo(config, opts["out"], resume=False, progress=progress, overwrite=bool(opts.get("overwrite")))
