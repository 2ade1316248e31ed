"""benchmarks/study_run_times.py: known answers from a constructed study directory and log."""

from __future__ import annotations

import json
from pathlib import Path

from support import load_benchmark


def _rows(path: Path, rows: list[dict]):
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_run_times_reads_steps_stages_progress_lines_and_time_v(tmp_path):
    rt = load_benchmark("study_run_times")
    study = tmp_path / "s"
    _rows(study / "runs/es-s0/metrics.jsonl", [
        {"iteration": 0, "eval": {"pass_at_1": 0.4}},  # no timing: skipped
        {"iteration": 1, "timing": {"iteration_s": 10.04}},
        {"iteration": 2, "timing": {"iteration_s": 30.0}},
        {"iteration": 3, "timing": {"iteration_s": 20.0}}])
    _rows(study / "runs/es-grpo-s0/metrics.jsonl", [
        {"iteration": 1, "stage": "es", "timing": {"iteration_s": 5.0}},
        {"iteration": 2, "stage": "grpo", "timing": {"iteration_s": 7.0}},
        {"iteration": 3, "stage": "grpo", "timing": {"iteration_s": 9.0}}])
    log = tmp_path / "log"
    log.write_text("train es-s0: 0/3 (0%), 0 s elapsed\rtrain es-s0: 3/3 (100%), 1.0 min elapsed, done\n"
                   "eval base on arith (seed 0): 10/20 sequences (50%), 3 s elapsed\r"
                   "eval base on arith (seed 0): 20/20 sequences (100%), 4.1 min elapsed, done\n"
                   "eval base on arith (seed 0): 20/20 sequences (100%), 8.1 min elapsed, done\n"
                   "entropy base (sampled, then scored): 8/8 (100%), 12 s elapsed, done\n"
                   "sparsify es-s0: 3/3 (100%), 2.5 min elapsed, done\n"
                   "\tElapsed (wall clock) time (h:mm:ss or m:ss): 1:53:51\n"
                   "\tMaximum resident set size (kbytes): 13070104\n")
    doc = rt.run_times(study, log, "a test")
    assert doc["what"] == "a test" and doc["pass"] == {"wall": "1:53:51", "peak_rss_kb": 13070104}
    assert doc["runs"]["es-s0"] == {"steps": 3, "total_s": 60.0, "median_s": 20.0, "step_s": [10.0, 30.0, 20.0]}
    assert doc["runs"]["es-grpo-s0"]["total_s"] == 21.0
    assert doc["runs"]["es-grpo-s0/es"]["steps"] == 1 and doc["runs"]["es-grpo-s0/grpo"]["median_s"] == 8.0
    assert doc["evaluation_elapsed"] == {"base on arith (seed 0)": ["4.1 min", "8.1 min"]}  # in the order run
    assert doc["entropy_elapsed"] == {"base (sampled, then scored)": ["12 s"]}
    assert doc["other_elapsed"] == {"sparsify es-s0": ["2.5 min"]}  # training lines come from the metrics rows
    assert "tasks" not in doc  # a study from before costs.jsonl


def test_run_times_copies_the_studys_own_task_costs(tmp_path):
    rt = load_benchmark("study_run_times")
    rows = [{"task": "train:es-s0", "kind": "train", "wall_s": 60.5, "peak_rss_kb": 900},
            {"task": "eval:es-s0:t0.6", "kind": "eval", "wall_s": 2.0, "peak_rss_kb": 1000}]
    _rows(tmp_path / "s/runs/es-s0/metrics.jsonl", [{"iteration": 1, "timing": {"iteration_s": 1.0}}])
    (tmp_path / "s/costs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"task": "eval:b')
    (tmp_path / "log").write_text("")
    assert rt.run_times(tmp_path / "s", tmp_path / "log")["tasks"] == rows  # the torn last line skipped


def test_cli_refuses_a_directory_without_runs(tmp_path, capsys):
    rt = load_benchmark("study_run_times")
    (tmp_path / "log").write_text("")
    assert rt.main([str(tmp_path), str(tmp_path / "log")]) == 2
    assert "runs not found" in capsys.readouterr().err and not (tmp_path / "run-times.json").exists()
