"""LocalExecutor records what each task cost in DIR/costs.jsonl, appended across passes, and says it for long
tasks (deltalens.study.executor.record_cost)."""

from __future__ import annotations

import json
import re
import time

from support import resident_block

from deltalens.study import executor as ex
from deltalens.study.executor import COSTS, LocalExecutor, Task

MB = 1 << 20


def hold(ctx, mb: int) -> int:
    block = resident_block(mb * MB)
    time.sleep(0.3)  # held for 3 readings: a shorter rise can fall between two (deltalens.io.usage)
    return len(block) // MB


def graph() -> list[Task]:
    return [Task("small", hold, (1,), kind="eval"), Task("large", hold, (200,), deps=("small",), kind="train")]


def test_each_task_gets_a_line_and_a_second_pass_appends(tmp_path, monkeypatch):
    lines = []
    assert LocalExecutor().run(graph(), tmp_path, log=lines.append) == {"small": 1, "large": 200}
    rows = [json.loads(x) for x in (tmp_path / COSTS).read_text().splitlines()]
    assert [(r["task"], r["kind"]) for r in rows] == [("small", "eval"), ("large", "train")]
    assert set(rows[0]) == {"task", "kind", "pass_started", "finished", "wall_s", "start_rss_kb", "peak_rss_kb",
                            "host"}
    assert rows[1]["peak_rss_kb"] >= rows[1]["start_rss_kb"] + 150 * 1024  # the 200 MB task held 200 MB
    assert rows[0]["peak_rss_kb"] < rows[0]["start_rss_kb"] + 50 * 1024  # the 1 MB one did not
    assert all(r["wall_s"] >= 0 and r["host"] for r in rows) and rows[0]["pass_started"] == rows[1]["pass_started"]
    assert lines == []  # short tasks are not said in the log

    monkeypatch.setattr(ex, "SAY_AFTER_S", 0.0)
    LocalExecutor().run(graph(), tmp_path, log=lines.append)
    assert len((tmp_path / COSTS).read_text().splitlines()) == 4  # appended, the first pass's lines kept
    assert [re.sub(r"[\d.]+", "N", x) for x in lines] == ["small: N s, peak N GiB resident (N at its start)",
                                                          "large: N s, peak N GiB resident (N at its start)"]


def test_a_cost_that_cannot_be_written_is_said_and_the_study_goes_on(tmp_path):
    (tmp_path / COSTS).mkdir()  # the path is taken: appending fails
    lines = []
    assert LocalExecutor().run(graph(), tmp_path, log=lines.append) == {"small": 1, "large": 200}
    assert len(lines) == 2 and all(f"cannot append to {tmp_path / COSTS}" in x for x in lines)


def test_the_pass_summary_names_its_heaviest_task():
    from deltalens.study.executor import cost_summary

    assert cost_summary([]) is None
    rows = [{"task": "train:es-s0", "wall_s": 3000.0, "peak_rss_kb": 9_000_000},
            {"task": "eval:es-s0:t0.6", "wall_s": 600.0, "peak_rss_kb": 9_856_000},  # 9.40 GiB
            {"task": "eval:es-s0:t1", "wall_s": 60.0, "peak_rss_kb": 9_856_000},  # the same, kept from before
            {"task": "diff", "wall_s": 0.5, "peak_rss_kb": None}]
    assert cost_summary(rows) == ("this pass: 4 tasks, 61.0 min of task time, peak 9.40 GiB resident, reached "
                                  "in eval:es-s0:t0.6 (costs.jsonl)")
    assert cost_summary(rows[3:]) == "this pass: 1 task, 0 s of task time (costs.jsonl)"
