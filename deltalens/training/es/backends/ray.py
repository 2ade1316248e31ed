"""Ray backend for ES: members evaluated by actors that each hold a model replica.

    driver (ESEngine: updates, eval, checkpoints)
      ├─ actor 0 (ESEngine replica)     evaluate(iteration, [member]) -> {member: reward}
      ├─ actor 1 ...                    update(iteration, z)          -> checksum
      └─ ...

Per iteration the driver sends only (iteration, member id) to actors and gathers one float per member;
each replica derives the prompts and the noise from (seed, iteration, member), exactly as the local
backend does, and generates in the driver's resolved compute dtype (`ESEngine.compute_dtype`). After
the rewards are in, the driver sends the shaped fitness z (N floats) to every actor; every replica,
the driver's included, applies the same update from (seeds, z), and the weight checksums (blake2b of
every parameter's bytes) must all agree: no weights cross the network during training. Members are handed out one at a time to whichever actor is idle, so results are keyed by
member, not by actor, and a run gives the same weights as the in-process backend, bit for bit (the
forward pass must be deterministic on every replica: same code, same threads, same CPU kind).

Fault tolerance: an actor that dies mid-iteration (RayActorError) has its member put back in the
queue and re-run by another actor, with an identical result since a member's reward depends only on
(weights, iteration, member). A replacement actor is started in the background; it loads the model
spec, receives the driver's current weights once (the only time weights are sent), and joins after
its checksum matches. An exception raised *inside* a task (a bug, not a death) is re-raised.

Memory: a worker that Ray's memory monitor kills (`OutOfMemoryError`, or an actor death whose reason says
the node ran low on memory) is not replaced: a replacement would hold another replica under the same
pressure. The run stops with a one-line error and advice (fewer workers, smaller generations, Ray's
threshold); its last checkpoint stays resumable.

Ending a run: when this backend starts the local Ray cluster itself (it "owns" Ray), two things tie the
cluster's lifetime to the driver's.
  * SIGTERM. `ray.init` installs Ray's own handler (and a native one that dumps a stack), which made a
    terminated Ray run exit 15 or 134 with a native dump. After `ray.init` the backend installs its own:
    it raises `Terminated` in the main thread, so the training loop unwinds as from any error (no partial
    file is kept: writes are atomic), `close()` kills the actors and shuts Ray down, and then the process
    dies of SIGTERM with the default action, as a local run does (a shell reports 143). A SIGTERM that
    arrives during `close()` is only recorded, so the cleanup is not cut short; one that arrives while
    `ray.init` runs meets Ray's handler, whose SystemExit is taken for the same request.
  * SIGKILL of the driver. Ray's GCS and raylet die with the driver (Ray sets PR_SET_PDEATHSIG on them),
    but their children, `ray::DashboardAgent` and `ray::RuntimeEnvAgent`, are orphaned and live on. So
    before `ray.init` the backend starts a reaper (`REAPER`, plain Python without imports beyond the
    standard library, in its own session so the driver's terminal signals do not reach it): every 0.5 s
    it records the driver's descendants that are Ray's processes (`ray::...`, or a command line inside
    the ray package) with their start times; when the pipe from the driver reaches end-of-file (the
    driver closed it in `close()`, or died: the kernel closes it) it SIGTERMs every recorded process that
    still lives (same pid *and* start time, so a reused pid is never hit) and still has a Ray command line
    (a child seen between fork and exec shows its parent's), SIGKILLs those left after 3 s,
    and exits. A Ray process started and orphaned within one 0.5 s poll of the driver's death can escape;
    Linux only (it reads /proc).
A Ray that the caller started (`ray.init` before the backend) is the caller's: neither is installed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence

import torch

from deltalens.errors import DeltalensError

try:
    import ray
    from ray.exceptions import OutOfMemoryError, RayActorError
except ImportError as e:  # pragma: no cover - exercised only without ray
    raise DeltalensError("the ray backend needs ray: pip install ray (or use --backend local)") from e

from deltalens.io.models import apply_state_dict, load_model
from deltalens.training.es.config import ESConfig
from deltalens.training.es.engine import ESEngine, new_timing
from deltalens.training.run import make_task

OOM_ADVICE = ("Ray's memory monitor killed a worker: the machine ran out of memory (each of the {workers} Ray "
              "workers holds a model replica); use fewer --workers, fewer --prompts-per-iteration or a smaller "
              "--max-new-tokens, or raise Ray's kill threshold RAY_memory_usage_threshold (default 0.95), then "
              "continue the run with `deltalens train resume`")


# Phrases of the raylet's reason for an actor it killed for memory. Not "OOM" alone: every unexpected
# death's message lists "killed by the OOM killer" among its possible causes, and those are replaced.
OOM_MARKERS = ("running low on memory", "memory pressure", "out of memory issue")


def is_oom(e: BaseException) -> bool:
    """Whether a Ray error means the memory monitor killed the task (OutOfMemoryError) or its actor."""
    return isinstance(e, OutOfMemoryError) or (isinstance(e, RayActorError)
                                               and any(m in str(e) for m in OOM_MARKERS))


class Terminated(SystemExit):
    """Raised by the backend's SIGTERM handler. A SystemExit, so that if it ever escapes past `close()`
    (which normally ends the process first), the process still exits quietly with 143 and no traceback."""

    def __init__(self):
        super().__init__(128 + signal.SIGTERM)


def die_of_sigterm() -> None:
    """End the process by SIGTERM with the default action: what a run without Ray's handlers does."""
    for f in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            f.flush()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(1)  # delivery is asynchronous if another thread takes the signal
    os._exit(128 + signal.SIGTERM)  # pragma: no cover - only if the signal is blocked in every thread


