"""Assemble analysis.json for a report: diff, evaluations, sparsification, training curves, held-out tasks.

`build_analysis(base, models, ...)` is what `deltalens report base.pt es.pt grpo.pt` calls. It runs the
analyses the options ask for and returns one dict in the schema of docs/analysis-schema.md, which
`deltalens.reports` renders. Expensive results (evaluations, diffs, sparsification sweeps) are cached
as JSON files in a cache directory next to the report, keyed by a content hash of the inputs (the
weight files' bytes and every setting that changes the result), so re-running a report with the same
inputs recomputes nothing, and changing a checkpoint recomputes only what depends on it.

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
from pathlib import Path

from deltalens.analysis.delta import diff_checkpoints
from deltalens.analysis.diversity import diversity_section
from deltalens.analysis.document import analysis_document, model_entry
from deltalens.analysis.sparsify import check_points, sparsify_sweep
from deltalens.errors import DeltalensError
from deltalens.evaluation import evaluate, parse_ks
from deltalens.evaluation.options import check_eval_options
from deltalens.io.atomic import write_json_atomic
from deltalens.io.models import load_model
from deltalens.io.runs import RunDir
from deltalens.io.spec import arch_for, architecture, check_arch, default_labels, resolve
from deltalens.tasks import get_task

WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf", "config.json")


# ----------------------------------------------------------------------------- content hashing


def _hash_file(h, path: Path, chunk: int = 1 << 22) -> None:
    h.update(path.name.encode())
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)


def weights_hash(spec: str, config: str | None = None) -> str:
    """sha256 over the bytes of the weight files a model spec stands for (hub ids: the id itself)."""
    ref = resolve(spec)
    kind, loc = ref.kind, ref.location
    h = hashlib.sha256()
    if kind == "hub":
        h.update(f"hub:{loc}".encode())
    elif Path(loc).is_dir():
        for pattern in WEIGHT_GLOBS:
            for f in sorted(Path(loc).glob(pattern)):
                _hash_file(h, f)
    else:
        _hash_file(h, Path(loc))
        if kind == "weights" and config is not None:
            h.update(weights_hash(config).encode())
    return h.hexdigest()


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
        value = compute()
        if self.dir is not None:
            write_json_atomic(value, self.dir / f"{key}.json")
        return value


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


def build_analysis(base: str, models: Sequence[str], *, labels: Sequence[str] | None = None,
                   task: str | None = None, data: str | None = None, samples: int = 32,
                   ks: Sequence[int] = (1, 16, 32), temperature: float = 0.6, limit: int | None = None,
                   seed: int = 0, sparsify: Sequence[float] = (), sparsity_targets: Sequence[float] = (),
                   held_out: Sequence[str] = (), diversity: bool = False, diversity_opts: dict | None = None,
                   diversity_models: Sequence[str] | None = None, sparsify_models: Sequence[str] | None = None,
                   arch: str | None = None, cache_dir: Path | None = None,
                   log: Callable[[str], None] = lambda s: None, progress_factory=None,
                   chat_template: str = "auto", config: str | None = None) -> dict:
    """Run the requested analyses of `models` against `base`; returns the analysis.json dict.

    diversity_models / sparsify_models: labels to restrict those (costly) analyses to; None = all.
    arch: the architecture of every bare-weights input, the base included (`config`: its old name).
    """
    arch = check_arch(arch if arch is not None else config)
    if not models:
        raise DeltalensError("give a base and at least one model to compare: deltalens report BASE MODEL [MODEL...]")
    ks = parse_ks(ks)
    if task is None and (sparsify or sparsity_targets or held_out or diversity):
        raise DeltalensError("--thresholds/--sparsity, --held-out and --diversity need --task")
    labels = list(labels) if labels else default_labels(list(models))
    if len(labels) != len(models) or len(set(labels)) != len(labels) or "base" in labels:
        raise DeltalensError("give one unique --label per model (and not 'base')")
    # every option is checked before any work (or cache entry) is done
    if task is not None:
        check_eval_options(samples=samples, ks=ks, temperature=temperature, limit=limit)
    if sparsify or sparsity_targets:
        check_points(list(sparsify), list(sparsity_targets))
    t = get_task(task, data=data, seed=0) if task else None
    if t is not None:
        t.test(limit)  # reads a jsonl task's data now
    held_tasks = {name: get_task(name, seed=0) for name in held_out}
    specs = {"base": base, **dict(zip(labels, models))}
    if t is not None:  # every input is evaluated: a bare one without an architecture is refused now
        for spec in specs.values():
            architecture(spec, arch)
    cache = Cache(cache_dir)
    hashes = {lab: weights_hash(spec, arch_for(spec, arch) if t is not None else arch)
              for lab, spec in specs.items()}
    if diversity and diversity_models is None:  # ES runs (their own seeds and σ); if there are none, every model
        es_runs = [lab for lab, m in zip(labels, models) if model_entry(lab, m)["method"] == "es"]
        diversity_models = es_runs or list(labels)
    if t is not None:
        _log_plan(log, base=base, arch=arch, n_models=len(specs), task=t, held=held_tasks, samples=samples,
                  limit=limit, sparsify=sum(sparsify_models is None or lab in sparsify_models for lab in labels)
                  if (sparsify or sparsity_targets) else 0, points=len(sparsify) + len(sparsity_targets),
                  diversity=len(diversity_models) if diversity else 0, diversity_opts=diversity_opts or {})

    def weights_path(spec: str):
        ref = resolve(spec)
        if ref.kind == "hub":
            raise DeltalensError(f"{spec}: diffing needs local weights; download the model and pass its directory")
        return ref.location

    # -- weight deltas (always)
    log("diff: " + ", ".join(labels))
    diff_key = cache.key("diff", base=hashes["base"], models=[hashes[lab] for lab in labels], labels=labels)
    doc_sections = cache.get_or_compute(
        diff_key, lambda: diff_checkpoints(weights_path(base), [weights_path(m) for m in models], labels,
                                           progress=progress_factory is not None, arch=arch), log)

    sections: dict = {"diff": doc_sections["diff"], "ratios": doc_sections["ratios"]}

    # -- evaluations (base + each model) on the main task
    loaded: dict = {}

    def model_for(label):
        if label not in loaded:
            loaded.clear()  # keep at most one model in memory
            loaded[label] = load_model(specs[label], config=arch_for(specs[label], arch))  # the base too
        return loaded[label]

    def eval_one(label, tsk):
        key = cache.key("eval", weights=hashes[label], task=tsk.name, data=data, samples=samples, ks=ks,
                        temperature=temperature, limit=limit, seed=seed, chat_template=chat_template)

        def compute():
            model, tok = model_for(label)
            prog = progress_factory(f"eval {label} on {tsk.name}", len(tsk.test(limit)) * samples) \
                if progress_factory else None
            res = evaluate(model, tok, tsk, samples=samples, ks=ks, temperature=temperature, limit=limit,
                           seed=seed, progress=prog, chat_template=chat_template)
            return res

        return cache.get_or_compute(key, compute, log)

    if t is not None:
        sections["evals"] = {lab: eval_one(lab, t) for lab in ["base", *labels]}

    # -- held-out tasks (forgetting)
    if held_out:
        ho: dict = {}
        for name, ht in held_tasks.items():
            for lab in ["base", *labels]:
                ho.setdefault(lab, {})[name] = eval_one(lab, ht)["pass_at_k"]
        sections["held_out"] = ho

    # -- sparsification sweeps (each model vs base, re-evaluated on the task)
    if sparsify or sparsity_targets:
        from deltalens.evaluation import evaluate_state_dict

        sp: dict = {}
        model_cache: dict = {}
        memo: dict = {}  # state-dict content hash -> evaluation (the base is evaluated once for all models)
        base_arch = architecture(base, arch)  # every state dict is evaluated on the base's architecture

        for lab, spec in zip(labels, models):
            if sparsify_models is not None and lab not in sparsify_models:
                continue
            # v2: points carry gain_retained_ci and the section gain_ci / warnings (older entries lack them)
            key = cache.key("sparsify", v=2, base=hashes["base"], model=hashes[lab], taus=list(sparsify),
                            targets=list(sparsity_targets), task=t.name, samples=samples, ks=ks,
                            temperature=temperature, limit=limit, seed=seed, chat_template=chat_template)

            def compute(spec=spec, lab=lab):
                def evaluate_fn(sd):
                    h = state_dict_hash(sd)
                    if h not in memo:
                        memo[h] = evaluate_state_dict(base_arch, sd, t, samples=samples, ks=ks,
                                                      temperature=temperature,
                                                      limit=limit, seed=seed, model_cache=model_cache,
                                                      chat_template=chat_template)
                    return memo[h]

                log(f"sparsify {lab}: {len(sparsify) + len(sparsity_targets)} points")
                return sparsify_sweep(weights_path(base), weights_path(spec), list(sparsify), evaluate_fn,
                                      sparsities=list(sparsity_targets), label=lab, task=t.name)

            sp.update(cache.get_or_compute(key, compute, log))
        sections["sparsify"] = sp

    # -- training curves from run directories
    training = {}
    for lab, spec in zip(labels, models):
        p = Path(spec)
        if RunDir.is_run(p) and (p / "checkpoints").is_dir():
            sec = training_section(lab, p)
            if sec:
                training[lab] = sec
    if training:
        sections["training"] = training

    # -- population diversity of ES runs / models
    if diversity:
        div = {}
        for lab, spec in zip(labels, models):
            if diversity_models is not None and lab not in diversity_models:
                continue
            key = cache.key("diversity", model=hashes[lab], task=t.name, opts=diversity_opts or {}, seed=seed,
                            chat_template=chat_template)
            div[lab] = cache.get_or_compute(
                key, lambda spec=spec: diversity_section(spec, t, chat_template=chat_template,
                                                         config=arch_for(spec, arch), **(diversity_opts or {})),
                log)
        sections["diversity"] = div

    return analysis_document(base, [model_entry(lab, m) for lab, m in zip(labels, models)], **sections)


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


def _log_plan(log, *, base, arch, n_models: int, task, held: dict, samples: int, limit, sparsify: int,
              points: int, diversity: int = 0, diversity_opts: dict | None = None) -> None:
    """The cost lines of a report's evaluations (before the first; cached results make it less)."""
    from deltalens.evaluation.cost import plan_line

    model = architecture(base, arch)
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
        log(plan_line(what="diversity", models=diversity, points=2 * members + 1,
                      problems=len(task.test(opts.get("prompts", 16))), samples=opts.get("samples", 4),
                      max_new_tokens=opts.get("max_new_tokens") or task.max_new_tokens, model=model))
