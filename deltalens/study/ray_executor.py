"""`RayExecutor`: a study's task graph on a Ray cluster, each task placed on a node with the room it declares.

    driver (this process: plans, schedules, owns the study directory)
      ├─ task train:es:s0   ray remote, num_cpus/num_gpus = Task.cpus/gpus   -> result (+ its outputs)
      ├─ task train:grpo:s0 ...
      └─ task eval:es:s0    submitted the moment train:es:s0 has finished

Scheduling: a task is submitted as soon as every task in its `deps` has finished (a `ray.wait` loop, not a
barrier per stage), in plan order where several are ready; Ray queues what the cluster has no room for.
A task's function runs on a worker as `fn(TaskContext(root, deps, log), *args, **kwargs)`, where `root` is
the study directory *as that worker sees it* and `deps` holds the results of its dependencies, so results
equal `LocalExecutor`'s for the same graph. Each finished task's `TaskRecord` (node id, hostname, elapsed
seconds, attempts, the worker's sampled peak resident memory) is kept in `RayExecutor.records` and appended to
ROOT/costs.jsonl as LocalExecutor does (`executor.record_cost`).

How files travel. Nothing assumes that a worker sees the driver's disk; one of three modes holds for the
whole study, and the executor says which in one log line:
  * shared     the workers see the study directory at the driver's path (NFS, Lustre, a Kubernetes
               volume mounted at the same path): tasks write in place. Detected: the driver writes a
               random token to ROOT/.deltalens-ray-token and a probe task on every live node reads it;
               `shared_fs=True` skips the probe. Every task checks the token again before it starts, so a
               node that joins later without the mount fails with a one-line error instead of writing to
               a disk nobody reads.
  * objects    no shared filesystem (or `shared_fs=False`): the worker runs in a fresh temp directory into
               which the driver's copy of the task's inputs was unpacked: the `outputs` of the tasks in
               its `deps` (not of their deps), its *own* `outputs` as the driver holds them (so a resumed
               run continues from its last checkpoint), and the study's settings (`config_files`, e.g.
               study.json). The inputs travel as one tar through Ray's object store. The worker returns
               what its task changed under its `outputs` (files new or modified since the unpacking, as
               a tar the same way, and the paths it deleted); the driver unpacks that into a temp
               directory inside ROOT and renames each file into place (atomic per file, in the order the
               task wrote them), then applies the deletions. Only changes travel back, so tasks that share
               an output directory (every measurement writes into the study's cache/) run concurrently
               without undoing each other. The object store holds each blob in memory: fine for tiny and
               135M-parameter runs; a 0.5B run's checkpoint is ~2 GB (then use `artefacts` or a shared FS).
  * artefacts  like objects, but the tars are files in `artefacts`, a directory every node and the driver
               can read and write (a local path or file:// URI; other schemes are refused). Exclusive with
               `shared_fs=True`; when given, no probe runs.
In the two copying modes, task arguments must name study files relative to `ctx.root`: a task whose
arguments hold the driver's absolute ROOT is refused before anything runs.

Faults.
  * A worker or node that dies mid-task: Ray resubmits the task on another node (`max_retries`; a
    DeltalensError raised by the task is a real failure and is not retried: retry_exceptions=False). The
    task functions are resumable, so in shared mode the retry resumes from the last checkpoint the dead
    node wrote. In the copying modes the retry is the same call with the same input tar: it restarts
    from the last copy the driver held when the task was submitted (the dead node's newer checkpoints are
    lost with its disk); for a study, a training run restarts from the checkpoint of the previous, killed
    driver, or from scratch. Either way the result is the same, since a run's trajectory depends only on
    its settings and seeds.
  * A task killed by Ray's memory monitor, or whose retries are spent: one-line error naming the task
    and node; every finished task's files are in ROOT, so the same command resumes.
  * A killed driver: Ray kills the tasks it owns. Finished tasks' files are in ROOT; in shared mode a
    killed training run resumes from its last checkpoint. A driver killed while installing a task's
    files leaves some of them renamed into place, as a writer killed at that point would (each file
    whole), and its unpacking directory (ROOT/.ray-incoming-*), which the next run removes; the task
    itself was not recorded as done and reruns. The same command (the same graph) resumes.

The heap: a task's worker keeps freed memory (`deltalens.io.heap.keep_freed_memory`) when the driver does
(`heap.keeping()`, sent with the task: the CLI's training commands under DELTALENS_MALLOC=auto or keep), so a
study's GRPO steps run as fast on a worker as on one machine; a worker whose own DELTALENS_MALLOC is `trim`
does not. Ray workers are reused and already run threads, so glibc's arenas made before the first task
stay (M_ARENA_MAX only stops new ones); the no-mmap and no-trim settings take in full.

Progress: one live table on stderr (task, kind, node, state, iteration, elapsed), redrawn twice a second
by rich when stderr is a terminal (DELTALENS_PROGRESS=1 forces it); elsewhere (Slurm, nohup, CI) a plain
line at every state change and a summary every DELTALENS_PROGRESS_EVERY seconds (default 30);
DELTALENS_PROGRESS=0: none. Workers report to a small actor on the driver's node (start, log lines,
the last "iteration"/"step" of any metrics.jsonl under the task's outputs), so the table works in every
file mode. The Ray dashboard shows the same tasks as usual.

Ray itself: `address="auto"` joins the cluster this machine belongs to (RAY_ADDRESS, or `ray start`),
"HOST:PORT" that one, None (or "local") starts a local cluster for this process (as `--backend ray` of
ES does: its reaper and SIGTERM handling, deltalens.training.es.backends.ray). A Ray already initialised
by the caller is used as it is and left running. Every node must run the same deltalens version (checked by the probe).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import shutil
import signal
import socket
import sys
import tarfile
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import deltalens
from deltalens.errors import DeltalensError
from deltalens.io import heap
from deltalens.io.usage import Usage
from deltalens.study.executor import Log, Task, TaskContext, check_graph, record_cost, utc_now
from deltalens.timefmt import duration

try:
    import ray
    from ray.exceptions import GetTimeoutError, OutOfMemoryError, RayError, RayTaskError
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ImportError as e:  # pragma: no cover - exercised only without ray
    raise DeltalensError("--ray needs ray: pip install 'deltalens[ray]'") from e

TOKEN_NAME = ".deltalens-ray-token"  # under ROOT while a shared-mode study runs
INCOMING = ".ray-incoming-"  # prefix of the driver's unpacking directories under ROOT
CONFIG_FILES = ("study.json",)  # the study's settings, sent to every task in the copying modes
PROBE_TIMEOUT_S = 120.0  # a node whose probe does not answer by then counts as not sharing the disk
ITERATION = re.compile(r"\b(?:iteration|step)\s+(\d+)(?:\s*/\s*(\d+))?", re.IGNORECASE)


@dataclasses.dataclass
class TaskRecord:
    """Where and how long one task ran (its last, successful attempt)."""

    key: str
    kind: str
    node_id: str        # Ray's node id (hex)
    host: str           # the worker's hostname
    elapsed_s: float    # wall seconds of the task function on the worker (packing included)
    attempts: int = 1   # starts seen (2+: Ray retried it after a worker or node died)
    peak_rss_kb: int | None = None  # the worker's resident memory while the task ran (`deltalens.io.usage`)


# ---------------------------------------------------------------------------------------------- files


def _covering(paths: Sequence[str]) -> list[str]:
    """Distinct relative paths, those inside another one dropped (runs/x covers runs/x/checkpoints)."""
    norm = sorted({PurePosixPath(p).as_posix() for p in paths})
    out: list[str] = []
    for p in norm:
        if not any(p == q or p.startswith(q + "/") for q in out):
            out.append(p)
    return out


def _check_relative(key: str, rel: str) -> None:
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts or not p.parts or p.as_posix() == ".":
        raise DeltalensError(f"study plan: task {key!r} declares output {rel!r}; outputs must be paths "
                             "inside the study directory, relative to it")


def snapshot(root: Path, paths: Sequence[str]) -> dict[str, tuple[int, int]]:
    """{relative path: (size, mtime_ns)} of every file and directory at or under `paths` (directories
    as (-1, 0)): what a worker compares against to find what its task wrote and deleted."""
    out: dict[str, tuple[int, int]] = {}
    for rel in _covering(paths):
        top = root / rel
        if not top.exists():
            continue
        for p in [top, *top.rglob("*")] if top.is_dir() else [top]:
            key = p.relative_to(root).as_posix()
            if p.is_dir() and not p.is_symlink():
                out[key] = (-1, 0)
            else:
                st = p.lstat()
                out[key] = (st.st_size, st.st_mtime_ns)
    return out


def pack(root: Path, paths: Sequence[str], *, recursive: bool = True) -> bytes:
    """An uncompressed tar of the `paths` (relative to root) that exist; missing ones are left out.
    recursive=False: exactly the entries named (a directory without its contents). (Checkpoints are
    float tensors: compression would cost CPU for little.)"""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:  # PAX: mtimes in ns
        for rel in (_covering(paths) if recursive else sorted(set(paths))):
            p = root / rel
            if p.exists() or p.is_symlink():
                tar.add(p, arcname=rel, recursive=recursive)
    return buf.getvalue()


def unpack(blob: bytes, dest: Path) -> None:
    """Extract a tar made by `pack` into `dest`: regular files and directories only, every name inside."""
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:") as tar:
        members = tar.getmembers()
        for m in members:
            p = PurePosixPath(m.name)
            if p.is_absolute() or ".." in p.parts:
                raise DeltalensError(f"refusing a task's file {m.name!r}: it points outside the study directory")
            if not (m.isfile() or m.isdir()):
                raise DeltalensError(f"refusing a task's file {m.name!r}: only regular files and directories "
                                     "travel between nodes (a link or device was among its outputs)")
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, members=members, filter="data")
        else:  # pragma: no cover - Python < 3.11.4; members were checked above
            tar.extractall(dest, members=members)


def changes(root: Path, outputs: Sequence[str], before: dict) -> tuple[list[str], list[str], list[str]]:
    """What a task did to its outputs since `before` (a `snapshot`): (entries new or modified, entries
    deleted, declared outputs that do not exist)."""
    after = snapshot(root, outputs)
    changed = [k for k, v in after.items() if before.get(k) != v]
    deleted = [k for k in before if k not in after]
    missing = [rel for rel in _covering(outputs) if not (root / rel).exists()]
    return changed, deleted, missing


def install(root: Path, blob: bytes, deleted: Sequence[str] = ()) -> None:
    """Apply a task's changes to the driver's study directory: unpack into a temp directory inside root
    (same filesystem), then one atomic rename per file, in the order the task wrote them (so a driver
    killed halfway leaves what a writer killed at that point would: every run file is written
    atomically, a run's state last), then the deletions. Only what the task changed travels, so
    concurrent tasks that share an output directory (the study's cache) each add their own entries."""
    stage = Path(tempfile.mkdtemp(prefix=INCOMING, dir=root))
    try:
        unpack(blob, stage)
        entries = sorted(stage.rglob("*"), key=lambda p: (p.is_file(), p.stat().st_mtime_ns))  # dirs first
        for src in entries:
            dst = root / src.relative_to(stage)
            if src.is_dir():
                if dst.exists() and not dst.is_dir():
                    dst.unlink()
                dst.mkdir(parents=True, exist_ok=True)
                continue
            if dst.is_dir():
                shutil.rmtree(dst)
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.replace(src, dst)
        for rel in sorted(deleted, key=lambda r: -len(PurePosixPath(r).parts)):  # deepest first
            p = root / rel
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            elif p.exists() or p.is_symlink():
                p.unlink()
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def recover(root: Path) -> None:
    """Remove the unpacking directories a driver killed inside `install` left (what it had renamed into
    place is whole; the rest arrives again when the task reruns)."""
    if root.is_dir():
        for p in root.glob(INCOMING + "*"):
            shutil.rmtree(p, ignore_errors=True)


def _mentions(obj: Any, prefix: str, depth: int = 0) -> str | None:
    """A string inside `obj` (arguments: nested containers, dataclasses) that names a path under prefix."""
    if depth > 8:
        return None
    if isinstance(obj, (str, os.PathLike)):
        s = os.fspath(obj)
        return s if isinstance(s, str) and (s == prefix or s.startswith(prefix + os.sep)) else None
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    if isinstance(obj, Mapping):
        obj = [*obj.keys(), *obj.values()]
    if isinstance(obj, (list, tuple, set, frozenset)):
        for x in obj:
            if (hit := _mentions(x, prefix, depth + 1)) is not None:
                return hit
    return None


# --------------------------------------------------------------------------------------- worker side


def _metrics_iteration(root: Path, outputs: Sequence[str]) -> int | None:
    """The last iteration/step in any metrics.jsonl at or one level below the task's outputs (the most
    recently written one: a chain's current stage)."""
    files = []
    for rel in outputs:
        p = root / rel
        if p.is_dir():
            files += [f for f in (p / "metrics.jsonl", *p.glob("*/metrics.jsonl")) if f.is_file()]
    if not files:
        return None
    with contextlib.suppress(OSError, ValueError, IndexError):
        newest = max(files, key=lambda f: f.stat().st_mtime)
        with open(newest, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 4096))
            row = json.loads(f.read().splitlines()[-1])
        it = row.get("iteration", row.get("step"))
        return int(it) if it is not None else None
    return None


class _Reporter:
    """A worker's line to the driver's board (fire-and-forget actor calls; losing one is harmless)."""

    def __init__(self, board, key: str):
        self.board, self.key = board, key

    def send(self, method: str, *args) -> None:
        if self.board is not None:
            with contextlib.suppress(Exception):
                getattr(self.board, method).remote(self.key, *args)

    def log(self, line: str) -> None:
        self.send("line", str(line))

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until the board has every report sent so far (one caller's actor calls run in order), so
        that a task's last lines reach the driver before its result does."""
        if self.board is not None:
            with contextlib.suppress(Exception):
                ray.get(self.board.ping.remote(), timeout=timeout)


def probe(token_path: str, token: str | None) -> dict:
    """Run on every node: who it is, its deltalens, and whether it reads the driver's token file."""
    seen = False
    if token is not None:
        with contextlib.suppress(OSError):
            seen = Path(token_path).read_text() == token
    return {"node_id": ray.get_runtime_context().get_node_id(), "host": socket.gethostname(),
            "version": deltalens.__version__, "sees_root": seen}


def run_remote(spec: dict, blob: Any, board) -> dict:
    """A task's body on a worker (see the module docstring): set up its root, run it, return its files."""
    t0 = time.perf_counter()
    key, mode = spec["key"], spec["mode"]
    node_id, host = ray.get_runtime_context().get_node_id(), socket.gethostname()
    rep = _Reporter(board, key)
    rep.send("start", node_id, host)
    rep.flush()  # the driver learns of every attempt (a retry after a node died) before it can finish
    if spec.get("keep_heap"):  # the driver keeps freed memory (a training command): so does its worker
        heap.keep_freed_memory(training=True)
    tmp = None
    try:
        if mode == "shared":
            root = Path(spec["root"])
            try:
                seen = (root / TOKEN_NAME).read_text() == spec["token"]
            except OSError:
                seen = False
            if not seen:
                raise DeltalensError(f"node {host} ({node_id[:8]}) does not see the study directory {root} that "
                                     "the driver shares (a node without the shared filesystem?); run with "
                                     "shared_fs=False or mount it on every node")
        else:
            tmp = Path(tempfile.mkdtemp(prefix="deltalens-task-"))
            root = tmp / "study"
            root.mkdir()
            if mode == "artefacts":
                try:
                    blob = Path(blob).read_bytes()
                except OSError as e:
                    raise DeltalensError(f"node {host} cannot read the task's inputs in the artefacts directory "
                                         f"({e}); it must be visible to every node") from None
            unpack(blob, root)
            before = snapshot(root, spec["outputs"])
        stop = threading.Event()

        def watch():  # the iteration column of the driver's table
            last = None
            while not stop.wait(2.0):
                it = _metrics_iteration(root, spec["outputs"])
                if it is not None and it != last:
                    rep.send("iteration", it)
                    last = it

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            ctx = TaskContext(root=root, deps=spec["deps"], log=rep.log)
            with Usage() as use:
                result = spec["fn"](ctx, *spec["args"], **spec["kwargs"])
        finally:
            stop.set()
            rep.flush()
        files, deleted, missing = None, [], []
        if mode != "shared":
            changed, deleted, missing = changes(root, spec["outputs"], before)
            files = pack(root, changed, recursive=False)
            if mode == "artefacts":
                path = Path(spec["artefacts"]) / f"out-{spec['blob_id']}.tar"
                part = path.with_name(path.name + ".part")
                part.write_bytes(files)
                os.replace(part, path)
                files = str(path)
        return {"result": result, "files": files, "deleted": deleted, "missing": missing, "node_id": node_id,
                "host": host, "elapsed_s": time.perf_counter() - t0, "start_rss_kb": use.start_rss_kb,
                "peak_rss_kb": use.peak_rss_kb}
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


class Board:
    """Actor on the driver's node: keeps workers' reports until the driver has acknowledged them (a drain
    whose answer is lost, e.g. to a timeout, loses nothing: the next one asks again from the same point)."""

    def __init__(self):
        self.events: list[tuple] = []  # (seq, kind, key, ...)
        self.seq = 0

    def _add(self, *event) -> None:
        self.seq += 1
        self.events.append((self.seq, *event))

    def start(self, key, node_id, host):
        self._add("start", key, node_id, host)

    def line(self, key, text):
        self._add("line", key, text)

    def iteration(self, key, it):
        self._add("iteration", key, it)

    def ping(self) -> None:
        return None


    def drain(self, acked: int) -> list[tuple]:
        """Events after `acked` (the last seq the driver has processed); those up to it are dropped."""
        self.events = [e for e in self.events if e[0] > acked]
        return list(self.events)


REMOTE_TASK = ray.remote(run_remote)  # options (resources, retries) are given per task at submission
REMOTE_PROBE = ray.remote(probe)
REMOTE_BOARD = ray.remote(Board)


# ------------------------------------------------------------------------------------------ progress


def _progress_mode() -> tuple[str, float]:
    """('live' | 'plain' | 'off', seconds between plain summaries), as the CLI's progress bars decide."""
    mode = os.environ.get("DELTALENS_PROGRESS")
    text = os.environ.get("DELTALENS_PROGRESS_EVERY", "30")
    try:
        every = float(text)
    except ValueError:
        raise DeltalensError(f"DELTALENS_PROGRESS_EVERY must be a number of seconds (got {text!r})") from None
    if not every >= 0:
        raise DeltalensError(f"DELTALENS_PROGRESS_EVERY must be >= 0 seconds (got {text!r})")
    if mode == "0":
        return "off", every
    if mode == "1" or sys.stderr.isatty():
        return "live", every
    return "plain", every


class TaskTable:
    """The state of every task, shown live (rich) or as plain lines on stderr (module docstring)."""

    COLUMNS = ("task", "kind", "node", "state", "iteration", "elapsed")

    def __init__(self, tasks: Sequence[Task], mode: str = "plain", every: float = 30.0, stream=None):
        self.mode, self.every = mode, every
        self.stream = stream if stream is not None else sys.stderr
        self.rows = {t.key: {"kind": t.kind, "node": "", "state": "waiting", "iteration": None, "t0": None,
                             "elapsed": None, "attempts": 0} for t in tasks}
        self._live = None
        self._last_summary = time.monotonic()

    def __enter__(self):
        if self.mode == "live":
            from rich.console import Console
            from rich.live import Live

            self._live = Live(self._render(), console=Console(file=self.stream), refresh_per_second=2,
                              get_renderable=self._render)
            self._live.__enter__()
        return self

    def __exit__(self, *exc):
        if self._live is not None:
            self._live.refresh()
            self._live.__exit__(*exc)
            self._live = None
        elif self.mode == "plain":
            self._print(self.summary())

    def _print(self, line: str) -> None:
        print(line, file=self.stream, flush=True)

    def _elapsed(self, r: dict) -> str:
        if r["elapsed"] is not None:
            return duration(r["elapsed"])
        return duration(time.monotonic() - r["t0"]) if r["t0"] is not None else ""

    def _render(self):
        from rich.table import Table

        table = Table(*self.COLUMNS, title="tasks on Ray", title_justify="left")
        for key, r in self.rows.items():
            it = "" if r["iteration"] is None else str(r["iteration"])
            table.add_row(key, r["kind"], r["node"], r["state"], it, self._elapsed(r))
        return table

    def set(self, key: str, state: str, **fields) -> None:
        r = self.rows[key]
        changed = r["state"] != state or ("node" in fields and fields["node"] != r["node"])
        r.update(fields, state=state)
        if changed and self.mode == "plain":
            where = f" on {r['node']}" if r["node"] else ""
            when = f", {self._elapsed(r)}" if r["t0"] is not None or r["elapsed"] is not None else ""
            self._print(f"ray: {key}: {state}{where}{when}")

    def started(self, key: str, node: str) -> None:
        r = self.rows[key]
        r["attempts"] += 1
        state = "running" if r["attempts"] == 1 else f"running (retry {r['attempts'] - 1})"
        self.set(key, state, node=node, t0=time.monotonic(), iteration=None)

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for r in self.rows.values():
            s = r["state"].split(" ")[0]
            counts[s] = counts.get(s, 0) + 1
        running = [f"{k} on {r['node']}" + (f" iteration {r['iteration']}" if r["iteration"] is not None else "")
                   + f" {self._elapsed(r)}" for k, r in self.rows.items() if r["state"].startswith("running")]
        head = ", ".join(f"{n} {s}" for s, n in counts.items())
        return f"ray: {head}" + (f"; {'; '.join(running)}" if running else "")

    def tick(self) -> None:
        if self.mode == "plain" and time.monotonic() - self._last_summary >= self.every:
            self._last_summary = time.monotonic()
            self._print(self.summary())


# --------------------------------------------------------------------------------------------- driver


class RayExecutor:
    """Run a study's task graph on a Ray cluster (module docstring)."""

    def __init__(self, address: str | None = "auto", *, shared_fs: bool | None = None, artefacts: str | None = None,
                 log: Log | None = None, max_retries: int = 3, options: Mapping[str, dict] | None = None,
                 config_files: Sequence[str] = CONFIG_FILES, progress: str | None = None, stream=None):
        """address: "auto", "HOST:PORT", or None (a local cluster for this process). shared_fs: True /
        False / None (probe every node). artefacts: a directory every node reads and writes, through which
        the files travel instead of the object store. log: the executor's own lines (mode, retries); None:
        the log given to `run`. max_retries: resubmissions of a task whose worker or node died. options:
        extra `.options(...)` of Ray's remote call per task key or kind (the key wins), e.g.
        {"train": {"scheduling_strategy": "SPREAD"}} or {"eval": {"resources": {"big-mem": 1}}}.
        progress: "live" | "plain" | "off" (default: as DELTALENS_PROGRESS and the terminal decide)."""
        if artefacts is not None:
            if shared_fs:
                raise DeltalensError("give either a shared filesystem or an artefacts directory, not both")
            if artefacts.startswith("file://"):
                artefacts = artefacts[len("file://"):]
            elif "://" in artefacts:
                raise DeltalensError(f"the artefacts location must be a directory every node can reach (a path or "
                                     f"file:// URI); {artefacts!r} names another scheme")
            if not Path(artefacts).is_dir():
                raise DeltalensError(f"the artefacts directory {artefacts} does not exist")
        if max_retries < 0:
            raise DeltalensError(f"max_retries must be >= 0 (got {max_retries})")
        if progress not in (None, "live", "plain", "off"):
            raise DeltalensError(f"progress must be live, plain or off (got {progress!r})")
        self.address = None if address == "local" else address  # --ray local: a cluster of this process
        self.shared_fs, self.log = shared_fs, log
        self.artefacts = Path(artefacts).resolve() if artefacts is not None else None
        self.max_retries, self.options = max_retries, dict(options or {})
        self.config_files, self.progress, self.stream = tuple(config_files), progress, stream
        self.records: dict[str, TaskRecord] = {}
        self.costs: list[dict] = []
        self.mode: str | None = None  # shared | objects | artefacts, once run() has decided
        self._owns = False  # this executor called ray.init (and shuts it down)
        self._owns_cluster = False  # ... and that started a local cluster (address None)
        self._reaper = None
        self._prev_sigterm = None
        self._terminated = False

    # -- Ray's lifetime
    def _connect(self) -> None:
        if ray.is_initialized():
            return
        if self.address is None:
            from deltalens.training.es.backends.ray import start_reaper

            self._reaper = start_reaper()
            if threading.current_thread() is threading.main_thread():
                self._prev_sigterm = signal.getsignal(signal.SIGTERM) or signal.SIG_DFL
            self._owns = self._owns_cluster = True
            try:
                ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
            except SystemExit:  # Ray's SIGTERM handler, run while ray.init started the cluster
                self._terminated = True
                raise
            if self._prev_sigterm is not None:
                signal.signal(signal.SIGTERM, self._on_sigterm)
            return
        try:
            ray.init(address=self.address, log_to_driver=False, configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise DeltalensError(f"cannot join the Ray cluster at {self.address!r}: {str(e).splitlines()[0]} "
                                 "(start one with `ray start --head`, or give its HOST:PORT)") from None
        self._owns = True

    def _on_sigterm(self, signum, frame) -> None:
        from deltalens.training.es.backends.ray import Terminated

        self._terminated = True
        raise Terminated()

    def _disconnect(self) -> None:
        if self._owns:
            with contextlib.suppress(Exception):
                ray.shutdown()
            self._owns = False
        if self._prev_sigterm is not None:
            signal.signal(signal.SIGTERM, self._prev_sigterm)
            self._prev_sigterm = None
        if self._reaper is not None:
            proc, w = self._reaper
            os.close(w)
            with contextlib.suppress(Exception):
                proc.wait(timeout=10)
            self._reaper = None
        if self._terminated:
            from deltalens.training.es.backends.ray import die_of_sigterm

            die_of_sigterm()

    # -- files
    def _decide_mode(self, root: Path, token: str, say: Log) -> str:
        """Probe every live node (same deltalens? sees root?) and choose the file mode (module docstring)."""
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        check_fs = self.artefacts is None and self.shared_fs is None
        refs = {n["NodeID"]: REMOTE_PROBE.options(
            num_cpus=0, max_retries=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False),
        ).remote(str(root / TOKEN_NAME), token if check_fs else None) for n in nodes}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=PROBE_TIMEOUT_S)
        answers, silent = [], []
        for node_id, ref in refs.items():
            if ref in ready:
                with contextlib.suppress(RayError):
                    answers.append(ray.get(ref))
                    continue
            silent.append(node_id[:8])
        for a in answers:
            if a["version"] != deltalens.__version__:
                raise DeltalensError(f"node {a['host']} ({a['node_id'][:8]}) runs deltalens {a['version']}, the "
                                     f"driver {deltalens.__version__}: install the same version on every node")
        if silent:
            say(f"ray: node(s) {', '.join(silent)} did not answer the probe within {PROBE_TIMEOUT_S:.0f} s")
        if self.artefacts is not None:
            say(f"ray: {len(nodes)} node(s); files travel as tars through {self.artefacts}")
            return "artefacts"
        if self.shared_fs is True:
            say(f"ray: {len(nodes)} node(s); study directory shared (as told): tasks write in place in {root}")
            return "shared"
        if self.shared_fs is False:
            say(f"ray: {len(nodes)} node(s); no shared filesystem (as told): files travel through the object store")
            return "objects"
        blind = [f"{a['host']} ({a['node_id'][:8]})" for a in answers if not a["sees_root"]] + silent
        if not blind:
            say(f"ray: {len(nodes)} node(s) all see {root}: tasks write in place (shared filesystem)")
            return "shared"
        say(f"ray: {len(blind)} of {len(nodes)} node(s) do not see {root} ({', '.join(blind)}): files travel "
            "through the object store")
        return "objects"

    def _inputs(self, t: Task, by_key: dict[str, Task]) -> list[str]:
        paths = [p for d in t.deps for p in by_key[d].outputs] + list(t.outputs) + list(self.config_files)
        return _covering(paths)

    # -- the graph
    def run(self, tasks: Sequence[Task], root: Path, log: Log = print) -> dict[str, Any]:
        """Run every task, each as soon as its dependencies are done; return each task's result by key."""
        say = self.log or log
        order = check_graph(tasks)
        by_key = {t.key: t for t in order}
        for t in order:
            for rel in t.outputs:
                _check_relative(t.key, rel)
        root = Path(root).resolve()
        root.mkdir(parents=True, exist_ok=True)
        recover(root)
        mode, every = _progress_mode()
        mode = self.progress or mode
        token = uuid.uuid4().hex
        token_path = root / TOKEN_NAME
        self._connect()
        try:
            token_path.write_text(token)  # before the probe: it is what the probe looks for
            self.mode = self._decide_mode(root, token, say)
            if self.mode != "shared":
                for t in order:
                    if (hit := _mentions((t.args, t.kwargs), str(root))) is not None:
                        raise DeltalensError(f"study plan: task {t.key!r} names {hit}, a path on the driver's disk "
                                             "that workers without a shared filesystem do not have; tasks must "
                                             "name study files relative to ctx.root")
            self._warn_infeasible(order, say)
            # on the driver's own node, hard: a soft affinity let Ray place it on a worker node, whose death
            # then lost the reports of the tasks retried elsewhere
            board = REMOTE_BOARD.options(
                num_cpus=0, max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                                   soft=False),
            ).remote()
            with TaskTable(order, mode, every, self.stream) as table:
                return self._loop(order, by_key, root, token, board, table, log, say)
        finally:
            with contextlib.suppress(OSError):
                if token_path.read_text() == token:
                    token_path.unlink()
            self._disconnect()

    def _warn_infeasible(self, order: Sequence[Task], say: Log) -> None:
        """Say which tasks no live node has room for now (Ray waits for such a node: an autoscaler may add it)."""
        nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
        for t in order:
            if not any(r.get("CPU", 0) >= t.cpus and r.get("GPU", 0) >= t.gpus for r in nodes):
                say(f"ray: warning: no node has {t.cpus:g} CPUs and {t.gpus:g} GPUs for {t.key}; it waits until "
                    "one joins the cluster")

    def _submit(self, t: Task, root: Path, token: str, results: dict, by_key: dict, board):
        spec = {"key": t.key, "fn": t.fn, "args": tuple(t.args), "kwargs": dict(t.kwargs), "mode": self.mode,
                "deps": {d: results[d] for d in t.deps}, "outputs": list(t.outputs), "root": str(root),
                "token": token, "artefacts": str(self.artefacts) if self.artefacts else None,
                "blob_id": uuid.uuid4().hex, "keep_heap": heap.keeping()}
        blob = None
        if self.mode != "shared":
            blob = pack(root, self._inputs(t, by_key))
            if self.mode == "artefacts":
                path = self.artefacts / f"in-{spec['blob_id']}.tar"
                part = path.with_name(path.name + ".part")
                part.write_bytes(blob)
                os.replace(part, path)
                blob = str(path)
            else:
                blob = ray.put(blob)
        opts = {"num_cpus": t.cpus, "num_gpus": t.gpus, "max_retries": self.max_retries,
                "retry_exceptions": False, "name": t.key,
                **self.options.get(t.kind, {}), **self.options.get(t.key, {})}
        return REMOTE_TASK.options(**opts).remote(spec, blob, board), spec

    def _loop(self, order, by_key, root, token, board, table: TaskTable, log: Log, say: Log) -> dict[str, Any]:
        results: dict[str, Any] = {}
        waiting = list(order)
        inflight: dict[Any, tuple[Task, dict]] = {}
        self.records = {}
        self.costs = []  # this pass's costs.jsonl rows, in the order the tasks finished
        self._pass_started = utc_now()
        self._acked = 0  # the board's last event processed
        try:
            while waiting or inflight:
                for t in [w for w in waiting if all(d in results for d in w.deps)]:
                    ref, spec = self._submit(t, root, token, results, by_key, board)
                    inflight[ref] = (t, spec)
                    waiting.remove(t)
                    table.set(t.key, "queued")
                ready, _ = ray.wait(list(inflight), num_returns=1, timeout=0.5)
                self._drain(board, table, log, say)
                for ref in ready:
                    t, spec = inflight.pop(ref)
                    out = self._get(ref, t, table)
                    self._finish(t, spec, out, root, table, say)
                    results[t.key] = out["result"]
                table.tick()
            self._drain(board, table, log, say)
        except BaseException:
            for ref, (t, _) in inflight.items():
                with contextlib.suppress(Exception):
                    ray.cancel(ref, force=True)
                table.set(t.key, "cancelled")
            raise
        finally:
            with contextlib.suppress(Exception):
                ray.kill(board)
            self._clean_artefacts([spec for _, spec in inflight.values()])
        return {t.key: results[t.key] for t in order}

    def _drain(self, board, table: TaskTable, log: Log, say: Log) -> None:
        try:
            events = ray.get(board.drain.remote(self._acked), timeout=10)
        except (RayError, GetTimeoutError):
            return  # the board's node is gone or busy: the table skips a beat, nothing is lost
        for seq, kind, key, *rest in events:
            if seq <= self._acked:
                continue
            self._acked = seq
            if kind == "line":  # a task's own log line, even one drained after its task settled (a drain that
                log(rest[0])    # timed out skips a beat: the task's result can be taken before its lines)
            if key not in table.rows or table.rows[key]["state"] in ("done", "failed", "cancelled"):
                continue  # a late report of a task already settled: the table stays as it is
            if kind == "start":
                node_id, host = rest
                r = table.rows[key]
                if r["attempts"]:
                    say(f"ray: {key}: its worker on {r['node']} died; Ray retried it on {host} ({node_id[:8]})")
                table.started(key, f"{host}/{node_id[:8]}")
            elif kind == "line":
                m = ITERATION.search(rest[0])
                if m:
                    table.rows[key]["iteration"] = int(m.group(1))
            elif kind == "iteration":
                table.rows[key]["iteration"] = rest[0]

    def _get(self, ref, t: Task, table: TaskTable) -> dict:
        """ray.get, with Ray's failures as one-line errors naming the task."""
        try:
            return ray.get(ref)
        except RayTaskError as e:
            table.set(t.key, "failed")
            cause = e.cause if isinstance(getattr(e, "cause", None), BaseException) else None
            if isinstance(cause, DeltalensError):
                raise DeltalensError(f"{t.key}: {cause}") from None
            if isinstance(cause, KeyboardInterrupt):
                raise KeyboardInterrupt from None
            raise
        except OutOfMemoryError as e:
            table.set(t.key, "failed")
            raise DeltalensError(f"{t.key}: Ray's memory monitor killed it: its node ran out of memory; give each "
                                 "task more room (a larger --cpus-per-run puts fewer on one node) or raise "
                                 "RAY_memory_usage_threshold, then run the same command to resume") from e
        except RayError as e:
            table.set(t.key, "failed")
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DeltalensError(f"{t.key}: failed on Ray after {self.max_retries} retries ({type(e).__name__}: "
                                 f"{first}); finished tasks are kept: run the same command to resume") from e

    def _finish(self, t: Task, spec: dict, out: dict, root: Path, table: TaskTable, say: Log) -> None:
        files = out["files"]
        if files is not None:
            if self.mode == "artefacts":
                path = Path(files)
                try:
                    files = path.read_bytes()
                except OSError as e:
                    raise DeltalensError(f"{t.key}: cannot read its outputs from the artefacts directory: {e}") \
                        from None
            install(root, files, out["deleted"])
            if out["missing"]:
                say(f"ray: {t.key} did not write {', '.join(out['missing'])} (declared as its outputs)")
            self._clean_artefacts([spec])
        attempts = max(1, table.rows[t.key]["attempts"])
        self.records[t.key] = TaskRecord(t.key, t.kind, out["node_id"], out["host"], out["elapsed_s"], attempts,
                                         out.get("peak_rss_kb"))
        self.costs.append(record_cost(root, t, self._pass_started, out["elapsed_s"], out.get("start_rss_kb"),
                                      out.get("peak_rss_kb"), out["host"], say))
        table.set(t.key, "done", node=f"{out['host']}/{out['node_id'][:8]}", elapsed=out["elapsed_s"])

    def _clean_artefacts(self, specs: Sequence[dict]) -> None:
        if self.artefacts is None:
            return
        for spec in specs:
            for name in (f"in-{spec['blob_id']}.tar", f"out-{spec['blob_id']}.tar"):
                with contextlib.suppress(OSError):
                    (self.artefacts / name).unlink()
