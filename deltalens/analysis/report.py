"""Assemble analysis.json for a report: diff, evaluations, sparsification, training curves, held-out tasks.

`build_analysis(base, models, ...)` is what `deltalens report base.pt es.pt grpo.pt` calls. It runs the
analyses the options ask for and returns one dict in the schema of docs/analysis-schema.md, which
`deltalens.reports` renders. Expensive results (evaluations, diffs, sparsification sweeps) are cached
as JSON files in a cache directory next to the report, keyed by a content hash of the inputs (the
weight files' bytes and every setting that changes the result), so re-running a report with the same
inputs recomputes nothing, and changing a checkpoint recomputes only what depends on it.

The steps, in order (`_Report`): check every option and resolve every model spec, and `--arch`, once
into a `deltalens.io.spec.ModelRef` (`_Report.__init__`; with a task, also the architecture each bare
input loads onto), say the cost of the evaluations (`_log_plan`), diff the weights (`diff`), evaluate on
the task and the held-out tasks (`evals`, `held_out`), sparsify and re-evaluate (`sparsify`), collect
training curves (`training`) and population diversity (`diversity`). Every later step takes the
references, never the spec strings (deltalens.evaluation's cost lines and the sparsified state dicts'
evaluations take the base architecture's spec string).

Content hashes (`weights_hash`) read every weight file once. On a cold cache (no diff in it yet) the
diff cannot be cached anyway, so the hash of each single-file safetensors input is computed from the
bytes the diff reads (`deltalens.io.tensors.hashing_reads`): the base is read once, not hashed and then
diffed. With a warm cache the hashes come first (to find the cached diff); with no cache (`cache_dir`
None) nothing is hashed.

Bare weights (.pt, .safetensors without a config.json beside) take their architecture from `arch` (the
command's `--arch`): every bare input, the base included, is loaded onto it, and every sparsified state
dict is evaluated on the base's architecture (`deltalens.io.spec.architecture`). Before the first
generation, `log` gets one cost line per evaluating section (`deltalens.evaluation.cost.plan_line`).

Where a report goes (`report_paths`): a directory, by default ./deltalens-report, holding report.html,
analysis.json (what `deltalens render` re-renders) and cache/; never inside an input run directory.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from deltalens.analysis.delta import diff_checkpoints
from deltalens.analysis.diversity import diversity_section
from deltalens.analysis.diversity.sampling import SAMPLER_VERSION
from deltalens.analysis.document import analysis_document, model_entry
from deltalens.analysis.sparsify import check_points, sparsify_sweep
from deltalens.errors import DeltalensError
from deltalens.evaluation import evaluate, parse_ks
from deltalens.evaluation.options import check_eval_options
from deltalens.io.atomic import write_json_atomic
from deltalens.io.models import load_model
from deltalens.io.runs import RunDir
from deltalens.io.spec import (
    HASHED_GLOBS,
    ModelRef,
    arch_for,
    default_labels,
    resolve,
    resolve_arch,
)
from deltalens.io.tensors import FileHasher, hashing_reads
from deltalens.tasks import get_task

WEIGHT_GLOBS = HASHED_GLOBS  # the files of a model directory its content hash covers (older name)


# ----------------------------------------------------------------------------- content hashing


def _hash_file(h, path: Path, chunk: int = 1 << 22) -> None:
    h.update(path.name.encode())
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)


class _HashStream:
    """`weights_hash` of one reference as a stream: sha256 over name + bytes of each of `ref.files()` in
    order (a hub id: the id), then, for bare weights with an architecture, that architecture's hash (hex).
    A first file in .safetensors can be fed by the reads of a diff (`first`, a `FileHasher`)."""

    def __init__(self, ref: ModelRef, config: str | ModelRef | None):
        self.ref, self.config, self.h = ref, config, hashlib.sha256()
        self.files = ref.files()
        if ref.kind == "hub":
            self.h.update(f"hub:{ref.location}".encode())
        self.first = FileHasher(self.files[0], self.h) if self.files and self.files[0].suffix == ".safetensors" \
            else None

    def finish(self, arch_hash: Callable[[str | ModelRef], str] | None = None) -> str:
        """The hex digest: what the reads left out, the other files, the architecture's hash."""
        rest = self.files
        if self.first is not None:
            self.first.finish()
            rest = self.files[1:]
        for f in rest:
            _hash_file(self.h, f)
        if self.ref.kind == "weights" and self.config is not None:
            self.h.update((arch_hash or weights_hash)(self.config).encode())
        return self.h.hexdigest()


