"""Shared helpers of the numbered examples: arguments, FLOP-matched runs with a reusable cache, evaluation, IO.

Every example calls `parser(doc)` for the common flags, `settings(args)` for the scale (full or --quick),
`ensure_run(...)` to train (or reuse) a run in the `--runs` cache, and `save(...)` to write
`<out>/<name>.json` and print a table.

Runs are cached by name: `<runs>/<method>-<tag>-s<seed>`, where the tag encodes the scale, budget and dtype.
A run is reused when its final checkpoint exists (`checkpoints/final/config.json`), so scripts 01-05 share
the runs 01 trained.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RUNS = ROOT / "build" / "example-runs"
DEFAULT_OUT = ROOT / "build" / "example-results"
METHODS = ("es", "grpo", "es-grpo", "grpo-es")


def parser(doc: str, seeds: str = "0,1,2") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny settings (seconds; used by tests)")
    ap.add_argument("--seeds", default=seeds, help="comma-separated run seeds (default %(default)s)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results directory (JSON written there)")
    ap.add_argument("--runs", type=Path, default=DEFAULT_RUNS, help="run cache shared by the examples")
    ap.add_argument("--model", default="tiny", help="base model spec (default tiny)")
    ap.add_argument("--budget", type=float, default=None,
                    help="compute units per method (deltalens.training.budget; default: 10240, quick 64)")
    ap.add_argument("--limit", type=int, default=None, help="test problems per evaluation (default 100, quick 4)")
    ap.add_argument("--samples", type=int, default=None, help="samples per problem (default 32, quick 4)")
    return ap


def seeds_of(args) -> list[int]:
    return [int(s) for s in str(args.seeds).split(",") if s.strip()]


def settings(args) -> dict:
    """Scale of the runs: FLOP-matched ES (population N) and GRPO (group G = N/4)."""
    if args.quick:
        s = {"N": 8, "G": 2, "P_es": 2, "P_grpo": 2, "budget": 64, "limit": 4, "samples": 4, "eval_limit": 2}
    else:
        s = {"N": 32, "G": 8, "P_es": 8, "P_grpo": 8, "budget": 10240, "limit": 100, "samples": 32,
             "eval_limit": 32}
    if args.budget:
        s["budget"] = args.budget
    if args.limit:
        s["limit"] = args.limit
    if args.samples:
        s["samples"] = args.samples
    s["ks"] = sorted({k for k in (1, 16, 32) if k <= s["samples"]} | {s["samples"]})
    return s


def es_config(s: dict, seed: int, model: str = "tiny", **over):
    from deltalens.training.es.config import ESConfig

    base = {"model": model, "population": s["N"], "prompts_per_iteration": s["P_es"], "seed": seed,
            "eval_every": 0, "checkpoint_every": 0}
    return ESConfig.preset("tiny" if model == "tiny" or "tiny" in str(model) else "paper", **{**base, **over})


def grpo_config(s: dict, seed: int, model: str = "tiny", **over):
    from deltalens.training.grpo.config import GRPOConfig

    base = {"model": model, "num_generations": s["G"], "prompts_per_step": s["P_grpo"], "seed": seed,
            "eval_every": 0, "save_every": 0}
    return GRPOConfig.preset("tiny" if model == "tiny" or "tiny" in str(model) else "paper", **{**base, **over})


def final_exists(run: Path) -> bool:
    return (run / "checkpoints" / "final" / "config.json").exists() and (run / "state.json").exists()


def run_tag(s: dict, quick: bool, dtype: str = "fp32", extra: str = "") -> str:
    return f"{'q' if quick else 'f'}{int(s['budget'])}-N{s['N']}{'' if dtype == 'fp32' else '-' + dtype}{extra}"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def ensure_run(runs: Path, method: str, seed: int, s: dict, quick: bool, *, model: str = "tiny",
               dtype: str = "fp32", tag_extra: str = "", es_over: dict | None = None) -> tuple[Path, float]:
    """Train `method` (es, grpo, es-grpo, grpo-es) at budget s['budget'] unless its final checkpoint exists.

    Returns (run dir, wall seconds spent training now; 0 when reused)."""
    from deltalens.training.budget import iterations_for_budget, steps_for_budget

    run = Path(runs) / f"{method}-{run_tag(s, quick, dtype, tag_extra)}-s{seed}"
    if final_exists(run):
        return run, 0.0
    t0 = time.time()
    es_c = es_config(s, seed, model, dtype=dtype, **(es_over or {}))
    gr_c = grpo_config(s, seed, model, dtype=dtype)
    log(f"train {run.name}")
    if method == "es":
        import dataclasses

        from deltalens.training.es.train import train_es

        es_c = dataclasses.replace(es_c, iterations=iterations_for_budget(s["budget"], s["P_es"], s["N"]))
        train_es(es_c, run, overwrite=True)
    elif method == "grpo":
        import dataclasses

        from deltalens.training.grpo.train import train_grpo

        gr_c = dataclasses.replace(gr_c, steps=steps_for_budget(s["budget"], s["P_grpo"], s["G"]))
        train_grpo(gr_c, run, overwrite=True)
    elif method in ("es-grpo", "grpo-es"):
        from deltalens.training.chain import train_chain

        train_chain(run, tuple(method.split("-")), model=model, budget=s["budget"], es_config=es_c,
                       grpo_config=gr_c, overwrite=True)
    else:
        raise ValueError(method)
    return run, time.time() - t0


def evaluate_spec(spec, task: str, s: dict, seed: int = 0, dtype: str = "fp32") -> dict:
    """Pass@K (and mean reward) of a model spec on `task`'s first s['limit'] test problems."""
    from deltalens.evaluation import evaluate
    from deltalens.io.models import load_model
    from deltalens.tasks import get_task

    model, tok = load_model(str(spec), dtype=dtype)
    res = evaluate(model, tok, get_task(task, seed=0), samples=s["samples"], ks=s["ks"], temperature=0.6,
                   limit=s["limit"], seed=seed)
    return {"pass_at_k": {str(k): v for k, v in res["pass_at_k"].items()},
            "mean_reward": res.get("mean_reward")}


def eval_cached(cache_dir: Path, key: str, fn):
    """JSON memo of an evaluation (so re-running an example re-evaluates nothing)."""
    p = Path(cache_dir) / "_evals" / f"{key}.json"
    if p.exists():
        return json.loads(p.read_text())
    r = fn()
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(r))
    return r


def mean_std(xs) -> tuple[float | None, float | None]:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def fmt(m, sd=None, digits: int = 3) -> str:
    if m is None:
        return "n/a"
    return f"{m:.{digits}f}" if sd is None else f"{m:.{digits}f} ± {sd:.{digits}f}"


def table(header: list[str], rows: list[list]) -> str:
    """A Markdown table (also what gets printed)."""
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def save(out: Path, name: str, result: dict, md: str) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps({**result, "table_md": md}, indent=1, default=str))
    print(md)
    print(f"\nwrote {path}")
    return path
