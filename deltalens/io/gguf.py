"""GGUF reader: llama.cpp files via the `gguf` package, in HF names and layout.

Quantized tensors are dequantized to float32, names are mapped to HF Llama names, and the q/k row
permutation that llama.cpp's converter applies is undone, so GGUF tensors line up with HF tensors (same
logic as transformers' LlamaTensorProcessor._reverse_permute_weights); Gemma 3's norm weights, stored by
llama.cpp as the acting scale 1 + w, are returned as w, as transformers holds them. Deltas against a GGUF base carry
its quantization error (SmolLM2-135M-Instruct ships as Q4_1: "the base" is that 4-bit model dequantized).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from pathlib import Path

import torch

from deltalens.errors import DeltalensError
from deltalens.io.source import TensorSource, one_line

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
# Gemma 3 has four norms per block: llama.cpp's ffn_norm is its pre-feedforward norm, and the norm after
# attention is a tensor of its own (transformers' Gemma3DecoderLayer names)
_GGUF_BLOCK_GEMMA3 = {**_GGUF_BLOCK, "ffn_norm": "pre_feedforward_layernorm",
                      "post_attention_norm": "post_attention_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"}
# archs whose q/k rows llama.cpp permutes (convert_hf_to_gguf.py LlamaModel.permute)
_GGUF_PERMUTED = {"llama", "mistral"}
_GGUF_ARCHS = {"llama", "mistral", "qwen2", "qwen3", "gemma3"}
# archs whose RMSNorm computes x * (1 + w): llama.cpp stores 1 + w (the scale that acts), transformers and
# deltalens hold w, so 1 is subtracted on read (as transformers' Gemma2TensorProcessor does)
_GGUF_NORM_SHIFT = {"gemma3"}


def gguf_to_hf_name(name: str, arch: str = "llama") -> str:
    """Map a llama.cpp tensor name to its HF name for `arch` (unknown names are returned as-is)."""
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    block = _GGUF_BLOCK_GEMMA3 if arch == "gemma3" else _GGUF_BLOCK
    parts = name.split(".")  # blk.N.<tensor>.<weight|bias>
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in block:
        return f"model.layers.{parts[1]}.{block[parts[2]]}.{parts[3]}"
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
                                 f"{one_line(e)}") from e
        arch = self._field("general.architecture")
        if arch not in _GGUF_ARCHS:
            raise DeltalensError(f"{file}: GGUF architecture {arch!r} is not supported (only "
                                 f"{', '.join(sorted(_GGUF_ARCHS))}); convert it to safetensors first")
        tensors = {t.name: t for t in self._reader.tensors}
        self._tensors = {gguf_to_hf_name(n, arch): t for n, t in tensors.items()}
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
        self._norm_shift = arch in _GGUF_NORM_SHIFT

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
        if self._norm_shift and name.endswith("norm.weight"):
            w = w - 1  # stored as the acting scale 1 + w (see _GGUF_NORM_SHIFT)
        return w.contiguous()

    def close(self):
        self._tensors = {}
        self._reader = None  # drops the np.memmap


# GGUF metadata value types (gguf's GGUFValueType) -> struct format of a scalar; 8 string, 9 array
_KV_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_KV_STRING, _KV_ARRAY = 8, 9


def read_metadata(file: Path | str, keys: Iterable[str]) -> dict:
    """The scalar metadata values of `keys` in a GGUF file's header (a missing key is left out), read
    with the standard library alone: no tensor data, and arrays (the vocabulary, 262k strings for Gemma 3)
    skipped, not parsed, so it costs well under a second where `gguf.GGUFReader` takes seconds.

    Layout (GGUF v2/v3, little-endian): b"GGUF", version u32, tensor count u64, key count u64, then per
    key a string (u64 length, UTF-8 bytes), a value type u32 and the value; an array is an item type u32,
    a count u64 and the items. Every header field is checked before use; a file that breaks the layout is
    refused in one line."""
    want = set(keys)
    found: dict = {}
    file = Path(file)
    try:
        with open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size

            def take(n: int) -> bytes:
                b = f.read(n)
                if len(b) != n:
                    raise DeltalensError(f"{file}: GGUF header ends early (truncated file?)")
                return b

            def unpack(fmt: str):
                return struct.unpack("<" + fmt, take(struct.calcsize(fmt)))[0]

            def string() -> bytes:
                n = unpack("Q")
                if n > size - f.tell():
                    raise DeltalensError(f"{file}: GGUF string of {n} bytes runs past the end of the file")
                return take(n)

            def skip(vtype: int) -> None:
                if vtype in _KV_SCALARS:
                    f.seek(struct.calcsize(_KV_SCALARS[vtype]), 1)
                elif vtype == _KV_STRING:
                    f.seek(unpack("Q"), 1)
                elif vtype == _KV_ARRAY:
                    itype, count = unpack("I"), unpack("Q")
                    if itype in _KV_SCALARS:
                        f.seek(count * struct.calcsize(_KV_SCALARS[itype]), 1)
                    else:
                        for _ in range(count):
                            skip(itype)
                else:
                    raise DeltalensError(f"{file}: unknown GGUF metadata value type {vtype}")
                if f.tell() > size:
                    raise DeltalensError(f"{file}: GGUF metadata runs past the end of the file")

            if take(4) != b"GGUF":
                raise DeltalensError(f"{file} is not a GGUF file (no GGUF magic)")
            version = unpack("I")
            if version not in (2, 3):
                raise DeltalensError(f"{file}: GGUF version {version} is not supported (2 or 3; a big-endian "
                                     f"file reads as a huge version)")
            unpack("Q")  # tensor count: not needed here
            n_kv = unpack("Q")
            for _ in range(n_kv):
                if not want - found.keys():
                    break
                key = string().decode("utf-8", errors="replace")
                vtype = unpack("I")
                if key in want and vtype in _KV_SCALARS:
                    found[key] = unpack(_KV_SCALARS[vtype])
                elif key in want and vtype == _KV_STRING:
                    found[key] = string().decode("utf-8", errors="replace")
                else:
                    skip(vtype)
    except OSError as e:
        raise DeltalensError(f"cannot read {file}: {one_line(e)}") from e
    return found
