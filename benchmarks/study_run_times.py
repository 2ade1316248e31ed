"""What a study pass cost: the run-times.json committed beside a study in docs/ (issue #34's "say what each
heavy run cost").

    python benchmarks/study_run_times.py STUDY_DIR LOG [--what TEXT] [--out FILE]

STUDY_DIR is the study's --out; LOG what the pass printed, run under `/usr/bin/time -v` (its progress lines
end in "\\r", read here as lines). Writes (default STUDY_DIR/run-times.json):

- `pass`: the wall time and peak resident set size as `/usr/bin/time -v` printed them (absent without it);
- `runs`: for every run under STUDY_DIR/runs, the step times of its metrics rows (`timing.iteration_s`; an
  ES iteration's validation evaluation is inside its step), their sum and median; a chain also per stage
  (`RUN/STAGE`, from the rows' `stage`);
- `evaluation_elapsed` / `entropy_elapsed` / `other_elapsed`: every progress line that reached 100%, as it
  printed its elapsed time, keyed by what it names (a list where the same name ran more than once, e.g. at
  each temperature, in the order they ran);
- `tasks`: the lines of STUDY_DIR/costs.jsonl (what the study itself recorded per task since 2026-12-07: wall
  seconds and the sampled peak resident memory of the process that ran it; absent for older studies).

Nothing is measured here: every figure is read from the study's files and the log.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

DONE = re.compile(r"^(?P<name>.+?): \d+/\d+(?: \w+)? \(100%\), (?P<elapsed>[\d.]+ (?:s|min|h)) elapsed")


def step_times(metrics: Path) -> dict[str, list[float]]:
    """Step seconds per run ("") and per chain stage, in row order; rows without `timing` (evaluations,
    iteration 0) are skipped."""
    out: dict[str, list[float]] = {}
    for line in metrics.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        s = (row.get("timing") or {}).get("iteration_s")
        if s is None:
            continue
        out.setdefault("", []).append(float(s))
        if row.get("stage"):
            out.setdefault(str(row["stage"]), []).append(float(s))
    return out


def summary(steps: list[float]) -> dict:
    return {"steps": len(steps), "total_s": round(sum(steps), 1), "median_s": round(statistics.median(steps), 2),
            "step_s": [round(s, 1) for s in steps]}


def log_figures(text: str) -> dict:
    """The pass's wall time and peak RSS (from /usr/bin/time -v) and every progress line that finished."""
    out: dict = {"pass": {}, "evaluation_elapsed": {}, "entropy_elapsed": {}, "other_elapsed": {}}
    for line in text.replace("\r", "\n").splitlines():
        line = line.strip()
        if line.startswith("Elapsed (wall clock) time"):
            out["pass"]["wall"] = line.rsplit(": ", 1)[1]
        elif line.startswith("Maximum resident set size (kbytes)"):
            out["pass"]["peak_rss_kb"] = int(line.rsplit(": ", 1)[1])
        elif m := DONE.match(line):
            name = m["name"]
            if name.startswith("train "):
                continue  # the runs' own step times are read from their metrics rows
            kind = ("evaluation_elapsed" if name.startswith("eval ") else
                    "entropy_elapsed" if name.startswith("entropy ") else "other_elapsed")
            key = name.split(" ", 1)[1] if kind != "other_elapsed" else name
            out[kind].setdefault(key, []).append(m["elapsed"])
    return out


def run_times(study: Path, log: Path, what: str = "") -> dict:
    runs = {}
    for metrics in sorted((study / "runs").glob("*/metrics.jsonl")):
        for stage, steps in step_times(metrics).items():
            runs[metrics.parent.name + (f"/{stage}" if stage else "")] = summary(steps)
    costs = study / "costs.jsonl"
    tasks = []
    for line in costs.read_text().splitlines() if costs.is_file() else []:
        try:
            tasks.append(json.loads(line))
        except ValueError:  # a line torn by a killed pass
            continue
    doc = {"what": what, **log_figures(log.read_text(errors="replace")), "runs": runs, "tasks": tasks}
    return {k: v for k, v in doc.items() if v or k == "what"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("study", type=Path, help="the study's directory (its --out)")
    ap.add_argument("log", type=Path, help="what the pass printed (under /usr/bin/time -v)")
    ap.add_argument("--what", default="", help="one line: which pass, which code, what ran beside it")
    ap.add_argument("--out", type=Path, help="output JSON (default STUDY/run-times.json)")
    a = ap.parse_args(argv)
    for p, what in ((a.study / "runs", "a study directory with runs/"), (a.log, "the pass's log")):
        if not p.exists():
            print(f"error: {p} not found: give {what}", file=sys.stderr)
            return 2
    out = a.out or a.study / "run-times.json"
    doc = run_times(a.study, a.log, a.what)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(out)
    print(f"{out}: {len(doc.get('runs', {}))} runs, "
          f"{sum(map(len, doc.get('evaluation_elapsed', {}).values()))} evaluations")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