# The reaper (see the module docstring). argv: driver pid, the ray package directory; stdin: the read end
# of a pipe whose write end only the driver holds.
REAPER = r"""
import os, select, signal, sys, time
driver, ray_dir, me = int(sys.argv[1]), sys.argv[2], os.getpid()

def stat(pid):  # (state, ppid, start time) from /proc/PID/stat, or None when gone
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            s = f.read()
    except OSError:
        return None
    f = s[s.rindex(b")") + 2:].split()  # after "pid (comm) ": state, ppid, ..., starttime is field 22
    return f[0], int(f[1]), int(f[19])

def is_ray(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return cmd.startswith("ray::") or ray_dir in cmd

def ray_descendants(roots):  # {pid: start time} of Ray processes below `roots`
    procs = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (st := stat(int(d))):
            procs[int(d)] = st
    kids = {}
    for pid, (_, ppid, _) in procs.items():
        kids.setdefault(ppid, []).append(pid)
    found, todo = {}, list(roots)
    while todo:
        for c in kids.get(todo.pop(), ()):
            if c != me and c not in found:
                found[c] = procs[c][2]
                todo.append(c)
    return {p: t for p, t in found.items() if is_ray(p)}

def alive(pid, t):
    st = stat(pid)
    return st is not None and st[2] == t and st[0] != b"Z"

seen = {}
while os.getppid() == driver:
    seen.update(ray_descendants([driver]))
    if select.select([0], [], [], 0.5)[0] and not os.read(0, 1):
        break  # end-of-file: the driver closed the pipe or died
seen.update(ray_descendants([p for p, t in seen.items() if alive(p, t)]))
for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 1.0)):
    # still Ray's now: a child caught between fork and exec showed its parent's command line then
    left = {p: t for p, t in seen.items() if alive(p, t) and is_ray(p)}
    for p in left:
        try:
            os.kill(p, sig)
        except OSError:
            pass
    deadline = time.monotonic() + wait
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = {p: t for p, t in left.items() if alive(p, t)}
"""


def start_reaper() -> tuple[subprocess.Popen, int] | None:
    """Start the reaper for this process's Ray cluster; returns (process, write end of its pipe), or None
    where it cannot run (no /proc)."""
    if not os.path.isdir("/proc/self"):
        return None
    r, w = os.pipe()  # both ends non-inheritable: Ray's processes never hold the write end
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", REAPER, str(os.getpid()),
                                 os.path.dirname(ray.__file__)],
                                stdin=r, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    except OSError:
        os.close(w)
        return None
    finally:
        os.close(r)
    return proc, w