def weights_hash(spec: str | ModelRef, config: str | ModelRef | None = None) -> str:
    """sha256 over the bytes of the weight files a model spec stands for (hub ids: the id itself); for
    bare weights, `config` (the architecture they load onto) is part of it."""
    return _HashStream(resolve(spec), config).finish()


def state_dict_hash(sd) -> str:
    """sha256 over names, dtypes, shapes and bytes of a state dict's tensors."""
    import torch

    h = hashlib.sha256()
    for name in sorted(sd):
        t = sd[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        if t.numel():
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Cache:
    """JSON results keyed by a hash of (what, inputs). `None` directory disables caching."""

    def __init__(self, directory: Path | None):
        self.dir = Path(directory) if directory is not None else None

    def key(self, what: str, **inputs) -> str:
        blob = json.dumps({"what": what, **inputs}, sort_keys=True, default=str)
        return f"{what}-{hashlib.sha256(blob.encode()).hexdigest()[:20]}"

    def holds_any(self, what: str) -> bool:
        """Whether any entry of kind `what` is stored (False without a directory)."""
        return self.dir is not None and self.dir.is_dir() and any(self.dir.glob(f"{what}-*.json"))

    def put(self, key: str, value: dict) -> dict:
        if self.dir is not None:
            write_json_atomic(value, self.dir / f"{key}.json")
        return value

    def get_or_compute(self, key: str, compute: Callable[[], dict], log: Callable[[str], None] | None = None):
        if self.dir is not None:
            f = self.dir / f"{key}.json"
            if f.exists():
                try:
                    value = json.loads(f.read_text())
                except (OSError, ValueError, RecursionError):
                    value = None  # an unreadable entry (edited, disk trouble) is recomputed and rewritten
                if isinstance(value, dict):
                    if log:
                        log(f"cached: {key}")
                    return value
        return self.put(key, compute())


def _resolved(spec: str | ModelRef | None) -> ModelRef | None:
    return None if spec is None else resolve(spec)


# ----------------------------------------------------------------------------- sections


def training_section(label: str, run_dir: Path) -> dict | None:
    """Training curves from a run directory's metrics.jsonl (ES iterations, GRPO steps, or a chain's stages).

    Each row keeps the iteration, the stage (chains), the FLOP-matched compute units spent so far
    (`deltalens.training.budget`; GRPO and chain rows record them, ES rows are computed from the run's
    prompts and population, since the unit cost of an ES iteration is fixed), the reward statistics, the
    periodic validation Pass@1 (`eval.pass_at_1` of the row) and GRPO's KL, entropy and grad norm. With units
    on every row, `x` is "units", so ES iterations and GRPO steps share one compute axis.
    """
    from deltalens.training.budget import es_units_per_iteration

    run = RunDir(run_dir)
    rows = run.metrics()
    if not rows:
        return None
    try:
        config = run.config()
    except DeltalensError:
        config = {}
    method = config.get("method")
    es_per_iteration = None
    if method == "es":
        try:
            es_per_iteration = es_units_per_iteration(config.get("prompts_per_iteration"), config.get("population"))
        except DeltalensError:  # an old or hand-written config without the counts: no units for its rows
            es_per_iteration = None
    keep = ("iteration", "stage", "units", "reward_mean", "reward_std", "reward_min", "reward_max", "kl",
            "entropy", "grad_norm")
    out_rows = []
    for r in rows:
        if "iteration" not in r:
            continue
        row = {k: r[k] for k in keep if k in r}
        if "units" not in row and es_per_iteration is not None and isinstance(r["iteration"], int):
            row["units"] = r["iteration"] * es_per_iteration
        ev = r.get("eval")
        if isinstance(ev, dict) and ev.get("pass_at_1") is not None:
            row["eval_pass1"] = ev["pass_at_1"]
        out_rows.append(row)
    x = "units" if out_rows and all("units" in r for r in out_rows) else "iteration"
    return {"method": method, "x": x, "rows": out_rows}


@dataclass(frozen=True)
class ReportOptions:
    """What `build_analysis` runs, and how. One line per field, as the `deltalens report` options say."""

    # -- the models
    labels: Sequence[str] | None = None  # one per model (default: file stems); never "base"
    arch: str | None = None  # architecture of every bare-weights input, the base included (`--arch`)
    # -- the evaluations (all need `task`)
    task: str | None = None  # evaluate Pass@K on this task (None: the diff only)
    data: str | None = None  # jsonl file or directory of a gsm8k / jsonl task
    samples: int = 32  # samples per problem
    ks: Sequence[int] | str = (1, 16, 32)  # K values of Pass@K
    temperature: float = 0.6  # sampling temperature
    limit: int | None = None  # first N test problems of every evaluation
    seed: int = 0  # evaluation seed
    chat_template: str = "auto"  # auto | on | off, as in `deltalens eval`
    compute_dtype: str = "fp32"  # what the evaluations generate in (fp32 | bf16 | auto: deltalens.generation.dtype)
    # -- the costly extras
    sparsify: Sequence[float] = ()  # sparsify at these thresholds τ on |Δ|
    sparsity_targets: Sequence[float] = ()  # and at these target sparsities
    sparsify_models: Sequence[str] | None = None  # labels to sparsify (None: every model)
    held_out: Sequence[str] = ()  # held-out task names (forgetting)
    diversity: bool = False  # population JS and coverage
    diversity_opts: dict = field(default_factory=dict)  # options of `diversity_section` (members, sigma, ...)
    diversity_models: Sequence[str] | None = None  # labels to measure (None: the ES runs, else every model)
    # -- where results go and what is said
    cache_dir: Path | None = None  # cached results by content hash (None: no cache, nothing hashed)
    log: Callable[[str], None] = lambda s: None  # one line per step (cost, cached entries)
    progress_factory: Callable | None = None  # progress_factory(description, total) -> progress callback


def build_analysis(base: str | ModelRef, models: Sequence[str | ModelRef], options: ReportOptions | None = None,
                   *, config: str | None = None, **kwargs) -> dict:
    """Run the requested analyses of `models` against `base`; returns the analysis.json dict.

    Options are a `ReportOptions` or its fields as keywords (`config`: the old name of `arch`); specs are
    anything `deltalens.io.spec.resolve` takes, resolved here once.
    """
    if options is None:
        if config is not None and kwargs.get("arch") is None:
            kwargs["arch"] = config
        kwargs = {k: v for k, v in kwargs.items() if not (k == "diversity_opts" and v is None)}
        options = ReportOptions(**kwargs)
    elif kwargs or config is not None:
        raise TypeError("build_analysis: pass either a ReportOptions or keyword options, not both")
    return _Report(base, models, options).run()


class _Report:
    """One report's state between its steps: options, references, content hashes, the cache."""

    def __init__(self, base, models: Sequence, o: ReportOptions):
        self.o = o
        self.log = o.log
        self.arch = resolve_arch(o.arch)  # checked and resolved once; every bare input carries it (ModelRef.arch)
        if not models:
            raise DeltalensError("give a base and at least one model to compare: deltalens report BASE MODEL [MODEL...]")
        self.ks = parse_ks(o.ks)
        if o.task is None and (o.sparsify or o.sparsity_targets or o.held_out or o.diversity):
            raise DeltalensError("--thresholds/--sparsify, --held-out and --diversity need --task")
        specs = [m.spec if isinstance(m, ModelRef) else str(m) for m in models]
        self.labels = list(o.labels) if o.labels else default_labels(specs)
        if len(self.labels) != len(models) or len(set(self.labels)) != len(self.labels) or "base" in self.labels:
            raise DeltalensError("give one unique --label per model (and not 'base')")
        # every option is checked before any work (or cache entry) is done
        if o.task is not None:
            check_eval_options(samples=o.samples, ks=self.ks, temperature=o.temperature, limit=o.limit)
        if o.sparsify or o.sparsity_targets:
            check_points(list(o.sparsify), list(o.sparsity_targets))
        self.task = get_task(o.task, data=o.data, seed=0) if o.task else None
        if self.task is not None:
            self.task.test(o.limit)  # reads a jsonl task's data now
        self.held_tasks = {name: get_task(name, seed=0) for name in o.held_out}
        # each spec resolved once: every later step takes these references
        self.refs: dict[str, ModelRef] = {lab: resolve(spec, arch=self.arch)
                                          for lab, spec in zip(["base", *self.labels], [base, *models])}
        # what each input loads onto when evaluated: a bare one its architecture (--arch, else the
        # directory beside it: resolved here, once; without either it is refused now), the others None
        self.archs: dict[str, ModelRef | None] = {}
        if self.task is not None:
            self.archs = {lab: _resolved(arch_for(ref)) for lab, ref in self.refs.items()}
        self.entries = {lab: model_entry(lab, self.refs[lab]) for lab in self.labels}  # analysis.json's models
        self.cache = Cache(o.cache_dir)
        self.hashes: dict[str, str | None] = {lab: None for lab in self.refs}
        self.diversity_models = None
        if o.diversity:  # ES runs (their own seeds and σ); if there are none, every model
            self.diversity_models = o.diversity_models
            if self.diversity_models is None:
                es_runs = [lab for lab in self.labels if self.entries[lab]["method"] == "es"]
                self.diversity_models = es_runs or list(self.labels)
        self.loaded: dict = {}

    def arch_spec(self, label: str) -> str:
        """The spec of what `label` loads its config and tokenizer from (itself, or a bare input's
        architecture): for deltalens.evaluation, which takes a spec there (cost lines, state dicts)."""
        arch = self.archs.get(label)
        return arch.spec if arch is not None else self.refs[label].spec

    # -- content hashes
    def _hash_config(self, label: str) -> ModelRef | None:
        """The architecture a bare input's hash covers: what it loads onto when evaluated, else --arch."""
        return self.archs[label] if self.task is not None else self.arch

    def _streams(self) -> dict[str, _HashStream]:
        return {lab: _HashStream(ref, self._hash_config(lab)) for lab, ref in self.refs.items()}

    def _finish(self, streams: dict[str, _HashStream]) -> None:
        """Digests of every stream; an architecture that is one of the inputs reuses that input's hash,
        and one that is not is hashed once for all the bare inputs on it."""
        by_location: dict[tuple, str] = {}

        def arch_hash(arch: ModelRef) -> str:
            key = (arch.kind, str(arch.location))
            if key not in by_location:
                by_location[key] = weights_hash(arch)
            return by_location[key]

        for lab in sorted(streams, key=lambda lab: streams[lab].ref.kind == "weights"):  # bare weights last
            ref = streams[lab].ref

            self.hashes[lab] = streams[lab].finish(arch_hash)
            self.refs[lab] = ref.with_hash(self.hashes[lab])
            if ref.kind != "weights":
                by_location[(ref.kind, str(ref.location))] = self.hashes[lab]

    # -- the steps
    def run(self) -> dict:
        o, t = self.o, self.task
        if t is not None:
            _log_plan(self.log, model=self.arch_spec("base"), n_models=len(self.refs), task=t,
                      held=self.held_tasks, samples=o.samples, limit=o.limit,
                      sparsify=sum(self._sparsified(lab) for lab in self.labels)
                      if (o.sparsify or o.sparsity_targets) else 0,
                      points=len(o.sparsify) + len(o.sparsity_targets),
                      diversity=len(self.diversity_models) if o.diversity else 0, diversity_opts=o.diversity_opts,
                      compute_dtype=o.compute_dtype)
        sections: dict = self.diff()
        if t is not None:
            sections["evals"] = {lab: self.eval_one(lab, t) for lab in self.refs}
        if o.held_out:
            sections["held_out"] = self.held_out()
        if o.sparsify or o.sparsity_targets:
            sections["sparsify"] = self.sparsify()
        training = self.training()
        if training:
            sections["training"] = training
        if o.diversity:
            sections["diversity"] = self.diversity()
        return analysis_document(self.refs["base"].spec, [self.entries[lab] for lab in self.labels], **sections)

    def diff(self) -> dict:
        """Weight deltas of every model against the base (always). Hashes every input on the way: from
        the diff's own reads on a cold cache, before it (to look it up) on a warm one, not at all without."""
        self.log("diff: " + ", ".join(self.labels))
        base, models = self.refs["base"], [self.refs[lab] for lab in self.labels]
        for ref in (base, *models):
            ref.path  # noqa: B018 - a hub id cannot be diffed: refused before any reading
        compute = lambda: diff_checkpoints(base, models, self.labels, progress=self.o.progress_factory is not None)
        if self.cache.dir is None:
            doc = compute()
        elif not self.cache.holds_any("diff"):  # cold: the diff is computed anyway, so hash while reading
            streams = self._streams()
            with hashing_reads(s.first for s in streams.values() if s.first is not None):
                doc = compute()
            self._finish(streams)
            doc = self.cache.put(self._diff_key(), doc)
        else:
            self._finish(self._streams())
            doc = self.cache.get_or_compute(self._diff_key(), compute, self.log)
        return {"diff": doc["diff"], "ratios": doc["ratios"]}

    def _diff_key(self) -> str:
        return self.cache.key("diff", base=self.hashes["base"], models=[self.hashes[lab] for lab in self.labels],
                              labels=self.labels)

    def _compute_key(self) -> dict:
        """The compute dtype's part of an evaluation's cache key: none for fp32 (older entries stay hits)."""
        return {} if self.o.compute_dtype == "fp32" else {"compute_dtype": self.o.compute_dtype}

    def model_for(self, label: str):
        if label not in self.loaded:
            self.loaded.clear()  # keep at most one model in memory
            ref = self.refs[label]
            self.loaded[label] = load_model(ref, config=self.archs[label])  # the base too
        return self.loaded[label]

    def eval_one(self, label: str, tsk) -> dict:
        o = self.o
        key = self.cache.key("eval", weights=self.hashes[label], task=tsk.name, data=o.data, samples=o.samples,
                             ks=self.ks, temperature=o.temperature, limit=o.limit, seed=o.seed,
                             chat_template=o.chat_template, **self._compute_key())

        def compute():
            model, tok = self.model_for(label)
            prog = o.progress_factory(f"eval {label} on {tsk.name}", len(tsk.test(o.limit)) * o.samples) \
                if o.progress_factory else None
            return evaluate(model, tok, tsk, samples=o.samples, ks=self.ks, temperature=o.temperature, limit=o.limit,
                            seed=o.seed, progress=prog, chat_template=o.chat_template, compute_dtype=o.compute_dtype)

        return self.cache.get_or_compute(key, compute, self.log)

    def held_out(self) -> dict:
        """Pass@K of every model on each held-out task (forgetting)."""
        ho: dict = {}
        for name, ht in self.held_tasks.items():
            for lab in self.refs:
                ho.setdefault(lab, {})[name] = self.eval_one(lab, ht)["pass_at_k"]
        return ho

    def _sparsified(self, label: str) -> bool:
        return self.o.sparsify_models is None or label in self.o.sparsify_models

    def sparsify(self) -> dict:
        """Sparsification sweeps: each model vs the base, re-evaluated on the task."""
        from deltalens.evaluation import evaluate_state_dict

        o, t = self.o, self.task
        sp: dict = {}
        model_cache: dict = {}
        memo: dict = {}  # state-dict content hash -> evaluation (the base is evaluated once for all models)
        base_arch = self.arch_spec("base")  # every state dict is evaluated on the base's architecture

        def evaluate_fn(sd):
            h = state_dict_hash(sd)
            if h not in memo:
                memo[h] = evaluate_state_dict(base_arch, sd, t, samples=o.samples, ks=self.ks,
                                              temperature=o.temperature, limit=o.limit, seed=o.seed,
                                              model_cache=model_cache, chat_template=o.chat_template,
                                              compute_dtype=o.compute_dtype)
            return memo[h]

        for lab in self.labels:
            if not self._sparsified(lab):
                continue
            # v2: points carry gain_retained_ci and the section gain_ci / warnings (older entries lack them)
            key = self.cache.key("sparsify", v=2, base=self.hashes["base"], model=self.hashes[lab],
                                 taus=list(o.sparsify), targets=list(o.sparsity_targets), task=t.name,
                                 samples=o.samples, ks=self.ks, temperature=o.temperature, limit=o.limit,
                                 seed=o.seed, chat_template=o.chat_template, **self._compute_key())

            def compute(lab=lab):
                self.log(f"sparsify {lab}: {len(o.sparsify) + len(o.sparsity_targets)} points")
                return sparsify_sweep(self.refs["base"], self.refs[lab], list(o.sparsify), evaluate_fn,
                                      sparsities=list(o.sparsity_targets), label=lab, task=t.name)

            sp.update(self.cache.get_or_compute(key, compute, self.log))
        return sp

    def training(self) -> dict:
        """Training curves of the models that are run directories."""
        out = {}
        for lab in self.labels:
            run = self.refs[lab].run
            if run is not None and (sec := training_section(lab, run)):
                out[lab] = sec
        return out

    def diversity(self) -> dict:
        """Population diversity of the ES runs (or the models `diversity_models` names)."""
        o, div = self.o, {}
        for lab in self.labels:
            if lab not in self.diversity_models:
                continue
            ref = self.refs[lab]
            # v2: js_mean / js_se are the posterior estimator, named in "estimator" (older entries: direct);
            # sampler: which sampler drew the responses (a seed draws other responses under each)
            key = self.cache.key("diversity", v=2, model=self.hashes[lab], task=self.task.name, opts=o.diversity_opts,
                                 seed=o.seed, chat_template=o.chat_template, sampler=SAMPLER_VERSION)
            div[lab] = self.cache.get_or_compute(
                key, lambda ref=ref, lab=lab: diversity_section(ref, self.task, chat_template=o.chat_template,
                                                                config=self.archs[lab], **o.diversity_opts),
                self.log)
        return div


DEFAULT_REPORT_DIR = Path("deltalens-report")


def report_paths(out_dir: Path | None = None) -> dict[str, Path]:
    """Where a report goes: {"dir", "html", "analysis", "cache"} under `out_dir` (default ./deltalens-report):
    DIR/report.html, DIR/analysis.json (as README.md says), DIR/cache/. A name ending in .html or .json is
    refused: -o names the directory, and a file name there would hide where analysis.json goes."""
    d = Path(out_dir) if out_dir is not None else DEFAULT_REPORT_DIR
    if d.suffix in (".html", ".json"):
        raise DeltalensError(f"-o {d}: -o names the report's directory (it writes report.html, analysis.json "
                             f"and cache/ there); try -o {d.with_suffix('')}")
    return {"dir": d, "html": d / "report.html", "analysis": d / "analysis.json", "cache": d / "cache"}


def _log_plan(log, *, model: str, n_models: int, task, held: dict, samples: int, limit, sparsify: int,
              points: int, diversity: int = 0, diversity_opts: dict | None = None,
              compute_dtype: str = "fp32") -> None:
    """The cost lines of a report's evaluations (before the first; cached results make it less); `model`:
    the spec of the base's architecture (what the rates measured here are keyed by), generating in
    `compute_dtype` (the diversity pass samples in fp32)."""
    from functools import partial

    from deltalens.evaluation.cost import plan_line as fp32_line

    plan_line = partial(fp32_line, compute_dtype=compute_dtype)

    n = len(task.test(limit))
    log(plan_line(what=f"evaluate on {task.name}", models=n_models, problems=n, samples=samples,
                  max_new_tokens=task.max_new_tokens, model=model))
    for name, ht in held.items():
        log(plan_line(what=f"held-out {name}", models=n_models, problems=len(ht.test(limit)), samples=samples,
                      max_new_tokens=ht.max_new_tokens, model=model))
    if sparsify:
        # each model: its full checkpoint + one evaluation per point; the base once for all
        log(plan_line(what="sparsify", models=sparsify, points=points + 1, problems=n, samples=samples,
                      max_new_tokens=task.max_new_tokens, model=model)
            + f" (+ the base once: {n * samples:,} generations)")
    if diversity:
        # a population of N members and its centre: 2N + 1 passes (deltalens.analysis.diversity); an ES run's
        # own N may differ from the default counted here
        opts = diversity_opts or {}
        members = opts.get("members") or 32
        log(fp32_line(what="diversity", models=diversity, points=2 * members + 1,
                      problems=len(task.test(opts.get("prompts", 16))), samples=opts.get("samples", 4),
                      max_new_tokens=opts.get("max_new_tokens") or task.max_new_tokens, model=model))
