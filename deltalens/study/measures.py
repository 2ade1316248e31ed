"""A study's measurements of its models, each cached by the content hash of what it depends on.

    evaluations  the base (several sampling seeds) and every run on the test split at each evaluation
                 temperature, the paper's settings (32 samples, T = 0.6): per-problem Pass@k and Maj@k
    diff         the weight diff of every run (rel. L2 from init, top-100 coordinates by |Δ| and |Δ|/|θ0|)
    entropy      token entropy of a model along its own samples (at the verdict temperature)

`Measures` holds what one process shares between measurements: the cache (DIR/cache/<what>-<hash>.json;
a rerun recomputes nothing that is done), each model spec resolved once into a `ModelRef` (`Measures.ref`:
its hash, its loading, the diff and the diversity pass take that reference), the weights hashes, one HF
model in memory at a time, and with
--backend vllm one engine that serves every sampling seed of one model. The backend is decided here, once
(`Measures.vllm`); training, entropy and diversity always run on HF. HF evaluations generate in --compute-dtype
(`Measures.compute_key`: a bf16 result is cached under a key of its own, an fp32 one under the key it always had).

The task functions (`eval_task`, `diff_task`, `entropy_task`; `deltalens.study.plan` puts them in the
graph) take (ctx, cfg, ...) and find their process's `Measures` by (study directory, settings)
(`measures_for`), so consecutive tasks in one process share it as the study always has; their results are
cache paths relative to DIR (`read_result` loads them) or short lists, never large objects.
"""

from __future__ import annotations

import json
from pathlib import Path

from deltalens.analysis.delta import diff_checkpoints
from deltalens.analysis.diversity.sampling import SAMPLER_VERSION
from deltalens.analysis.report import Cache, weights_hash
from deltalens.evaluation import evaluate, evaluate_state_dict
from deltalens.evaluation.passk import pass_at_k
from deltalens.generation.dtype import planned_compute_dtype
from deltalens.io.models import load_model
from deltalens.io.spec import ModelRef, resolve
from deltalens.study.config import StudyConfig
from deltalens.study.executor import TaskContext
from deltalens.study.runs import run_plan
from deltalens.tasks import get_task

SPARSE = "sparse-weights:"  # Measures._engine's key while it computes with a loaded state dict


def uses_vllm(cfg: StudyConfig) -> bool:
    """Whether the Pass@K and sparsity evaluations sample on vLLM (--backend vllm): the one place it is read."""
    return cfg.backend == "vllm"


