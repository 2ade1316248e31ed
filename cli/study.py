"""`deltalens study MODEL`: train every method for every seed at one budget, measure, and give each claim of
arXiv 2608.27351 a verdict with bootstrap intervals. Options are generated from `deltalens.study.StudyConfig`.

`deltalens study scale STUDY_DIR...` (`study_scale`): claim 6 across model sizes from finished studies
(`deltalens.study.scale`). `deltalens study verify STUDY` (`study_verify`): every check re-derived from a study's
analysis.json alone (`deltalens.study.verify`). `deltalens study merge STUDY... --out DIR` (`study_merge`): one
study from pieces run apart (`deltalens.study.merge`). cli/main.py routes `study scale|verify|merge` to them (a study's MODEL is positional, so the
subcommand is a rewritten first word, as `train --method` is)."""

from __future__ import annotations

import inspect
import math
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from deltalens.study.config import StudyConfig

from . import common as c
from . import options as o


def _finite(x):
    """x, or None where it is missing or not a finite number (NaN bounds of a one-seed interval)."""
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def show(doc: dict, out: Path, console=None) -> None:
    """The verdict table, on stdout: it fits an 80-column terminal, each claim's full text wrapping on its own
    row above its checks (nothing is cut), numbers to 3 significant digits."""
    console = console or c.out
    study = doc["study"]
    t = Table(title=Text(f"deltalens study: {study['config']['model']} on {study['config']['task']}"),  # user text
              expand=False, pad_edge=False)
    t.add_column("check", overflow="fold", ratio=1, min_width=24)
    t.add_column("estimate", justify="right", no_wrap=True)
    t.add_column("95% interval", justify="right", no_wrap=True)
    t.add_column("verdict", no_wrap=True)
    for cl in study["claims"]:
        t.add_row(Text(f"({cl['id']}) {cl['title']}", style="bold"), "", "", Text(cl["verdict"], style="bold"))
        if cl.get("note"):  # a paper claim the study did not run: the option that runs it
            t.add_row(Text("  " + cl["note"]), "", "", "")
        for ch in cl["checks"]:
            est, lo, hi = (_finite(ch[k]) for k in ("estimate", "ci_low", "ci_high"))
            # an interval of one seed is undefined (NaN, NaN): said so, as verdicts.md says it
            t.add_row(Text("  " + ch["check"]), "-" if est is None else f"{est:.3g}",
                      "undefined" if lo is None or hi is None else f"[{lo:.3g}, {hi:.3g}]", Text(ch["verdict"]))
    console.print(t)
    console.print(study["rule"], markup=False, highlight=False)
    flops = study.get("flops")
    if isinstance(flops, dict) and isinstance(flops.get("text"), str):  # deltalens.study.flops.study_flops
        console.print(flops["text"], markup=False, highlight=False)
    c.console.print(f"report: {out / 'report.html'}  analysis: {out / 'analysis.json'}  verdicts: "
                    f"{out / 'verdicts.csv'}, {out / 'verdicts.md'}", markup=False, highlight=False)


def _run(kwargs: dict) -> None:
    from deltalens.study.run import run_study

    cfg = o.resolve(StudyConfig, kwargs, arguments={"model": kwargs["model"]}, arch=False)
    out = kwargs["out"]
    # said once the study's own up-front checks passed (a refusal stays one line): at its first log line or
    # progress bar, which come before any training or evaluation
    plan = c.FirstWork(*_plan(cfg, Path(out)))
    with c.progress_bar() as bar:
        doc = run_study(cfg, out, log=plan.log(lambda s: c.console.print(f"[dim]{c.escape(s)}[/]")),
                        progress_factory=plan.factory(c.bar_factory(bar)))
    show(doc, Path(out))


