"""Run directories: one writer at a time (a live lock refuses, a dead holder's does not), stale temporaries
of killed writers are cleaned without losing a checkpoint, corrupt JSON and failed writes are one line."""

from __future__ import annotations

import errno
import os
import signal

import pytest
from support import hold_lock

from deltalens.errors import DeltalensError
from deltalens.io import atomic
from deltalens.io.atomic import atomic_dir, clean_stale, is_temporary, write_json_atomic
from deltalens.io.runs import LOCK_NAME, RunDir


def test_a_live_writer_refuses_a_second_and_a_dead_one_does_not(tmp_path):
    run = RunDir(tmp_path / "run")
    holder = hold_lock(run.path)
    try:
        refused = rf"being written by another deltalens process \(pid {holder.pid}\)"
        with pytest.raises(DeltalensError, match=refused), run.writing():
            pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with run.writing():  # the kernel released the killed holder's lock; the stale file does not block
        assert (run.path / LOCK_NAME).read_text().strip() == str(os.getpid())
    with run.writing():  # released at the end of the block
        pass


def test_clean_stale_removes_temporaries_and_finishes_interrupted_renames(tmp_path):
    d = tmp_path / "checkpoints"
    d.mkdir()
    for name in ("final.tmp-0123abcd", "iter-000002.tmp-deadbeef"):  # killed mid-write: incomplete
        (d / name).mkdir()
        (d / name / "model.safetensors").write_bytes(b"half")
    (d / ".state.tmp-89abcdef.json").write_text("{")
    # killed between atomic_dir's two renames: the new complete copy is moved in
    (d / "iter-000004.old-0badf00d").mkdir()
    (d / "iter-000004.old-0badf00d" / "v").write_text("old")
    (d / "iter-000004.tmp-0badf00d").mkdir()
    (d / "iter-000004.tmp-0badf00d" / "v").write_text("new")
    # ... or, without a new copy, the old one is put back
    (d / "iter-000006.old-00000001").mkdir()
    (d / "iter-000006.old-00000001" / "v").write_text("old6")
    (d / "iter-000008").mkdir()  # real entries stay
    (d / "notes.tmp-old.txt").write_text("not ours")
    clean_stale(d)
    assert sorted(p.name for p in d.iterdir()) == ["iter-000004", "iter-000006", "iter-000008", "notes.tmp-old.txt"]
    assert (d / "iter-000004" / "v").read_text() == "new" and (d / "iter-000006" / "v").read_text() == "old6"
    assert is_temporary(".metrics.tmp-0123abcd.jsonl") and not is_temporary("metrics.jsonl")


def test_opening_a_run_for_writing_cleans_it(tmp_path):
    run = RunDir(tmp_path / "run")
    run.ckpt.mkdir(parents=True)
    (run.ckpt / "final.tmp-0123abcd").mkdir()
    (run.path / ".state.tmp-0123abcd.json").write_text("{")
    (run.path / "metrics.jsonl.tmp").write_text("x")
    with run.writing():
        pass
    assert sorted(p.name for p in run.path.iterdir()) == [LOCK_NAME, "checkpoints"]
    assert list(run.ckpt.iterdir()) == []


@pytest.mark.parametrize("name", ["state.json", "config.json"])
@pytest.mark.parametrize("text", ["{\"iteration\": 3, \"chec", "[1, 2]", "\xff\xfe"])
def test_corrupt_run_json_is_one_line_naming_the_file(tmp_path, name, text):
    run = RunDir(tmp_path)
    (tmp_path / name).write_bytes(text.encode("latin-1"))
    read = run.state if name == "state.json" else run.config
    with pytest.raises(DeltalensError, match=rf"{name} is corrupt") as e:
        read()
    assert "\n" not in str(e.value)


def test_state_must_name_a_checkpoint_in_the_run(tmp_path):
    write_json_atomic({"iteration": 2, "checkpoint": "../../elsewhere"}, tmp_path / "state.json")
    with pytest.raises(DeltalensError, match="state.json is corrupt"):
        RunDir(tmp_path).state()


def _enospc(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_failed_writes_are_one_line_and_leave_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic.os, "fsync", _enospc)
    with pytest.raises(DeltalensError, match=r"cannot write .*a\.json: no space left on device"):
        write_json_atomic({"a": 1}, tmp_path / "a.json")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(DeltalensError, match="no space left"):
        RunDir(tmp_path).log({"iteration": 1})
    monkeypatch.undo()
    with pytest.raises(DeltalensError, match=r"cannot write .*ckpt: no space left on device"), \
            atomic_dir(tmp_path / "ckpt") as d:
        (d / "model.safetensors").write_bytes(b"half")
        _enospc()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no ckpt, no ckpt.tmp-*
    (tmp_path / "file").write_text("x")
    with pytest.raises(DeltalensError, match=r"cannot write .*file/sub/a\.json: .*file is a file, not a directory"):
        write_json_atomic({}, tmp_path / "file" / "sub" / "a.json")
