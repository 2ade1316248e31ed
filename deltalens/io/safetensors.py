"""safetensors reader: the header (8-byte little-endian length + JSON) is parsed and validated here.

One .safetensors file or a sharded set (name -> shard file). Each tensor (or range of one, `read_range`)
is read with one positional read into a buffer, not through safe_open's mmap: mmap'd pages that were
touched count towards the process RSS until the file is closed, so streaming a 6 GB checkpoint through
safe_open shows a 6 GB RSS; plain reads keep RSS at the tensors actually alive.
"""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import torch

from deltalens.errors import DeltalensError
from deltalens.io.source import TensorSource, one_line

# safetensors header dtype strings -> torch dtypes (for shape/dtype queries without reading data)
ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
if hasattr(torch, "float8_e4m3fn"):
    ST_DTYPES.update({"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2})
MAX_HEADER = 100_000_000  # bytes; the reference reader's limit too


class SafetensorsSource(TensorSource):
    """One .safetensors file or a sharded set (name -> shard file).

    Reads each tensor with one positional read into a fresh tensor instead of safe_open's mmap:
    mmap'd pages that were touched count towards the process RSS until the file is closed, so
    streaming a 6 GB checkpoint through safe_open shows a 6 GB RSS; plain reads keep RSS at the
    tensors actually alive. The header (8-byte little-endian length + JSON) is parsed here.
    """

    def __init__(self, weight_map: dict[str, Path], path: str, config: dict | None = None):
        self.path, self.config = path, config or {}
        self._map = weight_map
        self._headers: dict[Path, tuple[int, dict]] = {}  # file -> (data start, header)
        self._files: dict[Path, object] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_file(cls, file: Path, config: dict | None = None) -> SafetensorsSource:
        src = cls({}, str(file), config)
        _, header = src._header(file)
        src._map = {n: file for n in sorted(header, key=lambda n: header[n]["data_offsets"][0])}  # file order
        return src

    def _header(self, file: Path) -> tuple[int, dict]:
        if file not in self._headers:
            self._headers[file] = read_header(file, self.path)
        return self._headers[file]

    def _entry(self, name: str) -> tuple[Path, int, dict]:
        file = self._map[name]  # KeyError for unknown names, like a dict
        start, header = self._header(file)
        if name not in header:
            raise DeltalensError(f"{file} has no tensor {name} although the index of {self.path} lists it")
        return file, start, header[name]

    def names(self):
        return list(self._map)

    def shape(self, name):
        return tuple(self._entry(name)[2]["shape"])

    def dtype(self, name):
        return ST_DTYPES[self._entry(name)[2]["dtype"]]

    def get(self, name):
        e = self._entry(name)[2]
        return self._read(name, torch.empty(e["shape"], dtype=ST_DTYPES[e["dtype"]]))

    partial_reads = True

    def read_range(self, name, lo, hi, buf=None):
        dtype = self.dtype(name)
        self._check_range(name, lo, hi)
        n = (hi - lo) * dtype.itemsize
        if buf is None:
            out = torch.empty(hi - lo, dtype=dtype)
        elif buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < n or not buf.is_contiguous():
            raise ValueError(f"read_range needs a contiguous 1-D uint8 buffer of >= {n} bytes for {name}")
        else:
            out = buf[:n].view(dtype)
        return self._read(name, out, lo * dtype.itemsize)

    def _read(self, name, out, skip=0):
        """Fill contiguous `out` with the tensor's bytes from byte `skip` of its data on."""
        file, start, e = self._entry(name)
        lo, hi = e["data_offsets"]
        if out.numel() == 0:
            return out
        buf = out.reshape(-1).view(torch.uint8).numpy()  # writable bytes of `out`
        whole = math.prod(e["shape"]) * ST_DTYPES[e["dtype"]].itemsize
        with self._lock:                                  # seek + read: one thread at a time per source
            if file not in self._files:
                self._files[file] = open(file, "rb")  # noqa: SIM115 - kept open across get(); close()
            f = self._files[file]
            f.seek(start + lo + skip)
            got = f.readinto(buf) if hi - lo == whole else -1
        if got != buf.nbytes:
            raise DeltalensError(f"{file}: tensor {name} is truncated or mis-sized: "
                                 "re-download or re-save it")
        return out

    def close(self):
        for f in self._files.values():
            f.close()
        self._files.clear()


def read_header(file: Path, owner: str) -> tuple[int, dict]:
    """Parse and validate a safetensors header: (byte offset of the data section, {name: entry}).

    The header is untrusted input: a file whose offsets point into the header, overlap, leave holes or
    disagree with a tensor's shape would otherwise be read as weights. Every entry is checked before any
    tensor is read (`check_entries`); any violation is one DeltalensError naming the tensor.
    """
    if not file.is_file():
        raise DeltalensError(f"missing shard {file} (listed in the index of {owner})")
    bad = f"{file} is not a readable safetensors file (corrupt or truncated?)"
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise DeltalensError(f"{bad}: shorter than 8 bytes")
            n = int.from_bytes(head, "little")
            if n > size - 8 or n > MAX_HEADER:
                raise DeltalensError(f"{bad}: header length {n} does not fit in {size} bytes")
            raw = f.read(n)
    except OSError as e:
        raise DeltalensError(f"cannot read {file}: {e.strerror or one_line(e)}") from None
    try:
        header = json.loads(raw.decode("utf-8"))  # the format's encoding (json.loads would guess others)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise DeltalensError(f"{bad}: header is not JSON ({one_line(e)})") from None
    if not isinstance(header, dict):
        raise DeltalensError(f"{bad}: header is not a JSON object")
    check_entries(header, size - 8 - n, file)
    header.pop("__metadata__", None)
    return 8 + n, header


def check_entries(header: dict, data_size: int, file: Path) -> None:
    """Validate every entry of a parsed header against a data section of `data_size` bytes.

    The rules of the safetensors format: dtype known; shape a list of non-negative ints; data_offsets
    exactly two ints with 0 <= start <= end <= data_size and end - start = numel x itemsize; the
    tensors tile the data section with no overlap and no hole (what the reference reader enforces, so a
    file accepted here is accepted there); __metadata__, if present, maps strings to strings.
    """
    def lie(what: str) -> DeltalensError:
        return DeltalensError(f"{file}: {what} (a corrupt or edited header): re-download or re-save it")

    meta = header.get("__metadata__")
    if "__metadata__" in header and not (isinstance(meta, dict) and
                                         all(isinstance(v, str) for v in meta.values())):
        raise lie("__metadata__ must map strings to strings")
    spans = []
    for name, e in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(e, dict):
            raise lie(f"the entry of tensor {name} is not an object")
        dtype, shape, offsets = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in ST_DTYPES:
            raise lie(f"tensor {name} has unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise lie(f"tensor {name} has shape {shape!r}, not a list of integers >= 0")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
            raise lie(f"tensor {name} has data_offsets {offsets!r}, not two integers")
        start, end = offsets
        if 0 <= start <= end and end > data_size:
            raise DeltalensError(f"{file} is truncated: tensor {name} ends {end - data_size} bytes past the end of "
                                 "the file; re-download or re-save it")
        if not 0 <= start <= end <= data_size:
            raise lie(f"tensor {name} has data_offsets [{start}, {end}] outside the {data_size}-byte data section")
        want = math.prod(shape) * ST_DTYPES[dtype].itemsize
        if end - start != want:
            raise lie(f"tensor {name} is mis-sized: it spans {end - start} bytes but its shape {shape} of {dtype} "
                      f"needs {want}")
        spans.append((start, end, name))
    at, last = 0, None
    for start, end, name in sorted(spans):
        if start < at:
            raise lie(f"tensor {name} overlaps tensor {last}")
        if start > at:
            raise lie(f"bytes {at}..{start} before tensor {name} belong to no tensor")
        at, last = end, name
    if at != data_size:
        raise lie(f"the data section has {data_size} bytes but its tensors cover {at}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
