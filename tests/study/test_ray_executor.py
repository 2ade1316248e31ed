"""RayExecutor on a local 2-node Ray cluster (tests/study/conftest.py): a toy task graph gives the same results
and the same files in the study directory as LocalExecutor, in the shared and the copying file modes, with
tasks placed on both nodes; a task's DeltalensError is not retried; a task whose node's raylet is killed
mid-run is retried on the other node and the graph finishes with the same result.

Starting the cluster costs ~15-30 s here (two `ray start`s), each graph a few seconds."""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from deltalens.errors import DeltalensError
from deltalens.study.executor import COSTS, LocalExecutor, Task, TaskContext
from deltalens.study.ray_executor import RayExecutor, install, pack, recover

# the workers cannot import this module (tests/ is not on their path): send its functions by value
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


# -- the toy graph: module-level functions that read their inputs and write their outputs under ctx.root
def write_a(ctx: TaskContext, text: str) -> dict:
    p = ctx.root / "out" / "a.txt"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return {"a": text}


def write_b(ctx: TaskContext) -> dict:
    a = (ctx.root / "out" / "a.txt").read_text()  # a dependency's output, unpacked here in the copying modes
    d = ctx.root / "out" / "b"
    d.mkdir(parents=True, exist_ok=True)
    (d / "x.txt").write_text(a + "+b")
    (d / "sub").mkdir(exist_ok=True)
    (d / "sub" / "y.bin").write_bytes(bytes(range(256)) * 4)
    return {"b": a + "+b", "from_deps": ctx.deps["a"]["a"]}


def write_c(ctx: TaskContext, n: int) -> int:
    a = (ctx.root / "out" / "a.txt").read_text()
    (ctx.root / "out" / "c.txt").write_text(a * n)
    return len(a) * n


def write_d(ctx: TaskContext) -> dict:
    b = (ctx.root / "out" / "b" / "x.txt").read_text()
    c = (ctx.root / "out" / "c.txt").read_text()
    (ctx.root / "out" / "d.json").write_text(json.dumps({"b": b, "c": c}))
    ctx.log(f"d: combined {len(b) + len(c)} characters")
    return {"d": b + "|" + c, "c": ctx.deps["c"]}


def count_up(ctx: TaskContext) -> int:
    """Resumable: continues from its own output (the driver sends it back in the copying modes)."""
    p = ctx.root / "out" / "e" / "n.txt"
    n = int(p.read_text()) + 1 if p.exists() else 1
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(str(n))
    return n


def fail_once_logged(ctx: TaskContext, marker: str) -> None:
    with open(marker, "a") as f:
        f.write("ran\n")
    raise DeltalensError("the toy task refuses")


def slow(ctx: TaskContext, marks: str, seconds: float) -> str:
    """Leaves a mark (its node) when it starts, then sleeps: the kill test kills its node meanwhile."""
    # (never ray.get_runtime_context() outside Ray: it would start a local Ray in the LocalExecutor run)
    node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"
    Path(marks, f"{time.time_ns()}").write_text(node)
    time.sleep(seconds)
    (ctx.root / "out" / "slow.txt").write_text("slept")
    return "slept"


def heap_kept(ctx: TaskContext) -> bool:
    from deltalens.io import heap
    return heap.keeping()


def graph(extra: tuple = ()) -> list[Task]:
    return [
        Task("a", write_a, args=("alpha",), outputs=("out/a.txt",)),
        Task("b", write_b, deps=("a",), kind="train", outputs=("out/b",)),
        Task("c", write_c, kwargs={"n": 3}, deps=("a",), outputs=("out/c.txt",)),
        Task("d", write_d, deps=("b", "c"), kind="eval", outputs=("out/d.json",)),
        Task("e", count_up, outputs=("out/e",)),
        *extra,
    ]


def tree(root: Path) -> dict[str, bytes]:
    """Every file under root (relative path -> bytes), the executor's hidden token and the tasks' costs (times,
    hosts) left out."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.startswith(".deltalens-ray") and p.name != COSTS}


def node_ids(address: str) -> dict[str, str]:
    """{custom resource name: node id} of the fixture's nodes."""
    return {r: n["NodeID"] for n in ray.nodes() if n["Alive"] for r in ("head", "worker") if r in n["Resources"]}


