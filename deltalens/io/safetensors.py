"""safetensors reader: the header (8-byte little-endian length + JSON) is parsed and checked here.

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
    """Parse a safetensors header; checks that every tensor's bytes lie inside the file."""
    if not file.is_file():
        raise DeltalensError(f"missing shard {file} (listed in the index of {owner})")
    bad = f"{file} is not a readable safetensors file (corrupt or truncated?)"
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise DeltalensError(f"{bad}: shorter than 8 bytes")
        n = int.from_bytes(head, "little")
        if n > size - 8 or n > 100_000_000:
            raise DeltalensError(f"{bad}: header length {n} does not fit in {size} bytes")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise DeltalensError(f"{bad}: header is not JSON ({one_line(e)})") from e
    if not isinstance(header, dict):
        raise DeltalensError(f"{bad}: header is not a JSON object")
    header.pop("__metadata__", None)
    for name, e in header.items():
        if not isinstance(e, dict) or e.get("dtype") not in ST_DTYPES or "data_offsets" not in e:
            raise DeltalensError(f"{bad}: bad header entry for {name}")
        if 8 + n + e["data_offsets"][1] > size:
            raise DeltalensError(f"{file} is truncated ({size} bytes; tensor {name} ends at "
                                 f"{8 + n + e['data_offsets'][1]}): re-download or re-save it")
    return 8 + n, header
