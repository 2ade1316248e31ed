"""Ray backend faults (issue #36 item 8): SIGTERM ends a Ray run as a local one ends (killed by the signal,
what a shell reports as exit 143, no native stack dump, resumable); a driver killed with SIGKILL leaves no
Ray process of its own behind; Ray's out-of-memory kills become one line of advice.

Real Ray starts cost 10-40 s here: the SIGTERM test starts one, the SIGKILL test (slow) another; the reaper
and the out-of-memory errors are also tested without Ray.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from support import proc_stat, run_cli, tiny_spec

from deltalens.training.es.backends import ray as ray_backend
from deltalens.training.es.engine import ESEngine

RAY_DIR = os.path.dirname(ray.__file__)
ES_FAST = ["--population", "4", "--prompts-per-iteration", "4", "--max-new-tokens", "16", "--eval-every", "0"]
pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc (Linux)")


# -- /proc helpers
def _stat(pid: int):
    f = proc_stat(pid)
    if f is None:
        return None
    return f[0], int(f[1]), int(f[19])  # state, ppid, start time


def _alive(pid: int, start: int) -> bool:
    st = _stat(pid)
    return st is not None and st[2] == start and st[0] != b"Z"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _descendants(root: int) -> dict[int, int]:
    """{pid: start time} of every process below `root`."""
    procs = {int(d): st for d in os.listdir("/proc") if d.isdigit() and (st := _stat(int(d)))}
    found, todo = {}, [root]
    while todo:
        parent = todo.pop()
        for pid, (_, ppid, start) in procs.items():
            if ppid == parent and pid not in found:
                found[pid] = start
                todo.append(pid)
    return found


def _ray_procs(root: int) -> dict[int, str]:
    """Ray's processes below `root`, with their command lines (the reaper itself excluded)."""
    out = {}
    for pid in _descendants(root):
        cmd = _cmdline(pid)
        if (cmd.startswith("ray::") or RAY_DIR in cmd) and "select.select" not in cmd:
            out[pid] = cmd[:80]
    return out


def _wait_gone(procs: dict[int, int], timeout: float) -> list[str]:
    """Wait until none of `procs` ({pid: start time}) lives; returns the command lines of those left."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p, t in procs.items() if _alive(p, t)]
        if not left:
            return []
        time.sleep(0.25)
    return [f"{p}: {_cmdline(p)[:80]}" for p in procs if _alive(p, procs[p])]


def _start_ray_run(out: Path) -> tuple[subprocess.Popen, dict[int, int]]:
    """`deltalens train es --backend ray --workers 2` in a subprocess, once its first iteration is logged;
    returns the process and its Ray processes ({pid: start time}) at that moment."""
    tiny_spec()
    exe = Path(sys.executable).with_name("deltalens")
    p = subprocess.Popen([str(exe), "train", "es", "--model", "tiny", "--backend", "ray", "--workers", "2",
                          *ES_FAST, "--iterations", "500", "--checkpoint-every", "1", "-o", str(out)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                         env={**os.environ, "DELTALENS_PROGRESS": "0"})
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text().strip()):
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            pytest.fail(f"the Ray run did not start (rc {p.wait()}):\n{p.stdout.read().decode()[-3000:]}")
        time.sleep(0.5)
    procs = _descendants(p.pid)
    ray_procs = {pid: procs[pid] for pid in _ray_procs(p.pid)}
    names = " ".join(_cmdline(pid) for pid in ray_procs)
    assert "ray::DashboardAgent" in names and "ray::ESWorker" in names and "raylet" in names, names
    return p, ray_procs


def test_sigterm_ends_a_ray_run_quietly_and_resumably(tmp_path):
    run = tmp_path / "run"
    p, procs = _start_ray_run(run)
    p.send_signal(signal.SIGTERM)
    try:
        rc = p.wait(timeout=60)
    finally:
        p.kill()
    out = p.stdout.read().decode()
    # killed by SIGTERM, as the local backend is: a shell reports 143 (Ray's handlers made it 15, or 134)
    assert rc == -signal.SIGTERM, (rc, out)
    for native in ("SIGTERM received", "logging.cc", "Traceback", "Fatal Python error"):
        assert native not in out, out
    assert not _wait_gone(procs, 30)
    # state consistent: the run resumes from its last checkpoint and grows by one iteration
    state = json.loads((run / "state.json").read_text())
    done = state["iteration"]
    assert done >= 1 and (run / "checkpoints" / state["checkpoint"]).is_dir()
    r = run_cli(["train", "es", "--resume", run, "--backend", "local", "--iterations", done + 1])
    assert r.exit_code == 0, r
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in rows] == list(range(1, done + 2))
    assert (run / "checkpoints" / "final").is_dir()
    assert not [f for f in run.rglob("*") if ".tmp" in f.name]


@pytest.mark.slow
def test_sigkill_of_the_driver_leaves_no_ray_process(tmp_path):
    p, procs = _start_ray_run(tmp_path / "run")
    p.send_signal(signal.SIGKILL)
    assert p.wait(timeout=10) == -signal.SIGKILL
    # without the reaper, ray::DashboardAgent and ray::RuntimeEnvAgent outlived the driver
    assert not _wait_gone(procs, 30)


# The reaper without Ray: a fake driver starts it, then a fake raylet (a Ray-looking command line) that
# starts a fake agent, and an unrelated child; the test kills the driver and the raylet with SIGKILL (Ray's
# PR_SET_PDEATHSIG does that to the real raylet), which orphans the agent.
_FAKE_DRIVER = r"""
import os, subprocess, sys, time
from deltalens.training.es.backends.ray import start_reaper
ray_dir = sys.argv[1]
reaper = start_reaper()
agent = "import subprocess, sys, time; subprocess.Popen(sys.argv[2:]); time.sleep(300)"
raylet = subprocess.Popen([sys.executable, "-c", agent, ray_dir + "/raylet",
                           sys.executable, "-c", "import time; time.sleep(300)", ray_dir + "/agent"])
