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

import json
import os
from pathlib import Path

import torch

from deltalens.errors import DeltalensError
from deltalens.io.atomic import TORCH_SUFFIXES
from deltalens.io.gguf import GGUFSource
from deltalens.io.runs import RunDir
from deltalens.io.safetensors import SafetensorsSource
from deltalens.io.source import Borrowed, DictSource, TensorSource, one_line
from deltalens.io.spec import NAMED_MODELS, ModelRef, resolve
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
    """The weights a spec names: a path as-is, a deltalens run directory's final (else latest)
    checkpoint, or the named models (tiny, smollm2, ...: `deltalens.io.spec.NAMED_MODELS`)."""
    if isinstance(spec, ModelRef):
        return spec.path
    path = Path(spec).expanduser()
    if path.is_dir():
        return RunDir(path).weights() if (path / "metrics.jsonl").exists() and (path / "checkpoints").is_dir() \
            else path
    if path.exists():
        return path
    if str(spec) in NAMED_MODELS:
        return resolve(str(spec)).path
    raise DeltalensError(f"no such file: {spec}")


def open_tensors(path: str | os.PathLike | dict | ModelRef | TensorSource) -> TensorSource:
    """Open a checkpoint for streaming reads (see module docstring for formats). Close it when done.

    Also accepts a state dict (wrapped as-is), a TensorSource (returned as-is), a deltalens run
    directory and the named models (see `resolve_checkpoint`).
    """
    if isinstance(path, dict):
        return DictSource(path)
    if isinstance(path, TensorSource):
        return Borrowed(path)  # the caller owns it: closing this view leaves it open
    path = resolve_checkpoint(path)
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


def tied_names(src: TensorSource) -> set[str]:
    """Names to skip so every tied group is counted once (all members but the first)."""
    return {n for g in src.tied() for n in g[1:]}


def load_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Load every tensor of a checkpoint (any format `open_tensors` reads) into a CPU state dict."""
    path = Path(path)
    if path.is_file() and path.suffix in TORCH_SUFFIXES:
        return torch_load(path)
    if not path.exists() and str(path) not in NAMED_MODELS:
        raise DeltalensError(f"no such file: {path}")
    with open_tensors(path) as src:
        return {name: src.get(name) for name in src.names()}
