"""The tiny study (2 methods x 2 seeds) on a local 2-node Ray cluster (tests/study/conftest.py) gives the
analysis.json of the same study on one machine (verdicts, intervals, checksums: everything but the time
it was written), with its training runs on both nodes, in the shared and the copying file modes; and it
still does when the worker node's raylet is killed while it trains, and when the driver
(`deltalens study --ray`) is killed and the same command is run again.

Slow (each study takes minutes on 2 cores). Needs `run_study(..., executor=...)`; skipped until it has one.
Equality needs the same torch thread count on both sides: Ray gives a task of 1 CPU OMP_NUM_THREADS=1, so
the single-machine reference runs with one torch thread (on an AMX machine GRPO's fp32 gradients with 2
threads differed from 1 thread's in the 8th digit, and the diff's norms with them)."""

from __future__ import annotations

import inspect
import json
import math
import os
import signal
import threading
import time

import pytest

ray = pytest.importorskip("ray")

from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from support import tiny_spec

from deltalens.analysis.delta import torch_threads
from deltalens.study import run as study_run
from deltalens.study.config import StudyConfig
from deltalens.study.ray_executor import RayExecutor

pytestmark = [pytest.mark.slow, pytest.mark.ray_cluster, pytest.mark.skipif(
    "executor" not in inspect.signature(study_run.run_study).parameters,
    reason="needs run_study(executor=...)")]

# the smallest study of tests/test_study.py (SMALL there): 2 methods x 2 seeds, every measurement tiny
SMALL = {"methods": ("es", "grpo"), "seeds": (0, 1), "budget": 4096, "limit": 6, "samples": 4, "k": (1, 4),
         "base_seeds": 2, "sparsity": (0.9,), "sparsify_samples": 2, "diversity_members": 2, "diversity_prompts": 2,
         "entropy_prompts": 3, "resamples": 100}
VOLATILE = ("created", "timing", "seconds")  # when the document was written; how long things took


def comparable(doc):
    """The document without what depends on the clock (at any depth)."""
    if isinstance(doc, dict):
        return {k: comparable(v) for k, v in doc.items() if k not in VOLATILE}
    if isinstance(doc, list):
        return [comparable(v) for v in doc]
    return doc


@pytest.fixture(scope="module")
def single_machine(tmp_path_factory):
    """The study run here, in this process (LocalExecutor): the reference, as returned and as written
    (analysis.json holds null where the returned document holds NaN)."""
    out = tmp_path_factory.mktemp("local") / "study"
    with torch_threads(1):  # what Ray gives a 1-CPU task: GRPO's gradients (matmuls) round by thread count
        doc = study_run.run_study(StudyConfig(model=tiny_spec(), **SMALL), out, log=lambda s: None)
    return {"doc": comparable(json.loads(json.dumps(doc))),
            "file": comparable(json.loads((out / "analysis.json").read_text()))}


def _both_nan(a, b) -> bool:  # an undefined interval (NaN) is the same in both documents
    return isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)


def differences(a, b, path="", out=None) -> list[str]:
    """Where two documents differ (the first 20 paths); [] when they are equal (NaN equal to NaN)."""
    out = [] if out is None else out
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            differences(a.get(k), b.get(k), f"{path}/{k}", out)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            differences(x, y, f"{path}/{i}", out)
    elif a != b and not _both_nan(a, b) and len(out) < 20:
        out.append(f"{path}: {str(a)[:80]} != {str(b)[:80]}")
    return out


def train_nodes(ex: RayExecutor) -> set[str]:
    return {r.node_id for r in ex.records.values() if r.kind == "train"}


@pytest.mark.parametrize("shared_fs", [None, False], ids=["shared", "copying"])
def test_tiny_study_on_two_nodes_equals_the_single_machine_study(ray_cluster, single_machine, tmp_path, shared_fs):
    out = tmp_path / "study"
    # SPREAD: Ray puts the training runs on different nodes while it can, so both nodes train
    ex = RayExecutor(ray_cluster.address, shared_fs=shared_fs, options={"train": {"scheduling_strategy": "SPREAD"}},
                     progress="off", log=lambda s: None)
    doc = study_run.run_study(StudyConfig(model=tiny_spec(), **SMALL), out, log=lambda s: None, executor=ex)
    doc = comparable(json.loads(json.dumps(doc)))
    assert differences(doc, single_machine["doc"]) == []
    assert differences(comparable(json.loads((out / "analysis.json").read_text())), single_machine["file"]) == []
    assert (out / "report.html").exists() and (out / "verdicts.csv").exists()
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["es-s0", "es-s1", "grpo-s0", "grpo-s1"]
    assert len(train_nodes(ex)) == 2, ex.records
    assert ex.mode == ("shared" if shared_fs is None else "objects")