other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
late = os.fork()  # shows this driver's command line (which names the ray directory) for 1 s, then execs
if late == 0:
    time.sleep(1.0)
    os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(300)"])
print(reaper[0].pid, raylet.pid, other.pid, late, flush=True)
time.sleep(300)
"""


def test_reaper_ends_the_orphans_of_a_killed_driver_and_nothing_else():
    driver = subprocess.Popen([sys.executable, "-c", _FAKE_DRIVER, RAY_DIR], stdout=subprocess.PIPE, text=True)
    other, late, watched = None, None, {}
    try:
        reaper, raylet, other, late = map(int, driver.stdout.readline().split())
        deadline = time.monotonic() + 30
        while not (agent := [p for p in _descendants(raylet) if "/agent" in _cmdline(p)]):
            assert time.monotonic() < deadline, "the fake agent did not start"
            time.sleep(0.1)
        agent = agent[0]
        watched = {pid: start for pid, start in _descendants(driver.pid).items() if pid in (raylet, agent)}
        other_start, late_start = _stat(other)[2], _stat(late)[2]
        time.sleep(1.5)  # the reaper looks every 0.5 s; `late` has exec'd by now
        assert "ray" not in _cmdline(late), _cmdline(late)
        os.kill(driver.pid, signal.SIGKILL)
        os.kill(raylet, signal.SIGKILL)
        driver.wait(timeout=10)
        assert _stat(agent)[1] != raylet  # orphaned: no longer below the driver
        assert not _wait_gone(watched, 10)
        assert not _wait_gone({reaper: _stat(reaper)[2]} if _stat(reaper) else {}, 10)
        assert _alive(other, other_start), "the reaper killed a process that is not Ray's"
        assert _alive(late, late_start), "the reaper killed a child it saw before its exec"
    finally:
        driver.kill()
        for pid in [*watched, other, late] if other else watched:  # whatever a failed test left
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def test_only_memory_pressure_counts_as_out_of_memory():
    oom = ray.exceptions.RayActorError(error_msg="The actor died. Workers (tasks / actors) killed due to "
                                                 "memory pressure (OOM), 1 worker(s) were killed")
    crash = ray.exceptions.RayActorError(error_msg="The actor died unexpectedly. Some common causes include: "
                                                   "(1) the process was killed by the OOM killer due to high "
                                                   "memory usage, (2) ray stop --force was called")
    assert ray_backend.is_oom(ray.exceptions.OutOfMemoryError("Task was killed due to the node running low"))
    assert ray_backend.is_oom(oom)
    assert not ray_backend.is_oom(ray.exceptions.ActorDiedError())
    died = ray.exceptions.RayActorError(error_msg="The actor is dead because its worker process has died. Worker "
                                                  "exit detail: Task was killed due to the node running low on "
                                                  "memory. Memory on the node was 7.5GB / 7.8GB")
    assert ray_backend.is_oom(died)
    assert not ray_backend.is_oom(crash)  # an ordinary death: the backend replaces the worker
    assert not ray_backend.is_oom(ValueError("memory pressure"))


@pytest.fixture
def fake_ray(monkeypatch):
    """Ray replaced by stand-ins whose ray.get raises `fake_ray.errors[method]` (a dict to fill)."""

    class Actor:
        def __getattr__(self, method):
            return type("M", (), {"remote": staticmethod(lambda *a: (method, object()))})  # a hashable ref

    errors: dict[str, BaseException] = {}

    def get(refs):
        for method, _ in refs if isinstance(refs, list) else [refs]:
            if method in errors:
                raise errors[method]
        return ["c"] * len(refs) if isinstance(refs, list) else "c"

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: None)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(ray, "kill", lambda actor: None)
    monkeypatch.setattr(ray, "remote", lambda **kw: lambda cls: type("C", (), {"remote": lambda *a: Actor()}))
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns=1, timeout=None: (list(refs)[:num_returns], []))
    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ESEngine, "checksum", lambda self: "c")  # every replica agrees
    return errors


@pytest.mark.parametrize("method,error", [
    ("checksum", ray.exceptions.OutOfMemoryError("Task was killed due to the node running low on memory.")),
    ("evaluate", ray.exceptions.RayActorError(error_msg="Workers (tasks / actors) killed due to memory "
                                                        "pressure (OOM)")),
], ids=["at-start", "actor-killed-mid-iteration"])
def test_out_of_memory_is_one_line_of_advice(fake_ray, tmp_path, method, error):
    tiny_spec()
    fake_ray[method] = error
    handler = signal.getsignal(signal.SIGTERM)
    r = run_cli(["train", "es", "--model", "tiny", "--backend", "ray", "--workers", "3", *ES_FAST,
                 "--iterations", "2", "-o", tmp_path / "run"])
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2, r
    # one error line, last (a run that started printed its progress line before it)
    assert sum(ln.startswith("error") for ln in lines) == 1 and "Traceback" not in r.output, r.output
    assert lines[-1] == "error: " + ray_backend.OOM_ADVICE.format(workers=3), lines[-1]
    assert signal.getsignal(signal.SIGTERM) is handler  # the backend's SIGTERM handler is gone
    reapers = [p for p in _descendants(os.getpid()) if "select.select" in _cmdline(p)]
    assert not reapers, "the reaper outlived the backend"
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())
