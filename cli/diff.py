"""`deltalens diff` and `deltalens sparsify`: what changed in the weights, and how much of it matters.

Thin typer commands (registered by cli/main.py): each takes its options from its config dataclass
(`deltalens.analysis.options.DiffConfig`, `SparsifyConfig`; `--config FILE` supplies them from YAML) and calls
one library function (`deltalens.analysis.delta.diff_analysis`, `deltalens.analysis.sparsify.sparsify_analysis`), then prints rich
tables and writes analysis.json (docs/analysis-schema.md) atomically. Method: arXiv 2608.27351.
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from deltalens.analysis.options import SPARSIFY_LIMIT, DiffConfig, SparsifyConfig
from deltalens.errors import DeltalensError

from . import common as c
from . import options as o

# ---- the positional arguments (the options come from deltalens.analysis.options)
BASE = inspect.Parameter("base", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Annotated[
    str, typer.Argument(help="base: HF dir, run dir, .safetensors, .pt, .gguf, tiny, smollm2")])
CKPTS = inspect.Parameter("ckpts", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Annotated[
    list[str], typer.Argument(help="fine-tuned checkpoints to compare with the base")])
CKPT = inspect.Parameter("ckpt", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Annotated[
    str, typer.Argument(help="fine-tuned checkpoint (run dir, HF dir, .safetensors, .pt)")])


def _fmt(x, spec: str = ".3e") -> str:
    return "-" if x is None else format(x, spec)


_SHORT = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_qkv": "qkv", "attn_o": "o",
          "attn_bias": "bias", "mlp_gate": "gate", "mlp_up": "up", "mlp_down": "down"}


def _count(n: int) -> str:
    """134515008 -> '134.5M' (parameter counts in table cells)."""
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    if n >= 1e6:
        return f"{n / 1e6:.1f}M"
    return f"{n / 1e3:.1f}k" if n >= 1e4 else str(n)


def print_diff(doc: dict) -> None:
    """Readable tables: whole model + per group for every checkpoint, per layer, then the ratios.

    Every number is also in the JSON/CSV; the tables keep to ~80 columns."""
    for label, d in doc["diff"].items():
        t = Table(title=f"{label} vs {doc['base']['path']}: {_count(d['n_params'])} params ({d['dtype']})")
        for col in ("group", "n", "rel_l2", "l2", "max|Δ|", "changed", f">{d['tol']:g}"):
            t.add_column(col, justify="left" if col == "group" else "right")
        for name, m in [*d["groups"].items(), ("whole", d["whole"])]:
            t.add_row(Text(name, style="bold") if name == "whole" else name, _count(m["n"]),
                      _fmt(m["rel_l2"], ".2e"), _fmt(m["l2"], ".2e"), _fmt(m["max_abs"], ".2e"),
                      _fmt(m["frac_changed"], ".1%"), _fmt(m["frac_above_tol"], ".1%"))
        c.out.print(t)
        rows = [r for r in d["layers"] if r["layer"] is not None]
        if rows:
            groups = [g for g in d["groups"] if any(r["group"] == g for r in rows)]
            top = max((r["rel_l2"] or 0.0) for r in rows)
            exp = math.floor(math.log10(top)) if top > 0 else 0   # show values as multiples of 10^exp
            lt = Table(title=f"{label}: rel_l2 per layer (x 1e{exp})")
            lt.add_column("layer", justify="right")
            for g in groups:
                lt.add_column(_SHORT.get(g, g), justify="right")
            cell = {(r["layer"], r["group"]): r["rel_l2"] for r in rows}
            for layer in sorted({r["layer"] for r in rows}):
                vals = [cell.get((layer, g)) for g in groups]
                lt.add_row(str(layer), *["-" if v is None else f"{v / 10**exp:.2f}" for v in vals])
            c.out.print(lt)
        if d["topk"]["k"]:
            comp = ", ".join(f"{g} {n}" for g, n in d["topk"]["abs"]["composition"].items())
            c.out.print(f"top-{d['topk']['k']} |Δ| by group: {comp or '-'}")
        c.out.print(f"whole-model distance ||θ-θ0||/||θ0|| = {_fmt(d['whole']['rel_l2'], '.4e')}")
        nc = d.get("norm_convention")
        if nc:
            c.out.print(f"norm weights ({nc['model_type']}): stored as w, acting as 1 + w (base mean "
                        f"{_fmt(nc['base_mean_stored'], '.3g')} stored, {_fmt(nc['base_mean_acting'], '.3g')} acting); "
                        f"norm rel_l2 {_fmt(nc['rel_l2_stored'], '.2e')} of the stored w, "
                        f"{_fmt(nc['rel_l2_acting'], '.2e')} of the acting 1 + w")
        for w in d["warnings"]:
            c.console.print(f"[yellow]warning ({c.escape(label)}):[/] {c.escape(w)}", highlight=False)
    for r in doc["ratios"]:
        c.out.print(f"rel_l2 ratio {r['a']} / {r['b']} = {_fmt(r['rel_l2_ratio'], '.3g')}")


def write_csv(doc: dict, path: Path) -> None:
    """One row per (checkpoint, level, name): whole model, groups, (layer, group) cells and tensors."""
    from deltalens.analysis.delta import diff_table
    from deltalens.io.atomic import atomic_path

    with atomic_path(path) as tmp:
        diff_table(doc).to_csv(tmp, index=False)


def _diff(kwargs: dict) -> None:
    run_diff(kwargs["base"], kwargs["ckpts"], o.resolve(DiffConfig, kwargs))


def run_diff(base: str, ckpts: list[str], cfg: DiffConfig) -> None:
    """Weight distance of each checkpoint from the base (the command's work): tables, then JSON/CSV."""
    from deltalens.analysis.delta import diff_analysis
    from deltalens.io.atomic import write_json_atomic
    from deltalens.io.outputs import Output, check_outputs

    tol, topk, svd, arch = cfg.tol, cfg.topk, cfg.svd, cfg.arch
    json_out, csv_out = _path(cfg.json), _path(cfg.csv)
    if not (math.isfinite(tol) and tol >= 0) or topk < 0 or svd < 0:
        raise DeltalensError(f"--tol must be a finite number >= 0 and --topk, --svd >= 0 (got --tol {tol}, "
                             f"--topk {topk}, --svd {svd})")
    from deltalens.io.spec import check_arch

    arch = check_arch(arch)
    check_outputs([Output(json_out, "--json"), Output(csv_out, "--csv")], models=[base, *ckpts, arch])
    doc = diff_analysis(base, ckpts, list(cfg.label) or None, tol=tol, topk=topk, strict=cfg.strict, svd=svd,
                        progress=True, arch=arch)
    print_diff(doc)
    if json_out is not None:
        write_json_atomic(doc, json_out)
        c.console.print(f"wrote {json_out}", markup=False)
    if csv_out is not None:
        write_csv(doc, csv_out)
        c.console.print(f"wrote {csv_out}", markup=False)


diff_cmd = o.command("diff", """Weight distance of each checkpoint from the base: per group, per layer, whole model, ratios.

    Bare .pt/.safetensors files need no architecture here; --arch lends them its config.json (whether
    embedding and lm_head are tied), so the same --arch works in every command.""",
                     [BASE, CKPTS, *o.config_params(DiffConfig), o.config_file_param("diff")], _diff)


def _path(value: str | None) -> Path | None:
    return None if value is None else Path(value)


def print_sparsify(doc: dict, task: str) -> None:
    """The sweep's table on stdout (gain kept with its 95% interval), its warnings on stderr."""
    for lbl, s in doc["sparsify"].items():
        head = str(s["ks"][0]) if s["ks"] else None
        gain = ", ".join(f"Pass@{kk} {s['base_pass_at_k'][kk]:.3f}->{s['full_pass_at_k'][kk]:.3f}"
                         for kk in s["base_pass_at_k"])
        ci = s.get("gain_ci")
        if ci is not None:
            gain += f"; gain at Pass@{head} {ci[0]:+.3f}..{ci[1]:+.3f} (95%)"
        # no outer edge: with three K columns and the interval the table fits 80 columns (a pipe's width)
        t = Table(title=f"{lbl}: sparsified deltas on {task} (base -> full: {gain})", show_edge=False)
        for col in ("τ", "sparsity", "kept L2", *[f"Pass@{kk}" for kk in s["full_pass_at_k"]]):
            t.add_column(col, justify="right")
        t.add_column(f"gain kept @{head} [95%]", justify="right", no_wrap=True)  # one cell, one line
        for p in s["points"]:
            kept = _fmt(p["gain_retained"], ".2f")
            if p.get("gain_retained_ci") is not None:
                kept += " [{:.2f},{:.2f}]".format(*p["gain_retained_ci"])
            t.add_row(f"{p['tau']:.3g}", f"{p['sparsity']:.3f}", _fmt(p["kept_l2_frac"], ".3f"),
                      *[_fmt(p["pass_at_k"].get(kk), ".3f") for kk in s["full_pass_at_k"]], kept)
        c.out.print(t)
        sparsify_warnings(lbl, s)


def sparsify_warnings(lbl: str, s: dict) -> None:
    """On stderr: a gain within noise (its 95% interval holds 0, so the share kept is not measurable), and
    the sweep's own warnings (a τ that resets nearly every changed coordinate). `report` says the same."""
    ci = s.get("gain_ci")
    if s.get("gain_within_noise"):
        c.console.print(f"[yellow]warning ({c.escape(lbl)}):[/] its gain at Pass@{s['ks'][0]} is within noise "
                        f"(95% interval {ci[0]:+.3f}..{ci[1]:+.3f} contains 0): the gain kept is not "
                        "measurable; raise --limit or --samples", highlight=False)
    for w in s.get("warnings", []):
        c.console.print(f"[yellow]warning:[/] {c.escape(w)}", highlight=False)


def _sparsify(kwargs: dict) -> None:
    run_sparsify(kwargs["ckpt"], o.resolve(SparsifyConfig, kwargs))


def run_sparsify(ckpt: str, cfg: SparsifyConfig) -> None:
    """Reset small weight changes to the base and re-evaluate (the command's work): table, then JSON."""
    from deltalens.analysis.sparsify import check_points, sparsify_analysis
    from deltalens.evaluation.cost import plan_line
    from deltalens.evaluation.options import check_eval_options
    from deltalens.evaluation.passk import parse_ks
    from deltalens.io.atomic import write_json_atomic
    from deltalens.io.outputs import Output, check_outputs
    from deltalens.io.spec import architecture, default_label, resolve, resolve_arch
    from deltalens.presets import default_task
    from deltalens.tasks import get_task

    base, arch, samples, temperature, limit, seed = cfg.base, cfg.arch, cfg.samples, cfg.temperature, cfg.limit, cfg.seed
    label, chat_template, backend, compute_dtype = cfg.label, cfg.chat_template, cfg.backend, cfg.compute_dtype
    out, json_out = _path(cfg.out), _path(cfg.json)
    taus = c.parse_floats(cfg.thresholds, "--thresholds", empty=True)
    targets = c.parse_floats(cfg.sparsity, "--sparsity", empty=True)
    ks = parse_ks(cfg.k)
    task = cfg.task or default_task(base)
    check_points(taus, targets)
    check_eval_options(samples=samples, ks=ks, temperature=temperature, limit=limit)
    problems_of = get_task(task)  # built once; an unknown task is refused now, not after loading both checkpoints
    n_problems = len(problems_of.test(limit))
    if backend not in ("hf", "vllm"):
        raise DeltalensError(f"--backend must be hf or vllm (got {backend!r})")
    arch = resolve_arch(arch)
    base = resolve(base, arch=arch)  # once: the guard, the architecture and the sweep take this reference
    # every evaluation applies a whole state dict onto the base's architecture (and tokenizer): a bare base
    # gets it from --arch, so `--base base.pt --arch tiny` works; the checkpoint needs none of its own
    model_arch = str(architecture(base))  # its spec: what the evaluations and their cost line take
    if backend == "vllm":
        from deltalens.generation.vllm import check_weight_loading, import_vllm

        import_vllm()  # a missing vLLM, or a model it cannot swap weights of, is reported before any work
        check_weight_loading(model_arch)
    check_outputs([Output(json_out, "--json"), Output(out, "--out", directory=True)], models=[ckpt, base, arch])

    def plan():
        # the cost, once the inputs are read and checked: base + full checkpoint + one evaluation per point,
        # at most (a point that resets nothing or everything reuses one of the first two)
        c.console.print(plan_line(what=f"sparsify {label or default_label(ckpt)}", models=1, problems=n_problems,
                                  samples=samples, max_new_tokens=problems_of.max_new_tokens, model=model_arch,
                                  backend=backend, points=2 + len(taus) + len(targets), compute_dtype=compute_dtype),
                        highlight=False)

    cache: dict = {}  # hf: one loaded model for every evaluation of the sweep
    engine: list = []  # vllm: one engine of the base, started at the first evaluation

    def evaluate(state_dict):
        from deltalens.evaluation import evaluate_state_dict
        from deltalens.generation import backend_for_spec

        if backend == "vllm" and not engine:
            engine.append(backend_for_spec("vllm", model_arch, chat_template=chat_template)[0])
        return evaluate_state_dict(model_arch, state_dict, problems_of, samples=samples, ks=ks,
                                   temperature=temperature, limit=limit, seed=seed, chat_template=chat_template,
                                   model_cache=None if engine else cache, backend=engine[0] if engine else None,
                                   compute_dtype=compute_dtype)

    try:
        doc = sparsify_analysis(base, ckpt, taus, evaluate, sparsities=targets, label=label, task=task,
                                out_dir=out, on_start=plan)
    finally:
        if engine:
            engine.pop().close()  # a vLLM engine is a subprocess: never left running
    for s in doc["sparsify"].values():
        s["backend"] = backend
    print_sparsify(doc, task)
    if json_out is not None:
        write_json_atomic(doc, json_out)
        c.console.print(f"wrote {json_out}", markup=False)


sparsify_cmd = o.command("sparsify", """Reset small weight changes (0 < |Δ| <= τ) to the base and measure how much Pass@K gain survives.

    A bare .pt/.safetensors base takes its architecture from --arch; every state dict is evaluated on it.""",
                         [CKPT, *o.config_params(SparsifyConfig), o.config_file_param("sparsify")], _sparsify)

diff = diff_cmd
sparsify = sparsify_cmd
__all__ = ["SPARSIFY_LIMIT", "diff", "diff_cmd", "print_diff", "print_sparsify", "sparsify", "sparsify_cmd",
           "sparsify_warnings", "write_csv"]
