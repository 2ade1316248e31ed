"""Checkpoint I/O entry points: paths (or specs) to streaming `TensorSource`s and to whole state dicts.

Everything else in deltalens works on tensors and state dicts; this module turns paths into those. A
weight-change analysis in the style of arXiv 2608.27351 needs
1. whole state dicts (`load_state_dict`; `deltalens.io.atomic.save_state_dict` writes them) for small
   models and for writing sparsified checkpoints, and
2. a *streaming* view (`open_tensors` -> `TensorSource`) that hands out one tensor at a time.

Formats read (one small reader module each):
    .safetensors           deltalens.io.safetensors (header parsed and checked, positional reads)
    HF model directory     model.safetensors | model.safetensors.index.json (sharded) |
                           pytorch_model.bin | pytorch_model.bin.index.json (+ config.json)
    .pt / .pth / .bin      deltalens.io.torchfile (torch.load(weights_only=True) ALWAYS)
    .gguf                  deltalens.io.gguf (dequantized, HF names, q/k permutation undone)
    dict[str, Tensor]      in memory (open_tensors only), so analysis code takes either

Departures from the paper's code: GGUF support (dequantized values, so deltas against a GGUF carry
quantization error) and the streaming reader are additions; the paper loads full HF models.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from deltalens.errors import DeltalensError
from deltalens.io.atomic import TORCH_SUFFIXES
from deltalens.io.gguf import GGUFSource
from deltalens.io.runs import RunDir
from deltalens.io.safetensors import SafetensorsSource
from deltalens.io.source import Borrowed, DictSource, TensorSource, one_line
from deltalens.io.spec import NAMED_MODELS, ModelRef, resolve, resolve_arch
from deltalens.io.torchfile import torch_load


def _read_config(directory: Path) -> dict:
    cfg = directory / "config.json"
    if not cfg.is_file():
        return {}
    try:
        config = json.loads(cfg.read_text())
    except (OSError, ValueError) as e:
        raise DeltalensError(f"{cfg} is not valid JSON: {one_line(e)}") from e
    # some configs nest the text model (e.g. multimodal wrappers)
    if "tie_word_embeddings" not in config and isinstance(config.get("text_config"), dict):
        config["tie_word_embeddings"] = config["text_config"].get("tie_word_embeddings")
    return config


def _open_dir(d: Path) -> TensorSource:
    config = _read_config(d)
    if (d / "model.safetensors").is_file():
        return SafetensorsSource.from_file(d / "model.safetensors", config)
    for index_name, kind in (("model.safetensors.index.json", "st"), ("pytorch_model.bin.index.json", "bin")):
        index = d / index_name
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
                raise DeltalensError(f"{index} is not a valid shard index: {one_line(e)}") from e
            if not isinstance(weight_map, dict) or not all(
                    isinstance(f, str) and f and Path(f).name == f for f in weight_map.values()):
                raise DeltalensError(f"{index} is not a valid shard index: weight_map must map tensor names "
                                     "to shard file names in the same directory")
            if kind == "st":
                return SafetensorsSource({n: d / f for n, f in weight_map.items()}, str(d), config)
            sd: dict[str, torch.Tensor] = {}
            for shard in dict.fromkeys(weight_map.values()):  # sharded .bin: no streaming possible
                sd.update(torch_load(d / shard))
            return DictSource(sd, str(d), config)
    if (d / "pytorch_model.bin").is_file():
        return DictSource(torch_load(d / "pytorch_model.bin"), str(d), config)
    ggufs = sorted(d.glob("*.gguf"))
    if len(ggufs) == 1:
        return GGUFSource(ggufs[0])
    raise DeltalensError(f"no weights found in {d}: expected model.safetensors, "
                         "model.safetensors.index.json or pytorch_model.bin")


def resolve_checkpoint(spec: str | os.PathLike | ModelRef) -> Path:
    """The weights a spec names: an existing file or directory as it is (open_tensors also reads weight
    directories without config.json, and names unknown formats itself), else what `resolve` makes of it
    (a deltalens run directory's final, else latest, checkpoint; the named models:
    `deltalens.io.spec.NAMED_MODELS`)."""
    if isinstance(spec, ModelRef):
        return spec.path
    path = Path(spec).expanduser()
    if path.exists() and not RunDir.is_run(path):
        return path
    if path.exists() or str(spec) in NAMED_MODELS:
        return resolve(spec).path
    raise DeltalensError(f"no such file: {spec}")


def references(paths: list, arch: str | ModelRef | None = None) -> list:
    """What `open_tensors` reads, each model spec resolved once into a `ModelRef` that every later step takes
    (`deltalens.io.spec.resolve`; bare weights carry `arch`, resolved once here, whose config.json
    `open_tensors` lends them). As they are: a state dict, an open TensorSource, a reference, and a directory
    of weights without config.json (`open_tensors` reads one; `resolve` takes no such model spec)."""
    arch = resolve_arch(arch)
    out = []
    for p in paths:
        if isinstance(p, (str, os.PathLike)):
            d = Path(p).expanduser()
            p = p if d.is_dir() and not (d / "config.json").is_file() else resolve(p, arch=arch)
        out.append(p)
    return out


def open_tensors(path: str | os.PathLike | dict | ModelRef | TensorSource) -> TensorSource:
    """Open a checkpoint for streaming reads (see module docstring for formats). Close it when done.

    Also accepts a state dict (wrapped as-is), a TensorSource (returned as-is), a deltalens run
    directory, the named models (see `resolve_checkpoint`) and a `ModelRef`: a bare weights file with
    `ModelRef.arch` and no config of its own gets that architecture's config.json (its tied embeddings).
    Inside `hashing_reads`, the reads of a single .safetensors file feed its `FileHasher`.
    """
    if isinstance(path, dict):
        return DictSource(path)
    if isinstance(path, TensorSource):
        return Borrowed(path)  # the caller owns it: closing this view leaves it open
    ref = path if isinstance(path, ModelRef) else None
    path = resolve_checkpoint(path)
    src = _open_path(path)
    if ref is not None and ref.kind == "weights" and ref.arch is not None and not src.config:
        src.config = arch_config(ref.arch)
    hasher = _HASHERS.get(Path(src.path)) if isinstance(src, SafetensorsSource) else None
    if hasher is not None:
        # the source's one file handle, read through the hasher (SafetensorsSource opens it lazily)
        src._files[Path(src.path)] = hasher.reader()
    return src


def _open_path(path: Path) -> TensorSource:
    if path.is_dir():
        return _open_dir(path)
    # config.json next to a file only counts for HF's standard weight file names
    config = _read_config(path.parent) if path.name in ("model.safetensors", "pytorch_model.bin") else {}
    if path.suffix == ".safetensors":
        return SafetensorsSource.from_file(path, config)
    if path.suffix in TORCH_SUFFIXES:
        return DictSource(torch_load(path), str(path), config)  # NOTE: loads the whole pickle
    if path.suffix == ".gguf":
        return GGUFSource(path)
    raise DeltalensError(f"unknown checkpoint format {path.suffix!r} for {path}: "
                         "use .safetensors, .pt/.pth/.bin, .gguf or an HF model directory")


def arch_config(arch: str | None) -> dict:
    """config.json of the architecture `arch` names (a checked `--arch`: `deltalens.io.spec.check_arch`);
    {} for none, or for one without a config.json of its own (a GGUF, a hub id)."""
    if arch is None:
        return {}
    ref = resolve(arch)
    if ref.kind != "hf_dir":
        return {}
    f = Path(ref.location) / "config.json"
    if not f.is_file():
        return {}
    try:
        cfg = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise DeltalensError(f"--arch {arch}: {f} is not valid JSON ({e})") from e
    return cfg if isinstance(cfg, dict) else {}


# ----------------------------------------------------------------------------- content hashes while reading


_HASHERS: dict[Path, FileHasher] = {}  # file -> its hasher, while `hashing_reads` is active


@contextlib.contextmanager
def hashing_reads(hashers: Iterable[FileHasher]) -> Iterator[None]:
    """For the block, every `open_tensors` of one of these files reads it through its hasher."""
    hashers = list(hashers)
    _HASHERS.update({h.file: h for h in hashers})
    try:
        yield
    finally:
        for h in hashers:
            _HASHERS.pop(h.file, None)


class FileHasher:
    """The sha256 stream `name + bytes` of one file, fed by the reads a source makes of it.

    A diff reads a safetensors file tensor by tensor, mostly in file order. `reader()` is a file object
    whose reads at or past the hashed prefix extend it (a skipped gap is read and hashed on the way);
    reads behind it (a tensor read twice, or out of order) are plain reads. `finish()` hashes the rest
    of the file, so every byte enters the hash once and in order: the digest is that of the whole file,
    and a file the reads cover in order is read from disk once for both the diff and its hash. What the
    reads take out of order is read twice (a diff's tie check reads an untied embedding and LM head
    before the rest: about 5% of tiny, less for larger models).
    `h` is the caller's hashlib object (the stream may go on with other files after this one).
    """

    CHUNK = 1 << 22

    def __init__(self, file: Path, h):
        self.file, self.h, self.done = Path(file), h, 0  # done: bytes [0, done) are in the hash
        h.update(self.file.name.encode())
        self.bytes_read = 0  # every byte read from the file, for tests and benchmarks

    def reader(self) -> _HashingReader:
        return _HashingReader(self)

    def _extend(self, f, upto: int) -> None:
        """Hash bytes [done, upto) of open file f (reading the gap)."""
        f.seek(self.done)
        while self.done < upto:
            block = f.read(min(self.CHUNK, upto - self.done))
            if not block:
                break
            self.bytes_read += len(block)
            self.h.update(block)
            self.done += len(block)

    def finish(self):
        """Hash what the reads left out (to the end of the file); returns the hashlib object."""
        with open(self.file, "rb") as f:
            self._extend(f, self.file.stat().st_size)
        return self.h


class _HashingReader:
    """The file object `FileHasher.reader` hands a SafetensorsSource (seek + readinto + close)."""

    def __init__(self, hasher: FileHasher):
        self.hasher, self.f, self.pos = hasher, open(hasher.file, "rb"), 0  # noqa: SIM115 - closed in close()

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = self.f.seek(pos, whence)
        return self.pos

    def readinto(self, buf) -> int:
        hs = self.hasher
        if self.pos > hs.done:
            hs._extend(self.f, self.pos)  # the gap before this read enters the hash first
        self.f.seek(self.pos)
        got = self.f.readinto(buf)
        hs.bytes_read += got
        if self.pos == hs.done:
            hs.h.update(memoryview(buf)[:got])
            hs.done += got
        self.pos += got
        return got

    def close(self) -> None:
        self.f.close()


def tied_names(src: TensorSource) -> set[str]:
    """Names to skip so every tied group is counted once (all members but the first)."""
    return {n for g in src.tied() for n in g[1:]}


def load_state_dict(path: str | os.PathLike | ModelRef) -> dict[str, torch.Tensor]:
    """Load every tensor of a checkpoint (any format `open_tensors` reads) into a CPU state dict."""
    path = path.path if isinstance(path, ModelRef) else Path(path)
    if path.is_file() and path.suffix in TORCH_SUFFIXES:
        return torch_load(path)
    if not path.exists() and str(path) not in NAMED_MODELS:
        raise DeltalensError(f"no such file: {path}")
    with open_tensors(path) as src:
        return {name: src.get(name) for name in src.names()}
