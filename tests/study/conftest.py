"""A local 2-node Ray cluster on this machine, for the study-on-Ray tests: a head (`ray start --head`) and a
worker (`ray start --address`), each with its own temp dir, 1 CPU and a custom resource naming it ("head",
"worker"), every port chosen free so that no other Ray on the machine is touched.

Each node is a `ray start --block` in its own session: stopping the cluster ends exactly the processes of
those two sessions (never `ray stop`, which ends every Ray process of the machine), and a node whose raylet
is killed is torn down by its own `ray start --block`, as a lost machine would be."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from support import proc_stat

RAY = Path(sys.executable).with_name("ray")
# Ray turns token authentication on for `ray start` when ~/.ray/auth_token exists, which any local
# `ray.init()` of another test creates: the nodes and the driver all say explicitly that it is off.
AUTH_MODE = "disabled"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stat(pid: int):
    f = proc_stat(pid)
    if f is None:
        return None
    return f[0], int(f[3])  # state, session id


def session_pids(sid: int) -> list[int]:
    """Live processes of session `sid` (zombies left out)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit() and (st := _stat(int(d))) and st[1] == sid and st[0] != b"Z":
            out.append(int(d))
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class Node:
    def __init__(self, name: str, proc: subprocess.Popen, temp: Path, log: Path):
        self.name, self.proc, self.temp, self.log = name, proc, temp, log

    def raylet_pid(self) -> int | None:
        for pid in session_pids(self.proc.pid):
            if "/raylet/raylet " in cmdline(pid):
                return pid
        return None

    def stop(self) -> None:
        sid = self.proc.pid
        for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
            pids = session_pids(sid)
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait
            while session_pids(sid) and time.monotonic() < deadline:
                time.sleep(0.1)
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=5)


class LocalCluster:
    """Start with `start()`, stop with `stop()` (idempotent; the fixtures call it even when a test fails)."""

    def __init__(self):
        self.base = Path(tempfile.mkdtemp(prefix="dlray-", dir="/tmp"))  # short: Ray's socket paths
        self.nodes: dict[str, Node] = {}
        self.address: str | None = None

    def _start(self, name: str, args: list[str]) -> Node:
        temp = self.base / name
        temp.mkdir()
        log = self.base / f"{name}.log"
        ports = ["--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port",
                 "--metrics-export-port"]
        cmd = [str(RAY), "start", "--block", "--num-cpus=1", f"--temp-dir={temp}", "--disable-usage-stats",
               "--object-store-memory=100000000", f'--resources={{"{name}": 1}}',
               *[f"{p}={free_port()}" for p in ports], *args]
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": AUTH_MODE}
        with open(log, "wb") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env=env)
        node = Node(name, proc, temp, log)
        self.nodes[name] = node
        return node

    def _wait(self, node: Node, ready, timeout: float = 90.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if node.proc.poll() is not None:
                raise RuntimeError(f"ray start ({node.name}) exited {node.proc.returncode}: "
                                   + node.log.read_text(errors="replace")[-2000:])
            if (got := ready()) is not None:
                return got
            time.sleep(0.3)
        raise RuntimeError(f"ray start ({node.name}) not ready after {timeout:.0f} s")

    def start(self) -> LocalCluster:
        head = self._start("head", ["--head", "--port=0", "--include-dashboard=false",
                                    f"--dashboard-port={free_port()}", f"--ray-client-server-port={free_port()}"])
        marker = head.temp / "ray_current_cluster"
        self.address = self._wait(head, lambda: (marker.read_text().strip() or None) if marker.exists() else None)
        worker = self._start("worker", [f"--address={self.address}"])
        self._wait(worker, lambda: "Ray runtime started" in worker.log.read_text(errors="replace") or None)
        self._wait_for_nodes(2)
        return self

    def _wait_for_nodes(self, n: int, timeout: float = 60.0) -> None:
        """Until the GCS lists n live nodes (`ray start` returns before the worker has registered)."""
        code = ("import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False, configure_logging=False); "
                "print(sum(1 for x in ray.nodes() if x['Alive']))")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = subprocess.run([sys.executable, "-c", code, self.address], check=False, capture_output=True,
                               text=True, timeout=60)
            if r.returncode == 0 and r.stdout.strip().splitlines()[-1:] == [str(n)]:
                return
            time.sleep(1)
        raise RuntimeError(f"the cluster does not list {n} live nodes after {timeout:.0f} s")

    def stop(self) -> None:
        for node in reversed(list(self.nodes.values())):
            node.stop()
        self.nodes.clear()
        shutil.rmtree(self.base, ignore_errors=True)


@contextlib.contextmanager
def _cluster():
    pytest.importorskip("ray")
    if not os.path.isdir("/proc/self"):
        pytest.skip("the cluster fixture reads /proc (Linux)")
    if not RAY.exists():
        pytest.skip(f"no ray command beside {sys.executable}")
    before = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = AUTH_MODE  # for this process's ray.init (the driver)
    c = LocalCluster()
    try:
        try:
            c.start()
        except Exception as e:  # noqa: BLE001 - any failure to start Ray here is a skip, not a test failure
            pytest.skip(f"ray start failed here: {str(e)[-600:]}")
        yield c
    finally:
        c.stop()
        if before is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = before


@pytest.fixture(scope="module")
def ray_cluster():
    """A 2-node cluster shared by the tests of one module (they must leave both nodes alive)."""
    with _cluster() as c:
        yield c


@pytest.fixture
def fresh_ray_cluster():
    """A 2-node cluster of its own, for a test that kills a node."""
    with _cluster() as c:
        yield c