class ESWorker:
    """Actor body: one model replica (an `ESEngine`)."""

    def __init__(self, config: dict, model_spec: str, threads: int, fail_at: tuple[int, int] | None = None,
                 compute_dtype: str | None = None):
        torch.set_num_threads(threads)
        cfg = ESConfig.from_dict(config)
        model, tok = load_model(model_spec, dtype=cfg.dtype)
        # the driver's resolved compute dtype: an `auto` resolved per node could differ between replicas
        self.engine = ESEngine(model, tok, make_task(cfg), cfg, compute_dtype=compute_dtype)
        self.fail_at = tuple(fail_at) if fail_at else None  # test hook: die at (iteration, member)

    def checksum(self) -> str:
        return self.engine.checksum()

    def evaluate(self, iteration: int, members: Sequence[int]) -> tuple[dict[int, float], dict]:
        if self.fail_at and self.fail_at[0] == iteration and self.fail_at[1] in members:
            os._exit(1)  # simulate a crash mid-iteration
        timing = new_timing()
        return self.engine.evaluate_members(iteration, members, None, timing), timing

    def update(self, iteration: int, z: Sequence[float]) -> str:
        self.engine.update(iteration, z)
        return self.engine.checksum()

    def load_weights(self, weights: dict[str, torch.Tensor]) -> str:
        """Replace the replica's weights (used once, when a replacement actor joins)."""
        apply_state_dict(self.engine.model, weights, source="driver weights")
        self.engine._base = None  # re-taken from the new weights at the next perturbation
        return self.engine.checksum()


