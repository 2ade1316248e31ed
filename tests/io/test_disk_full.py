"""A full disk is one line, never a traceback, whichever writer meets it: safetensors (its SafetensorError
"I/O error: No space left on device (os error 28)"), torch.save (a RuntimeError with no errno: "[enforce
fail at inline_container.cc:672] . unexpected pos ..." or "basic_ios::clear: iostream error"), JSON,
the metrics log and the run lock's pid. Nothing half-written remains, and a run stopped by a full disk
resumes, once space is freed, to the same weights as a run that never stopped.

First with the writers made to fail as they do (any machine), then on a real small tmpfs (where this
machine lets the test mount one; skipped with the reason otherwise).
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess

import pytest
import torch
from support import final_weights, run_cli, tiny_spec

from deltalens.errors import DeltalensError
from deltalens.io import atomic
from deltalens.io.atomic import is_temporary, save_state_dict, write_json_atomic
from deltalens.io.runs import RunDir

ST_ERROR = "Error while serializing: I/O error: No space left on device (os error 28)"
TORCH_ERRORS = ("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534",
                "PytorchStreamWriter failed writing file data/0: file write failed",
                "basic_ios::clear: iostream error")
SD = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}


def _partial_then(exc):
    """A writer that writes some bytes to its destination, then fails with `exc` (as a full disk does)."""
    def write(obj, dest, *a, **kw):
        with open(dest, "wb") as f:
            f.write(b"\0" * 100)
        raise exc
    return write


def _left(d):
    return sorted(p.name for p in d.iterdir())


# ---- the writers made to fail as they do on a full disk


def test_safetensors_io_error_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    import safetensors.torch
    from safetensors import SafetensorError

    monkeypatch.setattr(safetensors.torch, "save_file", _partial_then(SafetensorError(ST_ERROR)))
    with pytest.raises(DeltalensError) as e:
        save_state_dict(SD, tmp_path / "w.safetensors")
    assert str(e.value) == f"cannot write {tmp_path}/w.safetensors: no space left on device"
    assert _left(tmp_path) == []


@pytest.mark.parametrize("message", TORCH_ERRORS)
def test_torch_save_failure_on_a_full_disk_is_no_space(tmp_path, monkeypatch, message):
    monkeypatch.setattr(torch, "save", _partial_then(RuntimeError(message)))
    monkeypatch.setattr(atomic, "_free_bytes", lambda path: 4096)  # what a full disk has left
    with pytest.raises(DeltalensError) as e:
        save_state_dict(SD, tmp_path / "w.pt")
    assert str(e.value) == f"cannot write {tmp_path}/w.pt: no space left on device"
    assert _left(tmp_path) == []
    # with room left the cause is unknown: torch's own words, one line
    monkeypatch.setattr(atomic, "_free_bytes", lambda path: 10 << 30)
    with pytest.raises(DeltalensError) as e:
        save_state_dict(SD, tmp_path / "w.pt")
    assert str(e.value) == f"cannot write {tmp_path}/w.pt: {message}"
    assert _left(tmp_path) == []


def test_grpo_trainer_state_write_error_is_one_line(tmp_path, monkeypatch):
    from deltalens.training.grpo.train import save_trainer_state

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    monkeypatch.setattr(torch, "save", _partial_then(RuntimeError(TORCH_ERRORS[0])))
    monkeypatch.setattr(atomic, "_free_bytes", lambda path: 0)
    with pytest.raises(DeltalensError) as e:
        save_trainer_state(tmp_path / "final.trainer.pt", opt, None, 3)
    assert str(e.value) == f"cannot write {tmp_path}/final.trainer.pt: no space left on device"
    assert _left(tmp_path) == []


def test_json_and_lock_errors_are_one_line_and_leave_nothing(tmp_path, monkeypatch):
    real_fsync = os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(DeltalensError) as e:
        write_json_atomic({"a": 1}, tmp_path / "s.json")
    assert str(e.value) == f"cannot write {tmp_path}/s.json: no space left on device"
    assert _left(tmp_path) == []
    monkeypatch.setattr(os, "fsync", real_fsync)

    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: full(fd))
    with pytest.raises(DeltalensError) as e, RunDir(tmp_path / "run").writing():
        pass
    assert str(e.value) == f"cannot write {tmp_path}/run/.lock: no space left on device"
    assert _left(tmp_path) == []  # the directory it had just made is gone again
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text("{}")
    with pytest.raises(DeltalensError, match="no space left on device"), RunDir(tmp_path / "old").writing():
        pass
    assert _left(tmp_path / "old") == ["config.json"]  # an existing run keeps what it had, and only that


# ---- a real small file system


@pytest.fixture
def small_fs(tmp_path):
    """(mount point, resize(size)): a tmpfs of 512 KiB under tmp_path, unmounted afterwards."""
    d = tmp_path / "fs"
    d.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command on this machine")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(d)], check=False,
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {(r.stderr or r.stdout).strip().splitlines()[:1]}")

    def resize(size: str) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(d)], check=True, capture_output=True)

    try:
        yield d, resize
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False, capture_output=True)


def _fill(d):
    fd = os.open(d / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    try:  # the last partial block
        fd = os.open(d / "filler", os.O_WRONLY | os.O_APPEND)
        while True:
            os.write(fd, b"\0")
    except OSError:
        pass
    finally:
        os.close(fd)
    assert os.statvfs(d).f_bavail == 0


def test_every_writer_on_a_real_full_disk(small_fs):
    fs, _ = small_fs
    big = {"w": torch.zeros(300_000)}  # 1.2 MB: more than the file system holds
    for name in ("w.safetensors", "w.pt"):
        with pytest.raises(DeltalensError) as e:
            save_state_dict(big, fs / name)
        assert str(e.value) == f"cannot write {fs}/{name}: no space left on device"
        assert _left(fs) == []
    with pytest.raises(DeltalensError) as e:
        write_json_atomic({"x": "y" * 2_000_000}, fs / "s.json")
    assert str(e.value) == f"cannot write {fs}/s.json: no space left on device" and _left(fs) == []

    _fill(fs)  # 0 bytes free: even small writes and the lock's pid fail
    for name in ("small.safetensors", "small.pt"):
        with pytest.raises(DeltalensError) as e:
            save_state_dict(SD, fs / name)
        assert str(e.value) == f"cannot write {fs}/{name}: no space left on device"
    with pytest.raises(DeltalensError) as e, RunDir(fs / "run").writing():
        pass
    assert str(e.value) == f"cannot write {fs}/run/.lock: no space left on device"
    assert _left(fs) == ["filler"]


def test_training_stopped_by_a_full_disk_resumes_to_the_same_weights(tmp_path, small_fs, monkeypatch):
    fs, resize = small_fs
    monkeypatch.setenv("DELTALENS_PROGRESS", "0")
    args = ["--model", tiny_spec(), "--iterations", "2", "--population", "2", "--prompts-per-iteration", "2",
            "--eval-every", "0", "--checkpoint-every", "1"]
    ref = tmp_path / "ref"
    assert run_cli(["train", "es", *args, "--out", ref]).exit_code == 0
    resize("4500k")  # the first 3 MB checkpoint fits, the final one does not
    run = fs / "run"
    r = run_cli(["train", "es", *args, "--out", run])
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert lines == [f"error: cannot write {run}/checkpoints/final: no space left on device"], r.output
    assert not [p for p in run.rglob("*") if is_temporary(p.name)]
    assert RunDir(run).state()["checkpoint"] == "iter-000001"
    resize("64m")  # space freed
    r = run_cli(["train", "resume", run])
    assert r.exit_code == 0, r.output
    mine, want = final_weights(run), final_weights(ref)
    assert mine.keys() == want.keys() and all(torch.equal(mine[k], want[k]) for k in want)