# every toy task but one may run anywhere; a is pinned to the head and b to the worker
PLACE = {"a": {"resources": {"head": 0.01}}, "b": {"resources": {"worker": 0.01}}}


@pytest.mark.ray_cluster
@pytest.mark.parametrize("shared_fs", [None, False], ids=["shared", "copying"])
def test_toy_graph_matches_local_on_both_nodes(ray_cluster, tmp_path, shared_fs):
    local_root, ray_root = tmp_path / "local", tmp_path / "ray"
    want = LocalExecutor().run(graph(), local_root, log=lambda s: None)
    lines, stream = [], io.StringIO()
    ex = RayExecutor(ray_cluster.address, shared_fs=shared_fs, options=PLACE, progress="plain", stream=stream,
                     log=lines.append)
    got = ex.run(graph(), ray_root, log=lines.append)
    assert got == want and list(got) == list(want)
    assert want["d"] == {"d": "alpha+b|alphaalphaalpha", "c": 15} and want["e"] == 1
    assert tree(ray_root) == tree(local_root)  # every output in the study directory, byte for byte
    assert not ray.is_initialized()  # the executor joined the cluster and left it
    # one mode for the whole study, said in one line: both nodes are this machine, so they share the disk
    assert ex.mode == ("shared" if shared_fs is None else "objects")
    assert any(x.startswith("ray: 2 node(s)") for x in lines)
    assert "d: combined 22 characters" in lines  # a task's own log lines reach the driver's log
    # placement: records name the node of every task, and the pinned ones ran where they were pinned
    recs = ex.records
    assert set(recs) == set(want)
    assert len({r.node_id for r in recs.values()}) == 2
    assert recs["b"].node_id != recs["a"].node_id and all(r.attempts == 1 for r in recs.values())
    assert all(r.elapsed_s >= 0 and r.host for r in recs.values())
    assert all(r.peak_rss_kb > 0 for r in recs.values())  # the workers' resident memory, read while they ran
    costs = [json.loads(x) for x in (ray_root / COSTS).read_text().splitlines()]
    assert sorted(c["task"] for c in costs) == sorted(want) and {c["host"] for c in costs} == {r.host for r in recs.values()}
    assert {c["task"]: c["peak_rss_kb"] for c in costs} == {k: r.peak_rss_kb for k, r in recs.items()}
    out = stream.getvalue()
    assert "ray: b: done on " in out and "ray: d: queued" in out and out.splitlines()[-1].startswith("ray: 5 done")
    assert not list(ray_root.glob(".ray-*")) and not (ray_root / ".deltalens-ray-token").exists()

    # a second run of the same graph resumes: the resumable task continues from its own output (sent
    # back to the worker in the copying mode), everything else is rewritten identically
    want2 = LocalExecutor().run(graph(), local_root, log=lambda s: None)
    got2 = RayExecutor(ray_cluster.address, shared_fs=shared_fs, progress="off").run(graph(), ray_root,
                                                                                       log=lambda s: None)
    assert got2 == want2 and got2["e"] == 2
    assert tree(ray_root) == tree(local_root)


@pytest.mark.ray_cluster
def test_workers_keep_freed_memory_when_the_driver_does(ray_cluster, tmp_path, monkeypatch):
    from deltalens.io import heap
    monkeypatch.delenv("DELTALENS_MALLOC", raising=False)
    monkeypatch.setattr(heap, "_keeping", True)  # as after the CLI's keep_freed_memory(training=True)
    tasks = [Task("k", heap_kept, outputs=()), Task("h", heap_kept, outputs=(), deps=("k",))]
    got = RayExecutor(ray_cluster.address, shared_fs=True, progress="off", options={"k": PLACE["a"],
                      "h": PLACE["b"]}).run(tasks, tmp_path / "study", log=lambda s: None)
    assert got == {"k": True, "h": True}  # on both nodes, the worker set glibc to keep (mallopt took)


