"""`deltalens sweep --ray`: every training run and every score is a Task (scores depending on their runs), the
Ray options are the study's (`deltalens.study.cluster.RayOptions`) and reach the executor and every task,
without --ray the graph runs here in the order a sweep always ran, and the order (or Ray) changes nothing in
DIR: the same sweep.json, the same files, resumable from either side.

Fast: the graph, the refusals, and the CLI with a recording RayExecutor (that runs the graph here in another
order). A real Ray of this process (`RayExecutor(None)`, the copying file mode) on the tiny sweep: ~30 s on 2
cores. Slow (`-m slow`): the same sweep on the local 2-node cluster of tests/study/conftest.py, both file modes.
"""

from __future__ import annotations

import json
import pickle
import types

import pytest
from support import run_cli, tiny_spec

from deltalens.errors import DeltalensError
from deltalens.study import cluster, sweep
from deltalens.study.cluster import RayOptions
from deltalens.study.executor import LocalExecutor, check_graph

GRID = ["sigma=3e-3,6e-3"]
FIXED = {"iterations": 1, "population": 2, "prompts_per_iteration": 2, "eval_every": 0}
TINY = ["--iterations", "1", "--population", "2", "--prompts-per-iteration", "2", "--eval-every", "0",
        "--val-limit", "4", "--val-samples", "2"]
RUNS = ["sigma=0.003-s0", "sigma=0.003-s1", "sigma=0.006-s0", "sigma=0.006-s1"]


def _tasks(out, ray: RayOptions, seeds=(0, 1)):
    ev = sweep.Evaluation(limit=4, samples=2, seeds=seeds)
    runs = sweep.plan("es", sweep.parse_grid("es", GRID), {"model": "tiny", "task": "arith", **FIXED},
                      preset="tiny", ev=ev, out=out)
    return sweep.sweep_tasks("es", runs, "tiny", ev, ray)


def comparable(path) -> dict:
    doc = json.loads(path.read_text())
    doc.pop("seconds")  # how long it took
    return doc


def files(out) -> dict[str, bytes]:
    """Every file of a sweep directory, byte for byte, but those that record time or a process (sweep.json and
    sweep.md state the seconds, metrics rows time each iteration, a run's .lock names its writer's pid,
    costs.jsonl each task's time and memory)."""
    skip = ("sweep.json", "sweep.md", "metrics.jsonl", ".lock", "costs.jsonl")
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.name not in skip}


# ------------------------------------------------------------------------------------------- the graph


def test_every_run_and_every_score_is_a_task_with_its_deps_outputs_and_resources(tmp_path):
    out = tmp_path / "sw"
    tasks = _tasks(out, RayOptions(ray="auto", cpus_per_run=2, gpus_per_run=0.5))
    assert [t.key for t in tasks] == [f"train:{r}" for r in RUNS] + ["eval:base"] + [f"eval:{r}" for r in RUNS]
    by = {t.key: t for t in tasks}
    for r in RUNS:
        assert (by[f"train:{r}"].kind, by[f"train:{r}"].deps, by[f"train:{r}"].outputs) == ("train", (), (f"runs/{r}",))
        assert (by[f"eval:{r}"].kind, by[f"eval:{r}"].deps, by[f"eval:{r}"].outputs) == ("eval", (f"train:{r}",),
                                                                                       ("cache",))
        assert by[f"eval:{r}"].kwargs == {"run": r}
    assert by["eval:base"].deps == () and by["eval:base"].kwargs == {"model": "tiny"}
    assert {(t.cpus, t.gpus) for t in tasks} == {(2.0, 0.5)}
    assert [t.key for t in check_graph(tasks)] == [t.key for t in tasks]  # the local order is the plan order
    assert {(t.cpus, t.gpus) for t in _tasks(out, RayOptions())} == {(1.0, 0.0)}  # the study's defaults
    for t in tasks:  # a Ray worker gets the function by reference and arguments that name no driver path
        assert getattr(sweep, t.fn.__name__) is t.fn
        assert pickle.loads(pickle.dumps(t)).key == t.key
        assert str(out) not in repr((t.args, t.kwargs)), t.key
    ray_executor = pytest.importorskip("deltalens.study.ray_executor")
    assert all(ray_executor._mentions((t.args, t.kwargs), str(out)) is None for t in tasks)


