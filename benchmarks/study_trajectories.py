"""What a study's ES runs did while training, from published analysis.json files (no model is run).

    python benchmarks/study_trajectories.py docs/tiny-l-claims67-b2-s0-2026-12-07 \
        --shorter docs/tiny-l-claims67-s0-2026-12-07 --weights docs/tiny-l-2026-12-07/model --weights tiny \
        --out docs/tiny-l-2026-12-07/trajectories-b2-s0.json

Per run of STUDY: the training reward's mean by quarters of its iterations (`training.<run>.rows`, reward_mean)
and its distance from init (`diff.<run>.whole.rel_l2`). With --shorter (the same study at a smaller budget):
how many of the shorter run's metrics rows the longer run repeats exactly (ES has no schedule, so a longer run
continues the shorter one) and the ratio of the two distances (about sqrt(2) for twice the steps when the
updates add like a random walk, 2 when they keep one direction). With --weights: the median RMS of each model's
2-D weights other than the embeddings and the LM head (the scale ES's σ perturbs). Torch is imported only for
--weights. Numbers quoted in docs/reproduction.md ("tiny-l at twice the budget") come from here.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from deltalens.study.scale import read_study


def quarters(rows: list[dict]) -> list[float]:
    vals = [r["reward_mean"] for r in rows if r.get("reward_mean") is not None]
    n = len(vals) // 4
    return [round(statistics.mean(vals[i * n:(i + 1) * n]), 4) for i in range(4)]


def matrix_rms(spec: str) -> float:
    from deltalens.io.models import load_model

    model = load_model(spec)
    model = model[0] if isinstance(model, tuple) else model
    rms = [p.detach().float().pow(2).mean().sqrt().item() for n, p in model.named_parameters()
           if p.dim() == 2 and "embed" not in n and "lm_head" not in n]
    return round(statistics.median(rms), 4)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("study", help="a study directory or its analysis.json(.gz)")
    ap.add_argument("--shorter", help="the same study at a smaller budget")
    ap.add_argument("--weights", action="append", default=[], help="a model spec (repeatable)")
    ap.add_argument("--out", help="output JSON (default: print)")
    args = ap.parse_args(argv)
    doc = read_study(args.study)[1]
    short = read_study(args.shorter)[1] if args.shorter else None
    runs = {}
    for label, t in doc["training"].items():
        r = {"reward_mean_by_quarter": quarters(t["rows"]), "rel_l2": doc["diff"][label]["whole"]["rel_l2"]}
        if short and label in short["training"]:
            rows = short["training"][label]["rows"]
            r["shorter_rows_repeated"] = f"{sum(a == b for a, b in zip(rows, t['rows']))}/{len(rows)}"
            r["rel_l2_over_shorter"] = round(r["rel_l2"] / short["diff"][label]["whole"]["rel_l2"], 3)
        runs[label] = r
    out = {"study": args.study, "shorter": args.shorter, "runs": runs,
           "matrix_rms_median": {w: matrix_rms(w) for w in args.weights}}
    text = json.dumps(out, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return out


if __name__ == "__main__":
    main()
