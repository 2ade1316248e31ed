"""What a piece of work cost: its wall time and the peak of the process's resident memory while it ran.

`Usage()` is a context manager. A daemon thread reads the resident set size (/proc/self/statm, second
field, times the page size) every `every` seconds (default 0.1) while the block runs; the peak is the
largest reading, the first taken on entry (`start_rss_kb`) and the last on exit. The peak is the whole
process's: what it held before the block (a loaded model kept open, a heap that keeps freed memory,
deltalens.io.heap) counts, so the block's own need is at most peak - start; memory of child processes
(a vLLM engine) and of a GPU is not counted. A rise and fall shorter than `every` can
fall between two readings, so the peak is a lower bound of the true one (within `every` of a phase that
lasts, exact where the memory stays up; torch releases the GIL in its kernels, so readings continue
during a long matmul).

Why sampling and not the kernel's high-water mark: VmHWM of /proc/self/status can be reset per task
(writing 5 to /proc/self/clear_refs), but that also resets what getrusage and `/usr/bin/time -v` report as
the whole process's maximum, the figure every measured pass in docs/ quotes. Sampling leaves it alone.

Where /proc/self/statm is missing (macOS), the peak is None and only the wall time is measured.
Torch-free.
"""

from __future__ import annotations

import os
import threading
import time

EVERY = 0.1  # seconds between readings


def _page_kb() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") // 1024
    except (ValueError, OSError, AttributeError):
        return 4


PAGE_KB = _page_kb()


def rss_kb() -> int | None:
    """The process's resident set size now, in kB; None where /proc/self/statm cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * PAGE_KB
    except (OSError, ValueError, IndexError):
        return None


def gib(kb: int) -> str:
    """kB (1024 bytes, as /proc and getrusage count) as GiB with two decimals: '9.40'."""
    return f"{kb / (1 << 20):.2f}"


class Usage:
    """`with Usage() as u: ...` then u.wall_s (seconds), u.start_rss_kb and u.peak_rss_kb (kB, or None):
    module docstring."""

    def __init__(self, every: float = EVERY):
        if not every > 0:
            raise ValueError(f"every must be > 0 seconds (got {every!r})")
        self.every = every
        self.wall_s: float | None = None
        self.peak_rss_kb: int | None = None
        self.start_rss_kb: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def _read(self) -> None:
        now = rss_kb()
        if now is not None and (self.peak_rss_kb is None or now > self.peak_rss_kb):
            self.peak_rss_kb = now

    def _watch(self) -> None:
        while not self._stop.wait(self.every):
            self._read()

    def __enter__(self) -> Usage:  # noqa: PYI034 (typing.Self needs Python 3.11)
        self._t0 = time.perf_counter()
        self._read()
        self.start_rss_kb = self.peak_rss_kb
        if self.peak_rss_kb is not None:  # nothing to watch where statm is missing
            self._thread = threading.Thread(target=self._watch, name="deltalens-usage", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._read()
        self.wall_s = time.perf_counter() - self._t0
