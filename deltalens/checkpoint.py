"""Checkpoint I/O: the one module that reads and writes weight files.

Everything else in deltalens works on tensors and state dicts; this module turns paths into those
and back. Weight-change analysis in the style of arXiv 2608.27351 (ES vs GRPO: what changed in the
weights; building on Qiu et al., arXiv 2509.24372) needs two things from it:

1. whole state dicts (`load_state_dict` / `save_state_dict`) for small models and for writing
   sparsified checkpoints, and
2. a *streaming* view (`open_tensors` -> `TensorSource`) that hands out one tensor at a time, so a
   diff of two multi-GB checkpoints holds only a few tensors in memory.

Formats read:
    .safetensors           header parsed here, one positional read per tensor or per range of a
                           tensor (read_range), into reusable buffers where the caller gives them (not
                           safe_open's mmap, whose touched pages inflate RSS to the file size)
    HF model directory     model.safetensors | model.safetensors.index.json (sharded) |
                           pytorch_model.bin | pytorch_model.bin.index.json (+ config.json)
    .pt / .pth / .bin      torch.load(weights_only=True) ALWAYS (never executes pickled code);
                           loads the whole file (pickles cannot be streamed); a dict holding the
                           tensors under "state_dict" or "model" is accepted
    .gguf                  llama.cpp files via the `gguf` package: quantized tensors are
                           dequantized to float32, names mapped to HF Llama names, and the q/k
                           row permutation that llama.cpp's converter applies is undone, so GGUF
                           tensors line up with HF tensors (same logic as transformers'
                           LlamaTensorProcessor._reverse_permute_weights)
    dict[str, Tensor]      in memory (open_tensors only), so analysis code takes either

Writes are atomic: data goes to a temporary file in the destination directory and is moved into
place with os.replace, so a crash never leaves a half-written checkpoint or JSON behind.

Tied weights (embedding == lm_head) are one parameter. `TensorSource.tied()` finds them from shared
storage (in-memory / .pt), from config.json `tie_word_embeddings`, from a GGUF without output.weight,
or from bit-identical embed/lm_head tensors; analysis counts each tied group once.

Departures from the paper's code: GGUF support (dequantized values, so deltas against a GGUF carry
quantization error) and the streaming reader are additions; the paper loads full HF models.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import secrets
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from deltalens.errors import DeltalensError

TORCH_SUFFIXES = (".pt", ".pth", ".bin")

# safetensors header dtype strings -> torch dtypes (for shape/dtype queries without reading data)
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
if hasattr(torch, "float8_e4m3fn"):
    _ST_DTYPES.update({"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2})

EMBED_NAMES = ("model.embed_tokens.weight", "transformer.wte.weight", "embed_tokens.weight")
LM_HEAD_NAMES = ("lm_head.weight",)


# ----------------------------------------------------------------------------------------------
# atomic writes


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


# ----------------------------------------------------------------------------------------------
# whole state dicts


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


def _torch_load(path: Path) -> dict[str, torch.Tensor]:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's message is a paragraph; the line naming the refused global is the useful one
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        why = next((ln for ln in lines if "global" in ln.lower() and "unsupported" in ln.lower()), None)
        raise DeltalensError(
            f"{path} is not a plain tensor state dict (weights_only load refused it): "
            f"{(why or _one_line(e))[:200]}; "
            "re-save it with torch.save(model.state_dict(), path)"
        ) from e
    except Exception as e:  # truncated zip, not a torch file at all, ...
        raise DeltalensError(f"cannot read {path} as a torch checkpoint: {_one_line(e)}") from e
    if isinstance(obj, dict) and not any(isinstance(v, torch.Tensor) for v in obj.values()):
        for key in ("state_dict", "model"):
            if isinstance(obj.get(key), dict):
                obj = obj[key]
                break
    if not isinstance(obj, dict):
        raise DeltalensError(f"{path} holds a {type(obj).__name__}, not a state dict: "
                             "save model.state_dict()")
    bad = [k for k, v in obj.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise DeltalensError(
            f"{path} has non-tensor entries ({', '.join(map(str, bad[:3]))}): save model.state_dict() only"
        )
    return dict(obj)


def load_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Load every tensor of a checkpoint (any format `open_tensors` reads) into a CPU state dict."""
    path = Path(path)
    if path.is_file() and path.suffix in TORCH_SUFFIXES:
        return _torch_load(path)
    if not path.exists() and str(path) not in ("tiny", "smollm2"):
        raise DeltalensError(f"no such file: {path}")
    with open_tensors(path) as src:
        return {name: src.get(name) for name in src.names()}


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