def test_the_ray_options_are_the_studys():
    """One definition: the study declares RayOptions' fields (type, default, help line, `needs` rule) in its
    own place among its options, and checks them with the same checks."""
    from deltalens.study.config import StudyConfig

    names = [f.name for f in RayOptions.fields()]
    assert names == ["ray", "cpus_per_run", "gpus_per_run", "ray_files"]
    study = {f.name: f for f in StudyConfig.fields()}
    for n in names:
        assert StudyConfig.types()[n] == RayOptions.types()[n], n
        assert (study[n].default, dict(study[n].metadata)) == (RayOptions.field(n).default,
                                                               dict(RayOptions.field(n).metadata)), n
    for bad, msg in (({"ray": " "}, "--ray must be"), ({"ray": "auto", "cpus_per_run": 0}, "--cpus-per-run must")):
        for cls in (RayOptions, StudyConfig):
            with pytest.raises(DeltalensError, match=msg):
                cls(**bad)
    with pytest.raises(DeltalensError, match="--gpus-per-run is only used when --ray is set"):
        RayOptions.resolve(given={"gpus_per_run": 1.0})


# ------------------------------------------------------------------------------------------- the CLI


@pytest.mark.parametrize("args,msg", [
    (["--cpus-per-run", "2"], "error: --cpus-per-run is only used when --ray is set"),
    (["--gpus-per-run", "1"], "error: --gpus-per-run is only used when --ray is set"),
    (["--ray-files", "shared"], "error: --ray-files is only used when --ray is set"),
    (["--ray", " "], "error: --ray must be auto, local or host:port"),
    (["--ray", "auto", "--cpus-per-run", "0"], "error: --cpus-per-run must be > 0"),
])
def test_ray_options_without_ray_or_bad_are_refused_before_writing(tmp_path, args, msg):
    out = tmp_path / "sw"
    r = run_cli(["sweep", "es", "--model", tiny_spec(), "--grid", "sigma=1e-3", *TINY, "--out", str(out), *args])
    assert r.exit_code == 2 and r.output.strip().startswith(msg) and len(r.output.strip().splitlines()) == 1, \
        r.output
    assert not out.exists()


def test_a_missing_ray_files_directory_is_refused_before_writing(tmp_path):
    pytest.importorskip("ray")
    out = tmp_path / "sw"
    r = run_cli(["sweep", "grpo", "--model", tiny_spec(), "--grid", "lr=1e-6", "--out", str(out), "--ray", "auto",
                 "--ray-files", str(tmp_path / "absent")])
    assert r.exit_code == 2 and "the artefacts directory" in r.output and "does not exist" in r.output, r.output
    assert not out.exists()


def test_ray_options_reach_the_executor_and_every_task_and_change_nothing_in_dir(tmp_path, monkeypatch):
    """The reference: the sweep without --ray, on a LocalExecutor in plan order. Then with --ray HOST:PORT and
    its options, on a recording RayExecutor that runs the same graph here, each score right after its run
    and the last run first: the same sweep.json and files; a rerun of either directory trains nothing."""
    local_orders, made = [], []

    class SpyLocal(LocalExecutor):
        def run(self, tasks, root, log=print):
            local_orders.append([t.key for t in check_graph(tasks)])
            return super().run(tasks, root, log)

    class RecordingRay:
        def __init__(self, **kw):
            made.append(kw)

        def run(self, tasks, root, log=print):
            self.tasks = list(tasks)
            made.append(self.tasks)
            by = {t.key: t for t in tasks}
            runs = [t.key.removeprefix("train:") for t in tasks if t.kind == "train"]
            order = [by["eval:base"]] + [by[f"{k}:{r}"] for r in reversed(runs) for k in ("train", "eval")]
            assert sorted(t.key for t in order) == sorted(by)
            return LocalExecutor().run(order, root, log)

    monkeypatch.setattr(cluster, "LocalExecutor", SpyLocal)
    monkeypatch.setattr(cluster, "importlib", types.SimpleNamespace(import_module=lambda name: types.SimpleNamespace(
        RayExecutor=RecordingRay) if name == "deltalens.study.ray_executor" else None))
    head = ["sweep", "es", "--model", tiny_spec(), "--grid", *GRID, "--seeds", "0,1", *TINY]

    r = run_cli([*head, "--out", str(tmp_path / "here")])
    assert r.exit_code == 0, r.output
    assert local_orders == [[f"train:{x}" for x in RUNS] + ["eval:base"] + [f"eval:{x}" for x in RUNS]]
    assert not made

    r = run_cli([*head, "--out", str(tmp_path / "ray"), "--ray", "10.0.0.7:6379", "--cpus-per-run", "2",
                 "--gpus-per-run", "0.5", "--ray-files", "shared"])
    assert r.exit_code == 0, r.output
    kw, tasks = made
    assert {k: v for k, v in kw.items() if k != "log"} == {"address": "10.0.0.7:6379", "shared_fs": True,
                                                           "config_files": ()}
    assert len(tasks) == 9 and {(t.cpus, t.gpus) for t in tasks} == {(2.0, 0.5)}
    assert len(local_orders) == 1  # the Ray path did not fall back to the local executor

    here, ray = tmp_path / "here", tmp_path / "ray"
    assert comparable(ray / "sweep.json") == comparable(here / "sweep.json")
    assert files(ray) == files(here)
    for d in (here, ray):  # resumable: a rerun (here, without --ray) trains and scores nothing
        r = run_cli([*head, "--out", str(d)])
        assert r.exit_code == 0 and r.output.count(": done") == 4 and "training" not in r.output, r.output
        assert r.output.count("cached: sweep-eval-") == 5, r.output
        assert comparable(d / "sweep.json") == comparable(here / "sweep.json")


