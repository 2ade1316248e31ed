"""The process heap (`deltalens.io.heap`): with freed memory kept, a tensor allocated again after being freed
faults (almost) none of its pages in; with glibc's defaults (DELTALENS_MALLOC=trim) it faults them all."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from deltalens.errors import DeltalensError
from deltalens.io import heap

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only")

# a child process, so that the settings do not change the test process's heap
CHILD = """
import json, resource, sys
import torch
from deltalens.io import heap
from deltalens.io.heap import keep_freed_memory, keeping, release_freed_memory
heap.TIGHT = 0.0  # never short of memory here, whatever else the machine runs
took = keep_freed_memory()
pages = 48 * 2**20 // 4096
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x = torch.empty(64 * 2**18); x.fill_(1.0); del x          # 64 MiB: above glibc's largest mmap threshold
release_freed_memory()                                      # what a generation loop does after a batch
# 48 MiB fits in the freed 64 MiB (torch's 64-byte alignment makes a request of the very same size a
# little larger than the freed chunk, so the test asks for less)
f0 = faults(); y = torch.empty(48 * 2**18); y.fill_(2.0); again = faults() - f0
print(json.dumps({"took": took, "keeping": keeping(), "again": again, "pages": pages}))
"""


def _child(mode: str) -> dict:
    env = {**os.environ, "DELTALENS_MALLOC": mode}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc
def test_kept_memory_is_reused_without_faults():
    keep = _child("keep")
    assert keep["took"] is True and keep["keeping"] is True
    assert keep["again"] < keep["pages"] // 10, keep  # served from the freed 64 MiB, already resident


@glibc
def test_trim_mode_returns_memory_and_faults_it_in_again():
    trim = _child("trim")
    assert trim["took"] is False and trim["keeping"] is False
    assert trim["again"] > trim["pages"] // 2, trim  # a fresh mapping: every page faulted in again


@pytest.mark.parametrize("value, want", [(None, "auto"), ("", "auto"), ("trim", "trim"), (" KEEP ", "keep")])
def test_mode_reads_the_environment(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv("DELTALENS_MALLOC", raising=False)
    else:
        monkeypatch.setenv("DELTALENS_MALLOC", value)
    assert heap.mode() == want


def test_a_bad_mode_is_refused_in_one_line_by_the_cli(monkeypatch):
    from support import run_cli

    monkeypatch.setenv("DELTALENS_MALLOC", "jemalloc")
    with pytest.raises(DeltalensError, match="DELTALENS_MALLOC must be auto, keep or trim"):
        heap.mode()
    r = run_cli(["--version"])
    assert r.exit_code == 2
    assert r.output.strip() == "error: DELTALENS_MALLOC must be auto, keep or trim (got 'jemalloc')"


def test_auto_keeps_only_in_training_processes(monkeypatch):
    """auto: an analysis process (training=False) is left with glibc's defaults, mallopt never called."""
    calls = []

    class Libc:
        def mallopt(self, p, v):
            calls.append((p, v))
            return 1

    monkeypatch.setattr(heap, "_libc", lambda: Libc())
    monkeypatch.setattr(heap, "_keeping", False)
    monkeypatch.setenv("DELTALENS_MALLOC", "auto")
    assert heap.keep_freed_memory(training=False) is False and not calls and not heap.keeping()
    monkeypatch.setenv("DELTALENS_MALLOC", "keep")
    assert heap.keep_freed_memory(training=False) is True and heap.keeping()
    assert calls == [(heap.M_ARENA_MAX, 1), (heap.M_MMAP_MAX, 0), (heap.M_TRIM_THRESHOLD, -1)]
    calls.clear()
    monkeypatch.setattr(heap, "_keeping", False)
    monkeypatch.setenv("DELTALENS_MALLOC", "trim")
    assert heap.keep_freed_memory(training=True) is False and not calls


@pytest.mark.parametrize("args, training", [(["train", "es"], True), (["study", "tiny"], True),
                                            (["eval", "tiny"], False), (["probe", "tiny"], False), ([], False)])
def test_the_cli_keeps_for_training_commands(monkeypatch, args, training):
    import deltalens.cli.main as cli_main

    seen = []
    monkeypatch.setattr(cli_main, "keep_freed_memory", lambda training: seen.append(training))
    with pytest.raises(SystemExit):
        cli_main.main([*args, "--help"])
    assert seen == [training]


def test_a_keeping_process_trims_only_when_memory_runs_short(monkeypatch):
    trims = []

    class Libc:
        def malloc_trim(self, pad):
            trims.append(pad)
            return 1

    monkeypatch.setattr(heap, "_libc", lambda: Libc())
    monkeypatch.setattr(heap, "_keeping", True)
    monkeypatch.setattr(heap, "available_fraction", lambda: 0.5)
    assert heap.release_freed_memory() is False and trims == []
    monkeypatch.setattr(heap, "available_fraction", lambda: heap.TIGHT / 2)  # short of memory: trim anyway
    assert heap.release_freed_memory() is True and trims == [0]
    monkeypatch.setattr(heap, "available_fraction", lambda: None)  # unknown: keep
    assert heap.release_freed_memory() is False and trims == [0]
    monkeypatch.setattr(heap, "_keeping", False)  # trim mode: always
    assert heap.release_freed_memory() is True and trims == [0, 0]


def test_available_fraction_reads_meminfo():
    frac = heap.available_fraction()
    if platform.system() == "Linux":
        assert frac is not None and 0.0 < frac <= 1.0