class Measures:
    """Cached measurements of the study's models (results keyed by content hash in DIR/cache)."""

    def __init__(self, cfg: StudyConfig, out: Path, log=print, progress_factory=None):
        self.cfg, self.log, self.progress_factory = cfg, log, progress_factory
        self.vllm = uses_vllm(cfg)
        # the backend is part of a cache key only when it is not HF, so HF results cached before it existed count
        self.backend_key = {"backend": cfg.backend} if self.vllm else {}
        self.cache = Cache(out / "cache")
        self.task = get_task(cfg.task)
        self.refs: dict[str, ModelRef] = {}
        self.hashes: dict[str, str] = {}
        self._loaded: dict = {}
        self._sparse: dict = {}  # the base model the sparsity evaluations overwrite (evaluate_state_dict's cache)
        self._engine: tuple | None = None  # (spec, vLLM backend): one engine serves all seeds of one model
        self._compute: dict[str, dict] = {}  # spec -> its compute dtype's part of a cache key (`compute_key`)

    def ref(self, spec: str) -> ModelRef:
        """`spec` (the base, or a run directory once trained) resolved once (`deltalens.io.spec.resolve`)."""
        if spec not in self.refs:
            self.refs[spec] = resolve(spec)
        return self.refs[spec]

    def hash(self, spec: str) -> str:
        if spec not in self.hashes:
            self.hashes[spec] = weights_hash(self.ref(spec))
        return self.hashes[spec]

    def model(self, spec: str):
        if spec not in self._loaded:
            self.close_engine()
            self._loaded.clear()  # one model in memory at a time
            self._sparse.clear()
            self._loaded[spec] = load_model(self.ref(spec))
        return self._loaded[spec]

    def close_engine(self) -> None:
        if self._engine is not None:
            self._engine[1].close()
            self._engine = None

    def engine(self, spec: str):
        """The vLLM backend of `spec` (started once; the previous model's engine is closed first)."""
        from deltalens.generation import backend_for_spec

        if self._engine is None or self._engine[0] != spec:
            self.close_engine()
            self._loaded.clear()  # the HF copy is not needed while the engine samples
            self._sparse.clear()
            be, _, _ = backend_for_spec("vllm", spec, chat_template=self.cfg.chat_template)
            self._engine = (spec, be)
        return self._engine[1]

    def compute_key(self, spec: str) -> dict:
        """The HF compute dtype `spec` generates in (--compute-dtype resolved for it, without loading it:
        `planned_compute_dtype`) as part of a cache key: {} for fp32, so that results cached before the option
        existed (all fp32) still count, else {"compute": "bf16"}. vLLM: {} (its dtype is the backend's)."""
        if spec not in self._compute:
            name = "fp32" if self.vllm else planned_compute_dtype(self.ref(spec), self.cfg.compute_dtype)
            self._compute[spec] = {} if name == "fp32" else {"compute": name}
        return self._compute[spec]

    def cached(self, key: str, compute) -> tuple[dict, str]:
        """(value, its file relative to DIR): the cache's entry, computed first when missing."""
        value = self.cache.get_or_compute(key, compute, self.log)
        return value, f"cache/{key}.json"

    def evaluation_key(self, spec: str, seed: int, temperature: float, task=None, samples: int | None = None):
        cfg = self.cfg
        task = task or self.task
        samples = samples or cfg.samples
        ks = [k for k in cfg.k if k <= samples] or [1]
        key = self.cache.key("study-eval", weights=self.hash(spec), task=task.spec, samples=samples, ks=ks,
                             temperature=temperature, limit=cfg.limit, seed=seed, chat=cfg.chat_template,
                             **self.backend_key, **self.compute_key(spec))
        return key, task, samples, ks

    def evaluation(self, spec: str, label: str, seed: int, temperature: float, samples: int | None = None,
                   task=None) -> tuple[dict, str]:
        """The evaluation of `spec` at one sampling seed and temperature, and its cache file."""
        cfg = self.cfg
        key, task, samples, ks = self.evaluation_key(spec, seed, temperature, task, samples)

        def compute():
            n = len(task.test(cfg.limit)) * samples
            prog = self.progress_factory(f"eval {label} on {task.spec} (seed {seed})", n) \
                if self.progress_factory else None
            if self.vllm:
                be = self.engine(spec)
                model, tok = None, be.tok
            else:
                (model, tok), be = self.model(spec), None
            return evaluate(model, tok, task, samples=samples, ks=ks, temperature=temperature,
                            limit=cfg.limit, seed=seed, progress=prog, chat_template=cfg.chat_template, backend=be,
                            compute_dtype=cfg.compute_dtype)

        return self.cached(key, compute)

    def state_dict_pass1(self, base: str, sd: dict, tag: str, seed: int = 0, label: str = "") -> list[float]:
        """Per-problem Pass@1 of `sd` applied onto the base architecture (sparsity evaluations). With
        --backend vllm every state dict is loaded into one engine of the base (`VLLMBackend.load_state_dict`),
        which then no longer serves the base's own evaluations (`self._engine` is marked)."""
        cfg = self.cfg
        temperature = cfg.verdict_temperature
        key = self.cache.key("study-sparse-eval", weights=tag, task=self.task.spec, samples=cfg.sparsify_samples,
                             temperature=temperature, limit=cfg.limit, seed=seed, chat=cfg.chat_template,
                             **self.backend_key, **self.compute_key(base))

        def compute():
            n = len(self.task.test(cfg.limit)) * cfg.sparsify_samples
            prog = self.progress_factory(f"eval {label or tag.split(':')[0]} (Pass@1)", n) \
                if self.progress_factory else None
            be = None
            if self.vllm:
                marked = self._engine is not None and self._engine[0] == SPARSE + base
                be = self._engine[1] if marked else self.engine(base)
                self._engine = (SPARSE + base, be)  # its weights are no longer the base's
            elif not self._sparse:
                self._loaded.clear()  # one model in memory at a time
            # one base (HF model or engine) for the whole sweep: every call overwrites all its weights
            res = evaluate_state_dict(base, sd, self.task, samples=cfg.sparsify_samples, ks=[1],
                                      temperature=temperature, limit=cfg.limit, seed=seed, backend=be,
                                      model_cache=None if be else self._sparse, chat_template=cfg.chat_template,
                                      progress=prog, compute_dtype=cfg.compute_dtype)
            return {"pass1": [r["correct"] / r["n"] for r in res["per_problem"]]}

        return self.cache.get_or_compute(key, compute, self.log)["pass1"]

    def entropy(self, spec: str, label: str = "") -> list[float]:
        from deltalens.analysis.entropy import token_entropy

        cfg = self.cfg
        temperature = cfg.verdict_temperature
        key = self.cache.key("study-entropy", weights=self.hash(spec), task=self.task.spec,
                             prompts=cfg.entropy_prompts, temperature=temperature, chat=cfg.chat_template,
                             sampler=SAMPLER_VERSION)

        def compute():
            model, tok = self.model(spec)
            problems, samples = self.task.test(cfg.entropy_prompts), 4
            bar = self.progress_factory(f"entropy {label or spec} (sampled, then scored)",
                                        2 * len(problems) * samples) if self.progress_factory else None
            return {"entropy": token_entropy(model, tok, problems, samples=samples, temperature=temperature,
                                             max_new_tokens=self.task.max_new_tokens,
                                             chat_template=cfg.chat_template, progress=bar)}

        return self.cache.get_or_compute(key, compute, self.log)["entropy"]