# ------------------------------------------------------------------------------------------- a real Ray


def _reference(tmp_path_factory):
    """The sweep in this process with one torch thread (what Ray gives a 1-CPU task), as the reference."""
    import torch

    out = tmp_path_factory.mktemp("local") / "sw"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sweep.run_sweep("es", sweep.parse_grid("es", GRID), {"model": tiny_spec(), **FIXED}, out,
                        ev=sweep.Evaluation(limit=4, samples=2, seeds=(0,)), log=lambda s: None)
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _reference(tmp_path_factory)


def _on_ray(out, executor, log=lambda s: None):
    return sweep.run_sweep("es", sweep.parse_grid("es", GRID), {"model": tiny_spec(), **FIXED}, out,
                           ev=sweep.Evaluation(limit=4, samples=2, seeds=(0,)), log=log, executor=executor)


def test_a_sweep_on_a_local_ray_equals_the_sweep_here(reference, tmp_path, monkeypatch):
    """`--ray local` (a Ray of this process), files through the object store: tasks run in temp directories and
    only what they wrote travels back; DIR ends as the sweep run here left its own."""
    ray_executor = pytest.importorskip("deltalens.study.ray_executor")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # as tests/study/conftest.py: no token from another test
    ex = ray_executor.RayExecutor(None, shared_fs=False, progress="off", log=lambda s: None, config_files=())
    out = tmp_path / "sw"
    _on_ray(out, ex)
    assert ex.mode == "objects"
    assert sorted(ex.records) == sorted(["train:sigma=0.003-s0", "train:sigma=0.006-s0", "eval:base",
                                         "eval:sigma=0.003-s0", "eval:sigma=0.006-s0"])
    assert comparable(out / "sweep.json") == comparable(reference / "sweep.json")
    assert files(out) == files(reference)
    lines = []
    _on_ray(out, LocalExecutor(), log=lines.append)  # resumed here: nothing is trained or scored again
    assert sum(": done" in x for x in lines) == 2 and sum(x.startswith("cached: ") for x in lines) == 3, lines


@pytest.mark.slow
@pytest.mark.ray_cluster
@pytest.mark.parametrize("shared_fs", [None, False], ids=["shared", "copying"])
def test_a_sweep_on_two_nodes_equals_the_sweep_here(ray_cluster, reference, tmp_path, shared_fs):
    from deltalens.study.ray_executor import RayExecutor

    ex = RayExecutor(ray_cluster.address, shared_fs=shared_fs, options={"train": {"scheduling_strategy": "SPREAD"}},
                     progress="off", log=lambda s: None, config_files=())
    out = tmp_path / "sw"
    _on_ray(out, ex)
    assert ex.mode == ("shared" if shared_fs is None else "objects")
    assert len({r.node_id for r in ex.records.values() if r.kind == "train"}) == 2, ex.records
    assert comparable(out / "sweep.json") == comparable(reference / "sweep.json")
    assert files(out) == files(reference)
