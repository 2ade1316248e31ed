"""Named tensors of one checkpoint, read one at a time: the `TensorSource` interface every reader implements.

`deltalens.io.tensors.open_tensors` picks the reader for a path (safetensors, GGUF, .pt, HF directory);
analysis code (diff, sparsify) works on TensorSources, so a diff of two multi-GB checkpoints holds only
a few tensors in memory.

Tied weights (embedding == lm_head) are one parameter. `TensorSource.tied()` finds them from shared
storage (in-memory / .pt), from config.json `tie_word_embeddings`, from a GGUF without output.weight,
or from bit-identical embed/lm_head tensors; analysis counts each tied group once.
"""

from __future__ import annotations

import math

import torch

EMBED_NAMES = ("model.embed_tokens.weight", "transformer.wte.weight", "embed_tokens.weight")
LM_HEAD_NAMES = ("lm_head.weight",)


def one_line(e: BaseException) -> str:
    """The first line of an exception's message (at most 300 characters), for one-line errors."""
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


class TensorSource:
    """Named tensors of one checkpoint, read one at a time. Use as a context manager.

    names() lists tensors in file order; shape()/dtype() answer without reading data (except for
    .pt, which is loaded whole); get(name) returns a CPU tensor (a fresh copy for file sources).
    """

    path: str = "<memory>"
    config: dict  # config.json (or GGUF-derived) fields; {} when unknown

    def names(self) -> list[str]:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def dtype(self, name: str) -> torch.dtype:
        raise NotImplementedError

    def get(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    partial_reads = False  # True where read_range reads only the range (and into `buf`)

    def read_range(self, name: str, lo: int, hi: int, buf: torch.Tensor | None = None) -> torch.Tensor:
        """Coordinates [lo, hi) of the flattened tensor `name` (1-D).

        Sources with `partial_reads` (safetensors) read just those bytes, into `buf` when given (1-D
        uint8, 64-byte aligned, at least (hi - lo) * itemsize bytes): reused memory skips the page
        faults of a fresh allocation, which makes large reads ~2x faster. Others slice get(name).
        """
        self._check_range(name, lo, hi)
        return self.get(name).reshape(-1)[lo:hi]

    def _check_range(self, name: str, lo: int, hi: int) -> None:
        if not 0 <= lo <= hi <= self.numel(name):
            raise ValueError(f"range [{lo}, {hi}) outside {name} ({self.numel(name)} coordinates)")

    def numel(self, name: str) -> int:
        return math.prod(self.shape(name))

    def _shared_groups(self) -> list[list[str]]:
        return []  # only in-memory sources can share storage

    def tied(self) -> list[list[str]]:
        """Groups of names that are one parameter (count once). A name may be absent from names()
        when the file omits it because of the tie (HF drops lm_head.weight, GGUF output.weight)."""
        if not hasattr(self, "_tied"):
            self._tied = self._find_tied()
        return self._tied

    def _find_tied(self) -> list[list[str]]:
        groups = [g for g in self._shared_groups() if len(g) > 1]
        in_group = {n for g in groups for n in g}
        names = set(self.names())
        embed = next((n for n in EMBED_NAMES if n in names), None)
        head = next((n for n in LM_HEAD_NAMES if n in names), None)
        if embed is None or embed in in_group or (head is not None and head in in_group):
            return groups
        if head is None:
            if self.config.get("tie_word_embeddings"):
                groups.append([embed, LM_HEAD_NAMES[0]])  # tied and omitted from the file
        elif (self.shape(embed) == self.shape(head) and self.dtype(embed) == self.dtype(head)
              and torch.equal(self.get(embed), self.get(head))):
            # both stored: trust the bits, not config.json (a fine-tune may have untied them)
            groups.append([embed, head])
        return groups

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __contains__(self, name: str) -> bool:
        return name in set(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r}, {len(self)} tensors)"


class DictSource(TensorSource):
    """An in-memory state dict (also what a .pt file becomes: pickles cannot be streamed)."""

    def __init__(self, sd: dict[str, torch.Tensor], path: str = "<memory>", config: dict | None = None):
        self.sd, self.path, self.config = sd, path, config or {}

    def names(self):
        return list(self.sd)

    def shape(self, name):
        return tuple(self.sd[name].shape)

    def dtype(self, name):
        return self.sd[name].dtype

    def get(self, name):
        return self.sd[name]

    def _shared_groups(self):
        # same storage, offset, shape and stride = the same parameter under two names
        by_view: dict[tuple, list[str]] = {}
        for name, t in self.sd.items():
            if t.numel() == 0:
                continue
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            by_view.setdefault(key, []).append(name)
        return [g for g in by_view.values() if len(g) > 1]



class Borrowed(TensorSource):
    """A view of someone else's open source whose close() does nothing."""

    def __init__(self, src: TensorSource):
        self.src, self.path, self.config = src, src.path, src.config

    def names(self):
        return self.src.names()

    def shape(self, name):
        return self.src.shape(name)

    def dtype(self, name):
        return self.src.dtype(name)

    def get(self, name):
        return self.src.get(name)

    @property
    def partial_reads(self):
        return self.src.partial_reads

    def read_range(self, name, lo, hi, buf=None):
        return self.src.read_range(name, lo, hi, buf)

    def tied(self):
        return self.src.tied()