def _plan(cfg: StudyConfig, out: Path) -> list[str]:
    """The study's work, stated before it starts (`deltalens.evaluation.cost`), counted from the study's own
    plan: its runs (`deltalens.study.runs.run_plan`: every method x seed, plus the --population-sizes and
    --two-point runs) and its task graph (`deltalens.study.plan.study_tasks`): the Pass@K evaluations (the base
    at each sampling seed and every run, at each temperature), the sparsity sweeps (the base once, then per
    run the full update and, at each sparsity, threshold, random mask and shrink), the held-out tasks, and
    what else runs. Nothing when the plan cannot be made: the study reports that itself."""
    from deltalens.errors import DeltalensError
    from deltalens.evaluation.cost import plan_line
    from deltalens.study.plan import study_tasks
    from deltalens.study.runs import by_group, run_plan, study_budget
    from deltalens.tasks import get_task

    try:
        task = get_task(cfg.task)
        problems = len(task.test(cfg.limit))
        runs = run_plan(cfg, out)
        tasks = study_tasks(cfg, runs)
        held = {name: get_task(name) for name in cfg.held_out}
        budget = study_budget(cfg)
    except DeltalensError:
        return []

    def keyed(prefix: str) -> list:
        return [t for t in tasks if t.key.startswith(prefix)]

    def n(count: int, word: str, words: str | None = None) -> str:
        return f"{count} {word if count == 1 else words or word + 's'}"

    common = {"model": cfg.model, "backend": cfg.backend, "device": "cpu", "compute_dtype": cfg.compute_dtype}
    groups = by_group(runs)
    lines = [(f"study training: {n(len(runs), 'run')} ({', '.join(groups)}; {n(len(cfg.seeds), 'seed')} each) at "
              f"{budget:.4g} units each")]
    temps = cfg.eval_temperatures
    evals = keyed("eval:")
    lines.append(plan_line(what=f"study Pass@K (the base at {n(cfg.base_seeds, 'sampling seed')}, "
                                f"{n(len(runs), 'run')}" + (f", at {len(temps)} temperatures" if len(temps) > 1 else "")
                                + ")", models=len(evals), problems=problems, samples=cfg.samples,
                           max_new_tokens=task.max_new_tokens, **common))
    sparse = keyed("sparsity:")
    if sparse:
        points = 1 + 3 * len(cfg.sparsity)  # the full update, then threshold, random mask and shrink per sparsity
        labels = ", ".join(t.key.split(":", 1)[1] for t in sparse)
        lines.append(plan_line(what=f"study sparsity (the base, then {labels}: the full update and "
                                    f"{n(len(cfg.sparsity), 'sparsity', 'sparsities')} x threshold, random mask, shrink)",
                               models=1 + len(sparse) * points, problems=problems, samples=cfg.sparsify_samples,
                               max_new_tokens=task.max_new_tokens, **common))
    for name, t in held.items():
        lines.append(plan_line(what=f"study held-out {name}", models=len(keyed(f"heldout:{name}:")),
                               problems=len(t.test(cfg.limit)), samples=cfg.samples,
                               max_new_tokens=t.max_new_tokens, **common))
    entropy, diversity = keyed("entropy:"), keyed("diversity:")
    also = [f"the weight diff of {n(len(runs), 'run')}", f"token entropy of {n(len(entropy), 'model')}"]
    also += [f"the population diversity around {t.key.split(':', 1)[1]}" for t in diversity]
    lines.append(f"study also: {', '.join(also)}")
    if (out / "cache").is_dir():
        lines.append(f"(a rerun: what {out / 'cache'} already holds is not computed again)")
    return lines


def _params() -> list[inspect.Parameter]:
    model = inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                              annotation=Annotated[str, typer.Argument(help="base model spec: tiny, smollm2, HF dir, "
                                                                            ".gguf, hub id")])
    out = inspect.Parameter("out", inspect.Parameter.KEYWORD_ONLY, default=Path("deltalens-study"),
                            annotation=Annotated[Path, typer.Option("--out", "-o", help="study directory (runs, "
                                                                    "cache, analysis.json, report.html)")])
    return [model, out, *o.config_params(StudyConfig),
            o.config_file_param("study", "seeds: [0, 1]", arch=False)]