class RayBackend:
    """Evaluate members on Ray actors; see the module docstring."""

    name = "ray"

    def __init__(self, engine: ESEngine, model_spec: str, fail_at: tuple[int, int] | None = None,
                 max_restarts: int | None = None):
        cfg = engine.config
        self.engine, self.model_spec, self.cfg = engine, model_spec, cfg
        self.restarts_left = cfg.workers * 2 if max_restarts is None else max_restarts
        self.restarts = 0
        self.workers: dict[int, object] = {}  # live actors by id
        self.joining: dict[object, int] = {}  # future of a replacement's load_weights -> actor id
        self._next_id = 0
        self._terminated = self._closing = self._closed = False
        self._reaper = None
        self._prev_sigterm = None  # the handler to restore in close(); None: we installed none
        self._owns_ray = not ray.is_initialized()
        try:
            if self._owns_ray:
                self._start_ray()
            self._actor_cls = ray.remote(num_cpus=cfg.threads_per_worker, max_restarts=0)(ESWorker)
            for i in range(cfg.workers):
                self._spawn(fail_at if i == 0 else None)
            want = engine.checksum()
            got = self._get([w.checksum.remote() for w in self.workers.values()])
            if any(g != want for g in got):
                raise DeltalensError(f"Ray workers loaded different weights from {model_spec} than the driver "
                                     "(is the path visible to every node?)")
        except BaseException:
            self.close()  # dies of SIGTERM here if that is what interrupted the start
            raise

    def _start_ray(self) -> None:
        """Start the local cluster with the reaper watching it and our SIGTERM handler (module docstring)."""
        self._reaper = start_reaper()
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            self._prev_sigterm = signal.getsignal(signal.SIGTERM)
            if self._prev_sigterm is None:  # installed outside Python: the default is the nearest
                self._prev_sigterm = signal.SIG_DFL
        try:
            ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
        except SystemExit:  # Ray's own SIGTERM handler, run while ray.init was starting the cluster
            self._terminated = True
            raise
        if self._prev_sigterm is not None:
            signal.signal(signal.SIGTERM, self._on_sigterm)  # replaces Ray's handlers, the native dumper too

    def _on_sigterm(self, signum, frame) -> None:
        self._terminated = True
        if not self._closing:  # during close() only record it: close() ends the process when done
            raise Terminated()

    def _get(self, refs):
        """ray.get, with Ray's out-of-memory kills turned into one line of advice."""
        try:
            return ray.get(refs)
        except (OutOfMemoryError, RayActorError) as e:
            if is_oom(e):
                raise DeltalensError(OOM_ADVICE.format(workers=self.cfg.workers)) from e
            raise

    # -- actors
    def _spawn(self, fail_at=None) -> int:
        wid = self._next_id
        self._next_id += 1
        self.workers[wid] = self._actor_cls.remote(self.cfg.to_dict(), self.model_spec,
                                                   self.cfg.threads_per_worker, fail_at, self.engine.compute_dtype)
        return wid

    def _replace(self, wid: int) -> None:
        """Drop dead actor `wid` and start a replacement that joins once it holds the driver's weights."""
        self.workers.pop(wid, None)
        if self.restarts_left <= 0:
            if not self.workers and not self.joining:
                raise DeltalensError("all Ray workers died and the restart budget is spent; "
                                     "see the Ray logs (/tmp/ray/session_latest/logs)")
            return
        self.restarts_left -= 1
        self.restarts += 1
        new = self._spawn()
        actor = self.workers.pop(new)
        weights = ray.put({n: p.detach().clone() for n, p in self.engine.model.state_dict().items()})
        self.joining[actor.load_weights.remote(weights)] = (new, actor)

    def _poll_joining(self, timeout: float = 0) -> None:
        if not self.joining:
            return
        ready, _ = ray.wait(list(self.joining), num_returns=len(self.joining), timeout=timeout)
        want = self.engine.checksum() if ready else None
        for f in ready:
            wid, actor = self.joining.pop(f)
            try:
                got = self._get(f)
            except RayActorError:  # the replacement itself died: try again while the budget lasts
                self._replace(wid)
                continue
            if got != want:
                raise DeltalensError("a replacement Ray worker does not match the driver's weights after "
                                     "loading them; the replicas are not deterministic")
            self.workers[wid] = actor

    # -- the backend interface
    def evaluate(self, iteration: int, problems=None) -> tuple[list[float], dict]:
        """Rewards of all members; each member goes to the next idle actor (re-queued if its actor dies)."""
        n = self.cfg.population
        queue = deque(range(n))
        rewards: dict[int, float] = {}
        timing = new_timing()
        pending: dict[object, tuple[int, int]] = {}  # future -> (actor id, member)
        t0 = time.perf_counter()
        while len(rewards) < n:
            self._poll_joining()
            busy = {wid for wid, _ in pending.values()}
            for wid in [w for w in self.workers if w not in busy]:
                if not queue:
                    break
                m = queue.popleft()
                pending[self.workers[wid].evaluate.remote(iteration, [m])] = (wid, m)
            if not pending:
                if not self.joining:
                    raise DeltalensError("no Ray workers left to evaluate members")
                self._poll_joining(timeout=1.0)
                continue
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
            for f in ready:
                wid, m = pending.pop(f)
                try:
                    r, t = self._get(f)
                except RayActorError:
                    queue.appendleft(m)  # re-run elsewhere: same weights, same seeds, same reward
                    self._replace(wid)
                    continue
                rewards.update(r)
                for k, v in t.items():
                    timing[k] += v
        timing["evaluate_wall_s"] = time.perf_counter() - t0
        return [rewards[i] for i in range(n)], timing

    def update(self, iteration: int, z: Sequence[float]) -> dict:
        """Every replica applies the same update; checksums must agree with the driver's."""
        self._poll_joining(timeout=None)  # replacements hold this iteration's weights: let them join first
        futures = {self.workers[w].update.remote(iteration, list(z)): w for w in self.workers}
        out = self.engine.update(iteration, z)  # the driver's replica, meanwhile
        t0 = time.perf_counter()
        want = self.engine.checksum()
        out["checksum"] = want
        for f, wid in futures.items():
            try:
                got = self._get(f)
            except RayActorError:
                self._replace(wid)  # the replacement receives the driver's updated weights
                continue
            if got != want:
                raise DeltalensError(f"Ray worker {wid} diverged from the driver after iteration {iteration} "
                                     f"(checksum {got[:8]} vs {want[:8]}); replicas must run identical code")
        out["checksum_s"] = time.perf_counter() - t0
        out["workers"] = {"live": len(self.workers), "restarts": self.restarts}
        return out

    def close(self) -> None:
        """Kill the actors and, if this backend started Ray, shut it down and stop the reaper (which first
        ends any Ray process left). After a SIGTERM the process then dies of it (module docstring)."""
        if self._closed:
            return
        self._closing = True  # a SIGTERM from now on is only recorded
        for actor in list(self.workers.values()) + [a for _, a in self.joining.values()]:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(actor)
        self.workers.clear()
        self.joining.clear()
        if self._owns_ray:
            with contextlib.suppress(Exception):  # shutting down is best effort; the reaper ends the rest
                ray.shutdown()
        if self._prev_sigterm is not None:
            signal.signal(signal.SIGTERM, self._prev_sigterm)
        if self._reaper is not None:
            proc, w = self._reaper
            os.close(w)  # end-of-file: the reaper ends what Ray left and exits
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        self._closed = True
        if self._terminated:
            die_of_sigterm()
