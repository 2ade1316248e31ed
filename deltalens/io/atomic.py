"""Atomic writes: JSON files, state dicts and whole directories appear complete or not at all.

Data goes to a temporary file (or directory) next to the destination and is moved into place with
os.replace, so a crash never leaves a half-written checkpoint, JSON or report behind: a reader sees
either the previous version or the new one.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from deltalens.errors import DeltalensError

TORCH_SUFFIXES = (".pt", ".pth", ".bin")


def _tmp_name(path: Path, tag: str) -> Path:
    # same directory (so os.replace is a rename, not a copy); keep the suffix for suffix-sniffing tools
    return path.with_name(f".{path.stem}.{tag}-{secrets.token_hex(4)}{path.suffix}")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on success move it onto `path`, on error delete it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path, "tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh directory `path.tmp-XXXX`; on success it becomes `path` (replacing any old one).

    The old directory is renamed aside before the new one is moved in and deleted only afterwards,
    so at every instant either the old or the new complete directory exists (possibly under the
    aside name `path.old-XXXX` if the process dies between the two renames).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tag = secrets.token_hex(4)
    tmp = path.with_name(f"{path.name}.tmp-{tag}")
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if path.exists():
        if not path.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
            raise DeltalensError(f"{path} exists and is not a directory: remove it or choose another output")
        old = path.with_name(f"{path.name}.old-{tag}")
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)


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
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
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



def save_state_dict(sd: dict[str, torch.Tensor], path: str | os.PathLike,
                    metadata: dict | None = None) -> Path:
    """Save a state dict atomically as .safetensors or .pt/.pth/.bin (chosen by suffix)."""
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