def show_scale(res: dict, console=None) -> None:
    """Claim 6 across model sizes, on stdout: one row per model (by parameter count), fitting 80 columns, then
    the verdict and its rule."""
    console = console or c.out
    f = res["fraction"]
    t = Table(title=Text(f"claim 6 across model sizes: the smallest N keeping {f:g} of the reference ES run's "
                         "Pass@1 gain"), expand=False, pad_edge=False)
    t.add_column("study (model)", overflow="fold", ratio=1, min_width=16)
    t.add_column("params", justify="right", no_wrap=True)
    t.add_column("ref N", justify="right", no_wrap=True)
    t.add_column("N needed", justify="right", no_wrap=True)
    t.add_column("N interval", justify="right", no_wrap=True)
    t.add_column("share at N", justify="right", no_wrap=True)

    def num(x):
        return "-" if x is None else f"{x:.3g}"

    le = "≤"  # the smallest N the study ran already reaches F: a smaller one might too
    for m in res["models"]:
        lo, hi = m["ci"]
        share = "-" if m["share"] is None else f"{m['share']:.3g} [{num(lo)}, {num(hi)}]"
        interval = "-" if m["n_needed"] is None else \
            f"[{le if m.get('low_censored') else ''}{m['n_low']}, {m['n_high']}]"
        size = f"{m['params'] / 1e9:.3g}B" if m["params"] >= 1e9 else f"{m['params'] / 1e6:.3g}M"
        t.add_row(Text(f"{m['study']} ({m['model']})"), size, str(m["reference_population"]),
                  "-" if m["n_needed"] is None else f"{le if m.get('at_most') else ''}{m['n_needed']}", interval, share)
    console.print(t)
    console.print(f"the N needed shrinks with model scale: {res['verdict']}: {res['reason']}", markup=False,
                  highlight=False)
    console.print(res["rule"], markup=False, highlight=False)


def study_scale(
    studies: Annotated[list[Path], typer.Argument(metavar="STUDY_DIR", help="finished study directories (each with analysis.json, "
                                                       "or a published analysis.json.gz, and --population-sizes "
                                                       "runs), one per model size")],
    fraction: Annotated[float, typer.Option("--fraction", help="share of the reference ES run's Pass@1 gain an N "
                                            "must keep to count as enough (0 < F <= 1)")] = 0.9,
    json_out: Annotated[Path | None, typer.Option("--json", dir_okay=False, help="also write the result as JSON "
                                                  "to this file")] = None,
) -> None:
    """Claim 6 across model sizes: per model, the smallest population N that keeps --fraction of the reference ES
    run's Pass@1 gain (with its interval), and whether that N shrinks with model scale (3+ sizes)."""
    from deltalens.errors import DeltalensError
    from deltalens.io.atomic import write_json_atomic
    from deltalens.io.outputs import Output, check_outputs
    from deltalens.study.scale import ANALYSIS_NAMES, scale_analysis, study_file

    # The guard first: it names the input an existing path would overwrite. Then the names it cannot see: an
    # analysis.json written beside a study's analysis.json.gz would shadow it for every later read.
    check_outputs([Output(json_out, "--json")], files=[study_file(p) for p in studies])
    if json_out is not None and json_out.name in ANALYSIS_NAMES and any(
            p.is_dir() and json_out.resolve().parent == p.resolve() for p in studies):
        raise DeltalensError(f"--json {json_out} would replace or shadow a study's own analysis; choose another name")
    res = scale_analysis(studies, fraction)
    if json_out is not None:
        write_json_atomic(res, json_out)
    show_scale(res)


