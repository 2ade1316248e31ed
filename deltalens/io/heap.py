"""The process heap: keep freed memory for reuse (glibc malloc settings), or give it back to the OS.

Why. glibc serves an allocation above its mmap threshold (at most 32 MiB) with a fresh `mmap` and unmaps
it on free, and trims free pages off the top of its heap; either way the pages go back to the kernel, and
the next tensor of that size faults every page in again. A training step allocates activations, logits
and gradients of that size many times over, and on the Firecracker VMs this project runs on a page fault
costs tens of microseconds, so a GRPO step spent most of its time in the kernel (figures: docs/tuning.md,
"The heap"). `keep_freed_memory()` sets glibc to serve every allocation from one heap (`M_ARENA_MAX` 1,
`M_MMAP_MAX` 0: no per-allocation mmap) and never to trim its top (`M_TRIM_THRESHOLD` -1; mallopt's
largest positive value, 2 GiB, is below a GRPO step's peak), so freed tensors are reused without faults
once the heap has grown to the run's peak. `release_freed_memory()` (glibc's malloc_trim, which the
generation loops call after each batch and GRPO after each step) then trims only when under TIGHT of the
machine's memory is available. The cost: resident memory stays at the peak the process reached instead
of falling between phases, and grows with fragmentation, hence that safety valve.

Who keeps: `DELTALENS_MALLOC=auto` (the default) keeps freed memory in the commands that train (`train`,
`study`, `sweep`, `demo`), where it pays, and trims in the others (`eval`, `probe`, `diff`, ...), where it
paid little and cost memory (the probe's peak rose above issue #32's 2 GB). `keep` and `trim` force one
way for every command; `trim` is what deltalens did before 2026-12-06. Under another C library (musl,
macOS) both functions do nothing. The CLI calls `keep_freed_memory(training=...)` first thing; a library
user calls it (or not) themselves. A study's Ray workers follow their driver (deltalens.study.ray_executor).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

from deltalens.errors import DeltalensError

M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # glibc's mallopt parameter numbers (malloc.h)
NEVER = -1  # M_TRIM_THRESHOLD -1: never trim the heap's top (mallopt(3))
MODES = ("auto", "keep", "trim")
TIGHT = 0.10  # a keeping process still trims after a batch or step when less than this share of memory is available


@functools.cache
def _libc():
    """glibc, or None under another C library."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 (glibc only)
        return libc
    except (OSError, AttributeError):
        return None


_keeping = False


def mode() -> str:
    """DELTALENS_MALLOC: auto (the default), keep or trim; anything else is refused in one line."""
    value = os.environ.get("DELTALENS_MALLOC", "auto").strip().lower() or "auto"
    if value not in MODES:
        raise DeltalensError(f"DELTALENS_MALLOC must be auto, keep or trim (got {value!r})")
    return value


def keep_freed_memory(training: bool = True) -> bool:
    """Set glibc to reuse freed memory instead of returning it to the OS (module doc): with
    DELTALENS_MALLOC=keep, or auto (the default) for a process that trains (`training`); True when the
    settings took. Call before the process starts threads."""
    global _keeping
    libc = _libc()
    want = mode()
    if libc is None or want == "trim" or (want == "auto" and not training):
        return False
    ok = all(libc.mallopt(p, v) == 1 for p, v in ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, NEVER)))
    _keeping = _keeping or ok
    return ok


def keeping() -> bool:
    """Whether `keep_freed_memory()` took in this process."""
    return _keeping


def available_fraction() -> float | None:
    """MemAvailable / MemTotal of /proc/meminfo (None where it cannot be read)."""
    try:
        info = {}
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                key, _, value = line.partition(":")
                info[key] = int(value.split()[0])
        return info["MemAvailable"] / info["MemTotal"]
    except (OSError, KeyError, ValueError, IndexError, ZeroDivisionError):
        return None


def release_freed_memory() -> bool:
    """Give the heap's free pages back to the OS (glibc's malloc_trim(0)). A process that keeps them
    (`keep_freed_memory`) trims only when the machine is short of memory (under TIGHT of it available),
    so a kept heap cannot push the machine into the OOM killer; False where nothing was released or there
    is no glibc."""
    libc = _libc()
    if libc is None:
        return False
    if _keeping:
        avail = available_fraction()
        if avail is None or avail >= TIGHT:
            return False
    return bool(libc.malloc_trim(0) >= 0)