@pytest.mark.ray_cluster
def test_a_task_error_is_one_line_and_not_retried(ray_cluster, tmp_path):
    marker = tmp_path / "ran.txt"
    bad = Task("bad", fail_once_logged, args=(str(marker),), deps=("a",))
    ex = RayExecutor(ray_cluster.address, shared_fs=False, progress="off", log=lambda s: None)
    with pytest.raises(DeltalensError, match=r"^bad: the toy task refuses$"):
        ex.run(graph((bad,)), tmp_path / "study", log=lambda s: None)
    assert marker.read_text() == "ran\n"  # max_retries covers dead workers, not a task's own refusal
    assert not ray.is_initialized()


@pytest.mark.ray_cluster
def test_copying_mode_refuses_a_driver_path_before_any_work(ray_cluster, tmp_path):
    root = tmp_path / "study"
    t = Task("a", write_a, args=(str(root / "elsewhere"),), outputs=("out/a.txt",))
    with pytest.raises(DeltalensError, match="names .*elsewhere, a path on the driver's disk"):
        RayExecutor(ray_cluster.address, shared_fs=False, progress="off", log=lambda s: None).run(
            [t], root, log=lambda s: None)
    assert not (root / "out").exists()


@pytest.mark.ray_cluster
def test_killed_worker_raylet_mid_task_is_retried_elsewhere(fresh_ray_cluster, tmp_path):
    """The slow task starts on the worker node; its raylet is killed (SIGKILL) while the task sleeps; Ray
    reruns the task on the head (soft affinity), and the graph ends with LocalExecutor's result."""
    marks = tmp_path / "marks"
    marks.mkdir()
    slow_task = Task("slow", slow, args=(str(marks), 6.0), deps=("a",), outputs=("out/slow.txt",))
    after = Task("after", write_d, deps=("b", "c", "slow"), outputs=("out/d.json",))
    tasks = [t for t in graph((slow_task,)) if t.key != "d"] + [after]
    local_marks = tmp_path / "local-marks"
    local_marks.mkdir()
    want = LocalExecutor().run([Task(t.key, t.fn, (str(local_marks), 0.0), t.kwargs, t.deps, t.kind, t.cpus,
                                     t.gpus, t.outputs) if t.key == "slow" else t for t in tasks],
                               tmp_path / "local", log=lambda s: None)
    ray.init(address=fresh_ray_cluster.address, log_to_driver=False, configure_logging=False)
    try:
        ids = node_ids(fresh_ray_cluster.address)
        place = {"a": {"resources": {"head": 0.01}},
                 "slow": {"scheduling_strategy": NodeAffinitySchedulingStrategy(ids["worker"], soft=True)}}
        lines, stream = [], io.StringIO()
        ex = RayExecutor(fresh_ray_cluster.address, shared_fs=False, options=place, progress="plain",
                         stream=stream, log=lines.append)
        box: dict = {}

        def drive():
            try:
                box["got"] = ex.run(tasks, tmp_path / "ray", log=lambda s: None)
            except BaseException as e:  # noqa: BLE001 - handed to the test thread
                box["error"] = e

        th = threading.Thread(target=drive, daemon=True)
        th.start()
        deadline = time.monotonic() + 60
        while not list(marks.iterdir()) and time.monotonic() < deadline and th.is_alive():
            time.sleep(0.2)
        first = sorted(marks.iterdir())
        assert first and first[0].read_text() == ids["worker"], box.get("error")
        raylet = fresh_ray_cluster.nodes["worker"].raylet_pid()
        assert raylet is not None
        os.kill(raylet, signal.SIGKILL)
        th.join(timeout=120)
        assert not th.is_alive(), "the graph did not finish after its node died"
        assert "error" not in box, box.get("error")
        assert box["got"] == want
        runs = sorted(marks.iterdir())
        assert len(runs) == 2 and runs[1].read_text() == ids["head"]  # rerun once, on the surviving node
        rec = ex.records["slow"]
        assert rec.node_id == ids["head"] and rec.attempts == 2, (lines, stream.getvalue())
        assert any("slow: its worker on" in x and "died" in x for x in lines)
        assert (tmp_path / "ray" / "out" / "slow.txt").read_text() == "slept"
    finally:
        ray.shutdown()