def test_tiny_study_survives_the_worker_node_dying_mid_run(fresh_ray_cluster, single_machine, tmp_path):
    """Every training run prefers the worker node (soft affinity); once the first has written a metrics row
    its raylet is killed; the runs it held are retried on the head and resume from their last checkpoint
    (shared mode: the study directory is this machine's disk)."""
    out = tmp_path / "study"
    ray.init(address=fresh_ray_cluster.address, log_to_driver=False, configure_logging=False)
    try:
        worker = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and "worker" in n["Resources"])
        prefer = NodeAffinitySchedulingStrategy(worker, soft=True)
        lines = []
        ex = RayExecutor(fresh_ray_cluster.address, options={"train": {"scheduling_strategy": prefer}},
                         progress="off", log=lines.append)
        box: dict = {}

        def drive():
            try:
                box["doc"] = study_run.run_study(StudyConfig(model=tiny_spec(), **SMALL), out, log=lambda s: None,
                                                 executor=ex)
            except BaseException as e:  # noqa: BLE001 - handed to the test thread
                box["error"] = e

        th = threading.Thread(target=drive, daemon=True)
        th.start()
        deadline = time.monotonic() + 600
        while th.is_alive() and time.monotonic() < deadline and not list(out.glob("runs/*/metrics.jsonl")):
            time.sleep(0.5)
        assert th.is_alive() and list(out.glob("runs/*/metrics.jsonl")), box.get("error")
        os.kill(fresh_ray_cluster.nodes["worker"].raylet_pid(), signal.SIGKILL)
        th.join(timeout=1800)
        assert not th.is_alive() and "error" not in box, box.get("error")
        doc = comparable(json.loads(json.dumps(box["doc"])))
        assert differences(doc, single_machine["doc"]) == []
        assert any("died; Ray retried it on" in x for x in lines), lines
        assert any(r.attempts >= 2 for r in ex.records.values() if r.kind == "train"), ex.records
    finally:
        ray.shutdown()


def test_a_killed_driver_leaves_a_study_the_same_command_resumes(ray_cluster, single_machine, tmp_path):
    """`deltalens study ... --ray ADDRESS` killed with SIGKILL once a training run has written a metrics row
    (Ray cancels the tasks it owned); the same command then finishes the study, and its analysis.json is the
    single-machine study's."""
    import subprocess
    import sys

    out = tmp_path / "study"
    args = ["study", tiny_spec(), "--out", str(out), "--ray", ray_cluster.address,
            "--methods", ",".join(SMALL["methods"]), "--seeds", ",".join(map(str, SMALL["seeds"])),
            "--budget", str(SMALL["budget"]), "--limit", str(SMALL["limit"]), "--samples", str(SMALL["samples"]),
            "--k", ",".join(map(str, SMALL["k"])), "--base-seeds", str(SMALL["base_seeds"]),
            "--sparsity", ",".join(map(str, SMALL["sparsity"])), "--sparsify-samples", str(SMALL["sparsify_samples"]),
            "--diversity-members", str(SMALL["diversity_members"]),
            "--diversity-prompts", str(SMALL["diversity_prompts"]),
            "--entropy-prompts", str(SMALL["entropy_prompts"]), "--resamples", str(SMALL["resamples"])]
    cmd = [sys.executable, "-c", "import sys; from deltalens.cli.main import main; sys.argv[0] = 'deltalens'; main()",
           *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DELTALENS_PROGRESS": "0"}
    first = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 600
    while first.poll() is None and time.monotonic() < deadline and not list(out.glob("runs/*/metrics.jsonl")):
        time.sleep(0.5)
    assert first.poll() is None, first.stderr.read().decode()[-2000:]
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=60)
    first.stderr.close()
    assert not (out / "analysis.json").exists()
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=False)
    assert again.returncode == 0, again.stderr[-3000:]
    doc = comparable(json.loads((out / "analysis.json").read_text()))
    assert doc["study"]["config"].pop("ray") == ray_cluster.address  # the CLI records where it ran
    assert differences(doc, {**single_machine["file"], "study": {**single_machine["file"]["study"], "config": {
        k: v for k, v in single_machine["file"]["study"]["config"].items() if k != "ray"}}}) == []
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["es-s0", "es-s1", "grpo-s0", "grpo-s1"]