# ----------------------------------------------------------------------------------------------
# streaming sources


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
            self._headers[file] = _read_safetensors_header(file, self.path)
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
        return _ST_DTYPES[self._entry(name)[2]["dtype"]]

    def get(self, name):
        e = self._entry(name)[2]
        return self._read(name, torch.empty(e["shape"], dtype=_ST_DTYPES[e["dtype"]]))

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
        whole = math.prod(e["shape"]) * _ST_DTYPES[e["dtype"]].itemsize
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


def _read_safetensors_header(file: Path, owner: str) -> tuple[int, dict]:
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
            raise DeltalensError(f"{bad}: header is not JSON ({_one_line(e)})") from e
    if not isinstance(header, dict):
        raise DeltalensError(f"{bad}: header is not a JSON object")
    header.pop("__metadata__", None)
    for name, e in header.items():
        if not isinstance(e, dict) or e.get("dtype") not in _ST_DTYPES or "data_offsets" not in e:
            raise DeltalensError(f"{bad}: bad header entry for {name}")
        if 8 + n + e["data_offsets"][1] > size:
            raise DeltalensError(f"{file} is truncated ({size} bytes; tensor {name} ends at "
                                 f"{8 + n + e['data_offsets'][1]}): re-download or re-save it")
    return 8 + n, header


# ---- GGUF


# llama.cpp tensor names -> HF names for the Llama family (llama, mistral, qwen2, qwen3)
_GGUF_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# archs whose q/k rows llama.cpp permutes (convert_hf_to_gguf.py LlamaModel.permute)
_GGUF_PERMUTED = {"llama", "mistral"}
_GGUF_ARCHS = {"llama", "mistral", "qwen2", "qwen3"}