# -- the file transport without Ray's scheduling (fast)
def test_only_changes_travel_back_and_concurrent_writers_merge(tmp_path):
    from deltalens.study.ray_executor import changes, snapshot, unpack

    driver = tmp_path / "study"
    (driver / "runs" / "r" / "checkpoints" / "iter-1").mkdir(parents=True)
    (driver / "runs" / "r" / "checkpoints" / "iter-1" / "w.bin").write_bytes(b"old")
    (driver / "runs" / "r" / "state.json").write_text("1")
    (driver / "cache").mkdir()
    (driver / "cache" / "base.json").write_text("{}")
    inputs = pack(driver, ["runs/r", "cache", "runs/r/checkpoints"])  # nested paths travel once

    def worker(name, work):  # unpack the driver's copy, run `work`, return what changed
        root = tmp_path / name
        root.mkdir()
        unpack(inputs, root)
        before = snapshot(root, ["runs/r", "cache"])
        work(root)
        changed, deleted, missing = changes(root, ["runs/r", "cache", "nothing"], before)
        assert missing == ["nothing"]
        return pack(root, changed, recursive=False), deleted, changed

    def train(root):  # a resumed run: a new checkpoint, the old one rotated away, its state rewritten
        (root / "runs/r/checkpoints/iter-2").mkdir()
        (root / "runs/r/checkpoints/iter-2/w.bin").write_bytes(b"new")
        (root / "runs/r/state.json").write_text("2")
        (root / "runs/r/checkpoints/iter-1/w.bin").unlink()
        (root / "runs/r/checkpoints/iter-1").rmdir()

    blob, deleted, changed = worker("w1", train)
    assert sorted(changed) == ["runs/r/checkpoints/iter-2", "runs/r/checkpoints/iter-2/w.bin", "runs/r/state.json"]
    assert sorted(deleted) == ["runs/r/checkpoints/iter-1", "runs/r/checkpoints/iter-1/w.bin"]
    # two measurements that ran side by side, each adding its own entry to the shared cache
    blob_a, del_a, _ = worker("wa", lambda root: (root / "cache/a.json").write_text("A"))
    blob_b, del_b, _ = worker("wb", lambda root: (root / "cache/b.json").write_text("B"))
    install(driver, blob, deleted)
    install(driver, blob_a, del_a)
    install(driver, blob_b, del_b)
    assert tree(driver) == {"cache/a.json": b"A", "cache/b.json": b"B", "cache/base.json": b"{}",
                            "runs/r/checkpoints/iter-2/w.bin": b"new", "runs/r/state.json": b"2"}
    assert not (driver / "runs/r/checkpoints/iter-1").exists()
    assert not list(driver.glob(".ray-incoming-*"))
    (driver / ".ray-incoming-x").mkdir()  # what a driver killed inside install leaves
    recover(driver)
    assert not list(driver.glob(".ray-incoming-*"))


def test_unpack_refuses_links_and_escapes(tmp_path):
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("out/link")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(info)
    with pytest.raises(DeltalensError, match="only regular files and directories"):
        install(tmp_path, buf.getvalue())
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("../escape")
        info.size = 0
        tar.addfile(info, io.BytesIO(b""))
    with pytest.raises(DeltalensError, match="outside the study directory"):
        install(tmp_path, buf.getvalue())
    assert not (tmp_path.parent / "escape").exists() and not list(tmp_path.iterdir())


def test_bad_settings_are_refused_before_ray(tmp_path):
    with pytest.raises(DeltalensError, match="not both"):
        RayExecutor(None, shared_fs=True, artefacts=str(tmp_path))
    with pytest.raises(DeltalensError, match="another scheme"):
        RayExecutor(None, artefacts="s3://bucket/x")
    with pytest.raises(DeltalensError, match="does not exist"):
        RayExecutor(None, artefacts=str(tmp_path / "nope"))
    with pytest.raises(DeltalensError, match="outputs must be paths inside"):
        RayExecutor(None).run([Task("a", write_a, args=("x",), outputs=("../x",))], tmp_path)
    assert not ray.is_initialized()
