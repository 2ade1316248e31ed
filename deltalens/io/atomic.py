"""Atomic writes: JSON files, state dicts and whole directories appear complete or not at all.

Data goes to a temporary file (or directory) next to the destination and is moved into place with
os.replace, so a crash never leaves a half-written checkpoint, JSON or report behind: a reader sees
either the previous version or the new one.

A write that fails (disk full, no permission, a parent that is a file, ...) removes its temporary file
or directory and raises one DeltalensError naming the destination (`write_error`), never an OSError
traceback. Importing this module does not import torch (`deltalens render` stays fast); saving a state dict does.
Temporaries a killed process left behind (`.NAME.tmp-XXXXXXXX.EXT`, `NAME.tmp-XXXXXXXX/`,
`NAME.old-XXXXXXXX/`) are recognised by `is_temporary` and cleaned by `clean_stale`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import secrets
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from deltalens.errors import DeltalensError

if TYPE_CHECKING:
    import torch

TORCH_SUFFIXES = (".pt", ".pth", ".bin")
# temporaries of atomic_path (.NAME.tmp-XXXXXXXX.EXT) and atomic_dir (NAME.tmp-XXXXXXXX, NAME.old-XXXXXXXX)
_TMP_FILE = re.compile(r"\..+\.tmp-[0-9a-f]{8}(\.[^.]*)?")
_TMP_DIR = re.compile(r"(?P<name>.+)\.(?P<kind>tmp|old)-(?P<tag>[0-9a-f]{8})")


_WHY = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
        errno.EACCES: "permission denied", errno.EPERM: "permission denied", errno.EROFS: "read-only file system",
        errno.ENOTDIR: "a parent is not a directory", errno.EISDIR: "it is a directory",
        errno.EFBIG: "file too large for this file system"}
# safetensors' writer (Rust) reports an I/O failure as SafetensorError("Error while serializing: I/O error: No
# space left on device (os error 28)"); torch.save's C++ writer as a RuntimeError without any errno: "[enforce
# fail at inline_container.cc:672] . unexpected pos 576 vs 534", "PytorchStreamWriter failed writing file
# data/0: file write failed" or, on a disk already full, "basic_ios::clear: iostream error"
_SAFETENSORS_IO = ("I/O error", "IoError", "os error")
_TORCH_WRITE = ("PytorchStreamWriter", "inline_container.cc", "basic_ios::clear", "iostream error",
                "file write failed")
_OS_ERROR = re.compile(r"\(os error (\d+)\)")
NEARLY_FULL = 1 << 20  # bytes: a torch write failure with less free than this is the disk being full


def _free_bytes(path: Path) -> int | None:
    """Bytes available to unprivileged writers on the file system of `path` (its nearest existing parent)."""
    for p in (path, *path.parents):
        try:
            st = os.statvfs(p)
        except OSError:
            continue
        return st.f_bavail * st.f_frsize
    return None


def write_error(path: str | os.PathLike, e: BaseException) -> DeltalensError:
    """One-line error for a failed write of `path`: an OSError, safetensors' I/O error or torch.save's.

    The errno names the cause (OSError, safetensors' "(os error N)"); torch.save gives none, so a full
    file system is recognised by its free space, probed while the failed temporary still holds what it
    wrote (callers translate before deleting it)."""
    path = Path(path)
    code = e.errno if isinstance(e, OSError) else None
    if code is None:
        m = _OS_ERROR.search(str(e))
        code = int(m[1]) if m else None
    if code is None and isinstance(e, RuntimeError) and any(s in str(e) for s in _TORCH_WRITE):
        free = _free_bytes(path.parent)
        code = errno.ENOSPC if free is not None and free < NEARLY_FULL else None
    if code in _WHY:
        why = _WHY[code]
    elif isinstance(e, OSError) and e.strerror:
        why = e.strerror
    else:
        lines = str(e).strip().splitlines()
        why = " ".join(lines[0].split())[:200] if lines else type(e).__name__
    return DeltalensError(f"cannot write {path}: {why}")


def _is_write_error(e: BaseException) -> bool:
    """An OSError, or what safetensors' and torch's writers raise for a failed write (see _TORCH_WRITE)."""
    text = str(e)
    return isinstance(e, OSError) or \
        (type(e).__name__ == "SafetensorError" and any(s in text for s in _SAFETENSORS_IO)) or \
        (isinstance(e, RuntimeError) and any(s in text for s in _TORCH_WRITE))


def _tmp_name(path: Path, tag: str) -> Path:
    # same directory (so os.replace is a rename, not a copy); keep the suffix for suffix-sniffing tools
    return path.with_name(f".{path.stem}.{tag}-{secrets.token_hex(4)}{path.suffix}")


def _mkdir_parent(path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = next((p for p in path.parents if p.exists()), path.parent)
        raise DeltalensError(f"cannot write {path}: {blocker} is a file, not a directory") from None
    except OSError as e:
        raise write_error(path, e) from None


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on success move it onto `path`, on error delete it.

    A failed write (an OSError in the block or in the final rename) becomes one DeltalensError."""
    path = Path(path)
    _mkdir_parent(path)
    tmp = _tmp_name(path, "tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as e:
        err = write_error(path, e) if _is_write_error(e) else None  # before the unlink frees the space
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if err is not None:
            raise err from None
        raise


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh directory `path.tmp-XXXX`; on success it becomes `path` (replacing any old one).

    The old directory is renamed aside before the new one is moved in and deleted only afterwards,
    so at every instant either the old or the new complete directory exists (possibly under the
    aside name `path.old-XXXX` if the process dies between the two renames: `clean_stale` puts it
    back). A failed write removes the temporary directory and raises one DeltalensError.
    """
    path = Path(path)
    _mkdir_parent(path)
    tag = secrets.token_hex(4)
    tmp = path.with_name(f"{path.name}.tmp-{tag}")
    try:
        tmp.mkdir()
    except OSError as e:
        raise write_error(path, e) from None
    try:
        yield tmp
    except BaseException as e:
        err = write_error(path, e) if _is_write_error(e) else None  # before the rmtree frees the space
        shutil.rmtree(tmp, ignore_errors=True)
        if err is not None:
            raise err from None
        raise
    if path.exists() and not path.is_dir():
        shutil.rmtree(tmp, ignore_errors=True)
        raise DeltalensError(f"{path} exists and is not a directory: remove it or choose another output")
    try:
        if path.exists():
            old = path.with_name(f"{path.name}.old-{tag}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_error(path, e) from None


def is_temporary(name: str) -> bool:
    """A name atomic_path / atomic_dir gives their temporaries (never a real output's name)."""
    return bool(_TMP_FILE.fullmatch(name) or _TMP_DIR.fullmatch(name))


def clean_stale(directory: str | os.PathLike) -> list[str]:
    """Remove the temporaries killed writers left in `directory` (not recursive); returns their names.

    Only call this while no other process writes there (e.g. under the run directory's lock). A
    directory caught between atomic_dir's two renames (`NAME.old-T` present, `NAME` missing) is
    completed first: its new version `NAME.tmp-T` (complete: the rename happens only after the write)
    else the old one becomes `NAME` again, so no complete checkpoint is ever lost.
    """
    d = Path(directory)
    if not d.is_dir():
        return []
    entries = sorted(p.name for p in d.iterdir())
    for name in entries:
        m = _TMP_DIR.fullmatch(name)
        if m and m["kind"] == "old" and not (d / m["name"]).exists():
            new = d / f"{m['name']}.tmp-{m['tag']}"
            os.replace(new if new.is_dir() else d / name, d / m["name"])
    removed = []
    for p in sorted(d.iterdir()):
        if is_temporary(p.name):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
            removed.append(p.name)
    return removed


def _json_safe(obj):
    # the schema has no NaN/Inf: a missing value is null
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    torch = sys.modules.get("torch")  # torch is imported lazily: only a loaded torch makes tensors
    if torch is not None and isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return _json_safe(obj.item())
    return obj


def write_json_atomic(obj, path: str | os.PathLike) -> Path:
    """Write `obj` as indented JSON atomically; non-finite floats become null. Returns the path."""
    path = Path(path)
    text = json.dumps(_json_safe(obj), indent=2, allow_nan=False) + "\n"
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    return path



def pin_json(settings: dict, path: str | os.PathLike) -> dict:
    """Pin `settings` in a JSON file: write it when absent; when present, return {key: (pinned, given)} for
    every key whose value differs (empty: the same settings). An unreadable file is a one-line error."""
    path = Path(path)
    if not path.exists():
        write_json_atomic(settings, path)
        return {}
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DeltalensError(f"{path} is unreadable ({e}); remove it or choose another --out") from None
    if not isinstance(old, dict):
        raise DeltalensError(f"{path} is not a JSON object; remove it or choose another --out")
    return {k: (old.get(k), settings.get(k)) for k in {*old, *settings} if old.get(k) != settings.get(k)}


def save_state_dict(sd: dict[str, torch.Tensor], path: str | os.PathLike,
                    metadata: dict | None = None) -> Path:
    """Save a state dict atomically as .safetensors or .pt/.pth/.bin (chosen by suffix)."""
    import torch

    path = Path(path)
    if path.suffix == ".safetensors":
        import safetensors.torch

        # safetensors refuses shared storage and non-contiguous tensors: give each its own copy
        seen: set[int] = set()
        out = {}
        for name, t in sd.items():
            ptr = t.untyped_storage().data_ptr() if t.numel() else None
            shared = ptr is not None and ptr in seen
            if ptr is not None:
                seen.add(ptr)
            t = t.detach().cpu()
            out[name] = t.clone(memory_format=torch.contiguous_format) if shared else t.contiguous()
        with atomic_path(path) as tmp:
            safetensors.torch.save_file(out, str(tmp), metadata=metadata)
    elif path.suffix in TORCH_SUFFIXES:
        with atomic_path(path) as tmp:
            torch.save({k: v.detach().cpu() for k, v in sd.items()}, tmp)
    else:
        raise DeltalensError(f"cannot save {path}: use a .safetensors or .pt file name")
    return path