def show_verify(res: dict, console=None) -> None:
    """The re-derivation on stdout: one summary line, then each check that differs (its fields, both values)
    and each claim whose verdict differs."""
    console = console or c.out
    console.print(f"{res['file']}: {res['identical']} of {res['checks']} checks re-derived identically from the "
                  "document's own data", markup=False, highlight=False, soft_wrap=True)
    if res["differing"]:
        t = Table(title=Text("checks that differ"), expand=False, pad_edge=False)
        t.add_column("check", overflow="fold", ratio=1, min_width=24)
        t.add_column("status", no_wrap=True)
        t.add_column("field: stated -> derived", overflow="fold", ratio=1)
        for r in res["differing"]:
            fields = "; ".join(f"{k}: {v['stated']!r} -> {v['derived']!r}" for k, v in r.get("fields", {}).items())
            t.add_row(Text(f"({r['claim']}) {r['check']}"), r["status"], Text(fields))
        console.print(t)
    for cl in res["claims"]:
        if cl["stated"] != cl["derived"]:
            console.print(f"claim {cl['id']}: stated {cl['stated']}, derived {cl['derived']}", markup=False,
                          highlight=False)
    added = sorted({f for r in res["rows"] for f in r.get("added", [])})
    if added:
        console.print(f"fields this deltalens adds that the document predates: {', '.join(added)}", markup=False,
                      highlight=False)
    console.print("verified: every stated check and verdict follows from the data" if res["ok"] else
                  "NOT verified: the document's checks do not all follow from its data", markup=False,
                  highlight=False)


def study_verify(
    study: Annotated[Path, typer.Argument(metavar="STUDY", help="a finished study's directory, its analysis.json, "
                                          "or a published analysis.json.gz")],
    json_out: Annotated[Path | None, typer.Option("--json", dir_okay=False, help="also write the comparison as "
                                                  "JSON to this file")] = None,
) -> None:
    """Re-derive every check and verdict of a study from its analysis.json alone (its per-problem data, diff,
    sparsity, entropy, population and paired rewards; no model is read) and compare them with what it states.
    Exit 0 when all agree, 1 when any differs."""
    from deltalens.io.atomic import write_json_atomic
    from deltalens.io.outputs import Output, check_outputs
    from deltalens.study.scale import study_file
    from deltalens.study.verify import verify

    check_outputs([Output(json_out, "--json")], files=[study_file(study)])
    res = verify(study)
    if json_out is not None:
        write_json_atomic(res, json_out)
    show_verify(res)
    if not res["ok"]:
        raise typer.Exit(code=1)


def study_merge(
    studies: Annotated[list[Path], typer.Argument(metavar="STUDY", help="finished studies of one setting (each a "
                                                  "directory, its analysis.json or a published analysis.json.gz) "
                                                  "whose runs differ: other seeds or methods")],
    out: Annotated[Path, typer.Option("--out", "-o", help="directory of the merged study (analysis.json, "
                                      "report.html, verdicts.csv, verdicts.md)")] = Path("deltalens-study-merged"),
) -> None:
    """Merge studies run apart (other sessions, other machines) into one: the union of their runs, the base's
    distinct evaluations pooled, every check derived again with Holm over the whole (nothing is trained or
    evaluated). Only seeds and methods may differ between them."""
    from deltalens.io.outputs import Output, check_outputs
    from deltalens.study.merge import merge
    from deltalens.study.run import write_study
    from deltalens.study.scale import study_file

    # a directory output: refused where it holds an input (a piece's analysis.json, a published .json.gz)
    check_outputs([Output(out, "--out", directory=True)], files=[study_file(p) for p in studies])
    doc, checks = merge(studies)
    out.mkdir(parents=True, exist_ok=True)
    write_study(doc, checks, out)
    show(doc, out)


study = o.command("study", "Train every method for every seed at one FLOP-matched budget, measure, and test each "
                  "claim of arXiv 2608.27351 with bootstrap intervals; resumable.", _params(), _run)