def per_problem(ev: dict, metric: str, k: int) -> list[float]:
    """Per-problem Pass@k (unbiased estimator) or Maj@k from an evaluation's per_problem rows."""
    if metric == "pass":
        return [pass_at_k(r["n"], r["correct"], k) for r in ev["per_problem"]]
    return [r["maj_at_k"][str(k)] for r in ev["per_problem"]]


# ------------------------------------------------------------------------------------------ tasks

_OPEN: dict[tuple[str, str], Measures] = {}  # this process's Measures by (study directory, settings)


def measures_for(ctx: TaskContext, cfg: StudyConfig) -> Measures:
    """This process's `Measures` of the study at ctx.root with settings `cfg` (created on first use), with
    the task's log and progress bars."""
    key = (str(Path(ctx.root).resolve()), json.dumps(cfg.to_dict(), sort_keys=True, default=str))
    if key not in _OPEN:
        _OPEN[key] = Measures(cfg, Path(ctx.root), ctx.log, ctx.progress)
    m = _OPEN[key]
    m.log, m.progress_factory = ctx.log, ctx.progress
    return m


def close_all() -> None:
    """Close every vLLM engine this process holds and forget its measures (a vLLM engine is a subprocess:
    never left running after a study)."""
    while _OPEN:
        _, m = _OPEN.popitem()
        m.close_engine()


def spec_of(ctx: TaskContext, cfg: StudyConfig, label: str | None) -> str:
    """The model spec of the base (label None) or of the run `label` under the study directory."""
    return cfg.model if label is None else str(Path(ctx.root) / "runs" / label)


def read_result(out: Path, result: dict) -> dict:
    """The value of a task result that names a cache file ({"cache": "cache/..."}) under the study DIR."""
    return json.loads((Path(out) / result["cache"]).read_text())


def eval_task(ctx: TaskContext, cfg: StudyConfig, label: str | None, seed: int, temperature: float,
              task: str | None = None) -> dict:
    """Evaluate the base or a run at one sampling seed and temperature (on `task`, default the study's)."""
    m = measures_for(ctx, cfg)
    _, path = m.evaluation(spec_of(ctx, cfg, label), label or "base", seed, temperature,
                           task=get_task(task) if task else None)
    return {"cache": path}


def diff_task(ctx: TaskContext, cfg: StudyConfig) -> dict:
    """The weight diff of every run of the plan against the base (one document)."""
    m = measures_for(ctx, cfg)
    m.close_engine()  # the evaluations are done: what follows runs on HF (or its own engine)
    plan = run_plan(cfg, Path(ctx.root))
    labels = [r["label"] for r in plan]
    ctx.log("diffing every run against the base")
    key = m.cache.key("study-diff", base=m.hash(cfg.model), runs=[m.hash(str(r["dir"])) for r in plan], labels=labels)
    _, path = m.cached(key, lambda: diff_checkpoints(m.ref(cfg.model), [m.ref(str(r["dir"])) for r in plan],
                                                     labels, progress=False))
    return {"cache": path}


def entropy_task(ctx: TaskContext, cfg: StudyConfig, label: str | None) -> dict:
    """Token entropy per prompt of the base or a run along its own samples."""
    return {"entropy": measures_for(ctx, cfg).entropy(spec_of(ctx, cfg, label), label or "base")}