def gguf_to_hf_name(name: str) -> str:
    """Map a llama.cpp tensor name to its HF Llama-family name (unknown names are returned as-is)."""
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    parts = name.split(".")  # blk.N.<tensor>.<weight|bias>
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_BLOCK:
        return f"model.layers.{parts[1]}.{_GGUF_BLOCK[parts[2]]}.{parts[3]}"
    return name


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (n_head = KV heads for k).

    The converter reorders each head's rows from HF's [first half | second half] rotary layout to
    interleaved pairs: w.view(n_head, 2, d/2, ...).swapaxes(1, 2). The inverse views the rows as
    (n_head, d/2, 2) and swaps back. Works for weights (2-D) and biases (1-D).
    """
    d = w.shape[0] // n_head  # rows per head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFSource(TensorSource):
    """A llama.cpp .gguf file: tensors dequantized to float32 and renamed/unpermuted to HF layout."""

    def __init__(self, file: Path):
        try:
            from gguf import GGUFReader
        except ImportError as e:
            raise DeltalensError("reading .gguf needs the gguf package: pip install gguf") from e
        self.path = str(file)
        try:
            self._reader = GGUFReader(str(file))
        except Exception as e:
            raise DeltalensError(f"{file} is not a readable GGUF file (corrupt or truncated?): "
                                 f"{_one_line(e)}") from e
        arch = self._field("general.architecture")
        if arch not in _GGUF_ARCHS:
            raise DeltalensError(f"{file}: GGUF architecture {arch!r} is not supported (only "
                                 f"{', '.join(sorted(_GGUF_ARCHS))}); convert it to safetensors first")
        tensors = {t.name: t for t in self._reader.tensors}
        self._tensors = {gguf_to_hf_name(n): t for n, t in tensors.items()}
        self.config = {
            "model_type": arch,
            "num_attention_heads": self._field(f"{arch}.attention.head_count"),
            "num_key_value_heads": self._field(f"{arch}.attention.head_count_kv")
            or self._field(f"{arch}.attention.head_count"),
            "num_hidden_layers": self._field(f"{arch}.block_count"),
            # llama.cpp omits output.weight when the embedding is tied
            "tie_word_embeddings": "output.weight" not in tensors,
        }
        self._permuted = arch in _GGUF_PERMUTED

    def _field(self, key):
        f = self._reader.fields.get(key)
        if f is None:
            return None
        v = f.contents()
        return v

    def names(self):
        return list(self._tensors)

    def shape(self, name):
        # GGUF stores dims fastest-first (ggml ne[]): reverse for torch's row-major order
        return tuple(int(d) for d in reversed(self._tensors[name].shape.tolist()))

    def dtype(self, name):
        t = self._tensors[name]
        return {"F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}.get(
            t.tensor_type.name, torch.float32)  # quantized types dequantize to float32

    def get(self, name):
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        t = self._tensors[name]
        kind = t.tensor_type
        if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.F64):
            w = torch.from_numpy(t.data.copy())
        elif kind == GGMLQuantizationType.BF16:
            w = torch.from_numpy(t.data.copy()).view(torch.bfloat16)
        else:
            w = torch.from_numpy(dequantize(t.data, kind))  # (rows, cols) float32, fresh array
        w = w.reshape(self.shape(name))
        if self._permuted and (".q_proj." in name or ".k_proj." in name):
            heads = self.config["num_attention_heads" if ".q_proj." in name else "num_key_value_heads"]
            w = unpermute_qk(w, int(heads))
        return w.contiguous()

    def close(self):
        self._tensors = {}
        self._reader = None  # drops the np.memmap


class _Borrowed(TensorSource):
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


# ---- dispatch


def _read_config(directory: Path) -> dict:
    cfg = directory / "config.json"
    if not cfg.is_file():
        return {}
    try:
        config = json.loads(cfg.read_text())
    except (OSError, ValueError) as e:
        raise DeltalensError(f"{cfg} is not valid JSON: {_one_line(e)}") from e
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
            except (OSError, ValueError, KeyError) as e:
                raise DeltalensError(f"{index} is not a valid shard index: {_one_line(e)}") from e
            if kind == "st":
                return SafetensorsSource({n: d / f for n, f in weight_map.items()}, str(d), config)
            sd: dict[str, torch.Tensor] = {}
            for shard in dict.fromkeys(weight_map.values()):  # sharded .bin: no streaming possible
                sd.update(_torch_load(d / shard))
            return DictSource(sd, str(d), config)
    if (d / "pytorch_model.bin").is_file():
        return DictSource(_torch_load(d / "pytorch_model.bin"), str(d), config)
    ggufs = sorted(d.glob("*.gguf"))
    if len(ggufs) == 1:
        return GGUFSource(ggufs[0])
    raise DeltalensError(f"no weights found in {d}: expected model.safetensors, "
                         "model.safetensors.index.json or pytorch_model.bin")


def resolve_checkpoint(spec: str | os.PathLike) -> Path:
    """The weights a spec names: a path as-is, a deltalens run directory's final (else latest)
    checkpoint, or the model names 'tiny' / 'smollm2' understood everywhere in deltalens."""
    from deltalens import models

    path = Path(spec).expanduser()
    if path.is_dir():
        return models.run_checkpoint(path) or path
    if path.exists():
        return path
    if str(spec) in ("tiny", "smollm2"):
        return Path(models.resolve(str(spec))[1])
    raise DeltalensError(f"no such file: {spec}")


def open_tensors(path: str | os.PathLike | dict) -> TensorSource:
    """Open a checkpoint for streaming reads (see module docstring for formats). Close it when done.

    Also accepts a state dict (wrapped as-is), a TensorSource (returned as-is), a deltalens run
    directory and the names 'tiny' / 'smollm2' (see `resolve_checkpoint`).
    """
    if isinstance(path, dict):
        return DictSource(path)
    if isinstance(path, TensorSource):
        return _Borrowed(path)  # the caller owns it: closing this view leaves it open
    path = resolve_checkpoint(path)
    if path.is_dir():
        return _open_dir(path)
    # config.json next to a file only counts for HF's standard weight file names
    config = _read_config(path.parent) if path.name in ("model.safetensors", "pytorch_model.bin") else {}
    if path.suffix == ".safetensors":
        return SafetensorsSource.from_file(path, config)
    if path.suffix in TORCH_SUFFIXES:
        return DictSource(_torch_load(path), str(path), config)  # NOTE: loads the whole pickle
    if path.suffix == ".gguf":
        return GGUFSource(path)
    raise DeltalensError(f"unknown checkpoint format {path.suffix!r} for {path}: "
                         "use .safetensors, .pt/.pth/.bin, .gguf or an HF model directory")


def tied_names(src: TensorSource) -> set[str]:
    """Names to skip so every tied group is counted once (all members but the first)."""
    return {n for g in src.tied() for n in g[1:]}
