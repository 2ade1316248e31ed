"""`GRPOConfig`: every hyperparameter of a GRPO run, one help line each (defaults are the paper's).

Defaults are arXiv 2608.27351's: group size G = 8, `loss_type="grpo"`, ε = 0.2, β = 0.001 (k3 KL to the
starting weights), temperature 1.0, 64 prompts per step, lr 1e-6. TRL's own defaults differ
(`loss_type="dapo"`, `beta=0.0`, linear LR decay, bf16 autocast, gradient checkpointing); every one of
those is set explicitly from these fields (`deltalens.training.grpo.train.trl_args`). The fields are the
single source of `deltalens train grpo` options, YAML keys and config.json. Presets: `paper` and `tiny`
(how it was chosen: docs/tuning.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from deltalens.config import Config, check, finite, option
from deltalens.generation.dtype import COMPUTE_DTYPES
from deltalens.generation.prompts import check_mode
from deltalens.training.budget import parse_budget, steps_for_budget
from deltalens.training.tracking import HELP as REPORT_TO_HELP
from deltalens.training.tracking import normalize_report_to

LR_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine")
STEP_FREE_SCHEDULERS = ("constant", "constant_with_warmup")  # LR independent of the total steps
LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")
SCALE_REWARDS = ("group", "batch", "none")
DEFAULT_STEPS = 100


# the `smollm2` GRPO preset (see GRPOConfig.PRESETS; `qwen2.5` is it with lr 1e-6); micro-batches of at
# most 8 (since 2026-12-06): the same step up to float rounding, peak RSS 10.3 GB against 21.9 GB with all 32
# completions back-propped at once, at the same step time (benchmarks/README.md, "bench_grpo.py")
SMOLLM2_PRESET = {"learning_rate": 1e-5, "prompts_per_step": 4, "num_generations": 8, "max_micro_batch": 8,
                  "eval_every": 10, "eval_limit": 100, "save_every": 10}


@dataclass
class GRPOConfig(Config):
    """Hyperparameters of a GRPO run (TRL GRPOConfig style: one help line per field)."""

    METHOD: ClassVar[str] = "grpo"
    NAME: ClassVar[str] = "GRPO"
    COUNT: ClassVar[str] = "steps"

    model: str = option("tiny", "base model spec (tiny, smollm2, HF dir, run dir, .gguf, hub id); the "
                        "architecture for a bare-weights --init-from", trajectory=True)
    init_from: str | None = option(None, "start (and KL reference) weights: checkpoint, run dir or "
                                   ".pt/.safetensors (default: --model)", trajectory=True)
    task: str = option("arith", "task name (deltalens.tasks)", flags=("-t",), trajectory=True)
    data: str | None = option(None, "jsonl file or directory for the gsm8k and jsonl tasks", trajectory=True)
    question_field: str = option("question", "jsonl task: question field", trajectory=True)
    answer_field: str = option("answer", "jsonl task: answer field", trajectory=True)
    num_generations: int = option(8, "G: completions sampled per prompt (the group)", flags=("-G",),
                                  trajectory=True)
    prompts_per_step: int = option(64, "P: prompts per optimizer step (P·G completions per step)",
                                   flags=("--prompts",), trajectory=True)
    learning_rate: float = option(1e-6, "AdamW learning rate", flags=("--lr",), trajectory=True)
    lr_scheduler: str = option("constant", "constant, constant_with_warmup, linear or cosine (TRL default: linear)",
                               trajectory=True)
    warmup_steps: int = option(0, "LR warmup steps", trajectory=True,
                               needs=("lr_scheduler", ("constant_with_warmup", "linear", "cosine")))
    beta: float = option(1e-3, "β: KL coefficient (k3 estimator, reference = starting weights); 0 = no "
                         "reference model", trajectory=True)
    epsilon: float = option(0.2, "ε: clipping range of the importance ratio", trajectory=True)
    epsilon_high: float | None = option(None, "upper clipping range (default: epsilon; DAPO uses 0.28)",
                                        trajectory=True)
    loss_type: str = option("grpo", "grpo (per-sequence length mean), dr_grpo, dapo (TRL default), bnpo",
                            trajectory=True)
    scale_rewards: str = option("group", "advantage scaling: group (GRPO), batch, none (Dr. GRPO)", trajectory=True)
    num_iterations: int = option(1, "μ: optimizer steps per generation batch (>1 reuses completions, clipping "
                                 "active)", trajectory=True)
    temperature: float = option(1.0, "sampling temperature of the training completions", trajectory=True)
    top_p: float = option(1.0, "nucleus sampling of the training completions", trajectory=True)
    max_new_tokens: int | None = option(None, "completion length limit (default: the task's)", trajectory=True)
    micro_batch_size: int | None = option(None, "completions per forward/backward (default: all P·G at once); "
                                          "must divide P·G", flags=("--micro-batch",), trajectory=True)
    max_micro_batch: int | None = option(None, "without --micro-batch: at most this many completions per "
                                         "forward/backward, the largest divisor of P·G / processes not above it "
                                         "(memory; the smollm2 and qwen2.5 presets: 8); not applied with loss_type "
                                         "bnpo, whose per-micro-batch token mean would change the step",
                                         needs=("micro_batch_size", (None,)), trajectory=True)
    max_grad_norm: float = option(1.0, "gradient clipping (0 = off)", trajectory=True)
    weight_decay: float = option(0.0, "AdamW weight decay", trajectory=True)
    dtype: str = option("fp32", "weight dtype: fp32, bf16 (bf16 weights + autocast) or fp16 (fp32 master + "
                        "fp16 autocast, GPU)", trajectory=True)
    autocast: str | None = option(None, "mixed precision override: none, bf16 or fp16 (default: implied by "
                                  "dtype)", trajectory=True)
    compute_dtype: str = option("auto", "dtype the training completions are sampled in: fp32 (TRL's own generate on "
                                "the policy), bf16 (deltalens's HF backend on a bf16 copy of the fp32 policy, "
                                "refreshed every step; the loss, gradients and update stay fp32), auto (bf16 where bf16 "
                                "matmuls are fast, a CPU with AMX-BF16 or AVX512-BF16 or a bf16 GPU, for hidden size "
                                ">= 512; else fp32)", trajectory=True)
    gradient_checkpointing: bool = option(False, "recompute activations in backward (saves memory, costs "
                                          "time; TRL default: on; the qwen2.5 preset: on)")
    chat_template: str | bool = option("auto", "prompts through the tokenizer's chat template: auto (when it has "
                                       "one), on, off", trajectory=True)
    steps: int | None = option(None, f"optimizer steps, total also on resume (default {DEFAULT_STEPS}, or from "
                               "--budget)")
    budget: float | str | None = option(None, "FLOP-matched compute units (e.g. 2e6, 1.5M): steps = the most that "
                                        "fit, 8·G·P units each (deltalens.training.budget)")
    eval_every: int = option(10, "greedy Pass@1 on validation problems every k steps and at the end (0 = never)")
    eval_limit: int = option(64, "number of validation problems in that evaluation")
    save_every: int = option(10, "HF checkpoint (+ optimizer state) every k steps (0 = only the final one)",
                             flags=("--checkpoint-every",))
    keep_optimizer_states: bool = option(False, "keep the optimizer state of every checkpoint (twice the weights' "
                                         "size each: 4.7 GB on qwen2.5-0.5b); by default only the latest, the one a "
                                         "resume reads, is kept")
    keep_checkpoints: bool = option(True, "keep every intermediate checkpoint (iter-N); --no-keep-checkpoints keeps only "
                                   "the latest, the one a resume reads, and after the last step only final (2.4 GB "
                                   "each on qwen2.5-0.5b)")
    seed: int = option(0, "run seed: prompts and sampling are functions of (seed, step)", trajectory=True)
    save_pt: bool = option(False, "also write a plain state dict (.pt) beside each checkpoint")
    report_to: str = option("none", REPORT_TO_HELP)
    device: str = option("cpu", "cpu, or cuda (Trainer places the model; multi-GPU via `accelerate launch`)")
    use_vllm: bool = option(False, "generate with vLLM (GPU only; TRL's use_vllm)")
    vllm_mode: str = option("colocate", "colocate (vLLM on the training GPUs) or server (`trl vllm-serve`)",
                            needs=("use_vllm", (True,)))

    PRESETS: ClassVar[dict[str, dict]] = {
        "paper": {},
        # SmolLM2-135M-Instruct (`smollm2`): lr 10x the paper's for CPU-sized runs (P=4 prompts x G=8);
        # checked on validation problems: docs/tuning.md
        "smollm2": SMOLLM2_PRESET,
        # Qwen2.5-Coder-0.5B-Instruct (`qwen2.5-0.5b`): `smollm2`'s with lr scaled to Qwen's ~10x smaller weights
        # (AdamW moves each weight by ~lr, so the same lr is a ~10x larger relative step): 1e-6, the paper's. At
        # smollm2's 1e-5 one step took KL to 0.31 and training accuracy from 0.22 to 0; at 1e-6, 5 steps raised
        # greedy validation Pass@1 0.45 -> 0.65 (docs/tuning.md, "GRPO on Qwen2.5-Coder-0.5B-Instruct").
        # Activations recomputed in backward (since 2026-12-07): a step's peak RSS 17.3 GB against 20.9 GB,
        # its loss pass ~7% slower, the same rewards (docs/tuning.md, "GRPO memory on Qwen2.5-Coder-0.5B-
        # Instruct"); without it the study's GRPO peaked at 23.5 GB and one sitting was OOM-killed at 24.3 GB
        "qwen2.5": {**SMOLLM2_PRESET, "learning_rate": 1e-6, "gradient_checkpointing": True},
        # for the bundled tiny model; chosen on test problems (no validation split then), re-checked on validation
        # with `deltalens sweep` (2026-12-01: best of lr 2e-5, 5e-5, 1e-4): docs/tuning.md
        "tiny": {"learning_rate": 5e-5, "prompts_per_step": 8, "num_generations": 8, "steps": 200,
                 "eval_every": 20, "save_every": 20},
    }

    def __post_init__(self):
        self.chat_template = check_mode(self.chat_template)  # old runs stored true/false: on/off
        self.report_to = normalize_report_to(self.report_to)
        self._resolve_steps()
        total = self.prompts_per_step * self.num_generations if (
            isinstance(self.prompts_per_step, int) and isinstance(self.num_generations, int)) else 0
        mu = self.num_iterations
        check([
            (self.seed >= 0, f"seed must be >= 0 (got {self.seed}); set --seed"),
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
            (self.keep_checkpoints or not self.keep_optimizer_states,
             ("--keep-optimizer-states keeps every checkpoint's optimizer state, --no-keep-checkpoints only the "
              "latest checkpoint: drop one of them")),
            (self.max_micro_batch is None or self.max_micro_batch >= 1,
             f"max_micro_batch must be >= 1 or unset (got {self.max_micro_batch})"),
            (finite(self.max_grad_norm) and self.max_grad_norm >= 0,
             f"max_grad_norm must be >= 0 (got {self.max_grad_norm})"),
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
            (self.compute_dtype in COMPUTE_DTYPES,
             f"compute_dtype must be auto, fp32 or bf16 (got {self.compute_dtype!r}); set --compute-dtype"),
            (self.compute_dtype != "bf16" or self.dtype == "fp32",
             (f"--compute-dtype bf16 with --dtype {self.dtype}: the bf16 rollout copy is of fp32 weights; weights "
              f"loaded in {self.dtype} generate as they are (use --compute-dtype auto)")),
            (self.compute_dtype != "bf16" or not self.use_vllm,
             "--compute-dtype bf16 with --use-vllm: vLLM generates in its own dtype; use --compute-dtype auto"),
            (self.device in ("cpu", "cuda"), f"device must be cpu or cuda (got {self.device!r})"),
            (not self.use_vllm or self.device == "cuda", "use_vllm needs --device cuda (vLLM does not run on CPU)"),
            (self.vllm_mode in ("colocate", "server"), f"vllm_mode must be colocate or server (got {self.vllm_mode!r})"),
            (self.mixed_precision != "fp16" or self.device == "cuda",
             "fp16 training (dtype fp16 or autocast fp16) needs a GPU (--device cuda); on CPU use fp32 or bf16"),
        ])

    def _resolve_steps(self) -> None:
        """steps from the budget (8·G·P units each), else the default; both given must agree."""
        if self.budget is None:
            if self.steps is None:
                self.steps = DEFAULT_STEPS
            return
        self.budget = parse_budget(self.budget)
        n = steps_for_budget(self.budget, self.prompts_per_step, self.num_generations)
        if self.steps is None:
            self.steps = n
        elif self.steps != n:
            check([(False, (f"steps {self.steps} and budget {self.budget:g} disagree (the budget gives {n} steps); "
                           "pass one of --steps or --budget"))])

    def resume_conflicts(self, stored: GRPOConfig) -> list[str]:
        # steps may grow on resume only when the LR schedule does not depend on the total
        return ["steps"] if stored.steps != self.steps and stored.lr_scheduler not in STEP_FREE_SCHEDULERS else []

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
