"""Where each HF parameter lives inside vLLM's fused weights (Llama, Qwen2, Gemma 3; tensor parallel size 1).

vLLM loads an HF checkpoint into fewer, larger tensors than transformers keeps:

    HF (transformers)                              vLLM
    model.layers.i.self_attn.q_proj.{weight,bias}  model.layers.i.self_attn.qkv_proj.{weight,bias}  rows [0, q)
    model.layers.i.self_attn.k_proj.{weight,bias}    "                                              rows [q, q+kv)
    model.layers.i.self_attn.v_proj.{weight,bias}    "                                              rows [q+kv, q+2kv)
    model.layers.i.mlp.gate_proj.{weight,bias}     model.layers.i.mlp.gate_up_proj.{weight,bias}    rows [0, I)
    model.layers.i.mlp.up_proj.{weight,bias}         "                                              rows [I, 2I)
    model.embed_tokens.weight                      model.embed_tokens.weight  rows [0, V) of a V padded to 64
    lm_head.weight                                 lm_head.weight (rows [0, V) of padded V), or, with tied
                                                   embeddings, model.embed_tokens.weight (one tensor)
    everything else (o_proj, down_proj, norms)     the same name, the same shape

Gemma 3 (`gemma3_text`: transformers' Gemma3ForCausalLM, vLLM's of the same name) fuses the same way and adds
norms of its own, unfused: per-head q_norm/k_norm (head_dim) after q/k, and pre/post-feedforward norms beside
the input and post-attention ones; its head_dim (256 on Gemma-3-270M) is not hidden/heads. Both hold the
norm weight w of x·(1 + w) (GemmaRMSNorm), so nothing is shifted between them; the sqrt(hidden) scale of the
embedding is a buffer in both, not a weight.

with q = num_attention_heads·head_dim, kv = num_key_value_heads·head_dim (GQA), I = intermediate_size,
V = vocab_size. vLLM pads the vocabulary dimension of the embedding and of the LM head to a multiple of
64 (`DEFAULT_VOCAB_PADDING_SIZE`); the padded rows are zero and never read for real tokens.

Every HF tensor is a slice along dim 0 of one vLLM tensor, so it is also one contiguous range of that
tensor's flattened elements: the ES extension (`deltalens.training.es.backends.vllm`) writes an HF tensor's noise into
that range without ever materialising the HF tensor. With tensor parallelism each rank holds shards
(q/k/v heads and gate/up rows split, o_proj/down_proj split along dim 1): not handled here.

Everything in this module is pure torch; no vLLM import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from deltalens.errors import DeltalensError

VOCAB_PADDING = 64  # vllm.model_executor.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE
SUPPORTED = ("llama", "qwen2", "gemma3_text")

# HF projection -> (vLLM fused projection, shard id as vLLM's weight loaders name it)
_FUSED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")


@dataclass(frozen=True)
class Arch:
    """The few config numbers that decide the layout."""

    model_type: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool = False  # Gemma 3: self_attn.q_norm / k_norm (head_dim) after the projections
    ffn_norms: bool = False  # Gemma 3: pre_feedforward_layernorm and post_feedforward_layernorm as well

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim


def arch(config) -> Arch:
    """Layout numbers from an HF config (a `PretrainedConfig` or its `to_dict()`)."""
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    model_type = get("model_type")
    if model_type not in SUPPORTED:
        raise DeltalensError(f"the vLLM layout mapping supports {', '.join(SUPPORTED)} models, not "
                             f"{model_type!r}; use --backend hf for this model")
    heads = int(get("num_attention_heads"))
    hidden = int(get("hidden_size"))
    kv_heads = int(get("num_key_value_heads") or heads)
    head_dim = int(get("head_dim") or hidden // heads)
    if model_type == "qwen2":  # Qwen2: q/k/v always have a bias, o_proj and the MLP never do
        qkv_bias, o_bias, mlp_bias = True, False, False
    else:  # Llama, Gemma 3: attention_bias adds q/k/v/o biases, mlp_bias (Llama's; Gemma has none) gate/up/down's
        qkv_bias = o_bias = bool(get("attention_bias", False))
        mlp_bias = bool(get("mlp_bias", False))
    tied = get("tie_word_embeddings")
    gemma = model_type == "gemma3_text"  # its extra norms: q/k norms and the two feedforward norms
    return Arch(model_type=model_type, vocab=int(get("vocab_size")), hidden=hidden,
                layers=int(get("num_hidden_layers")), heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                intermediate=int(get("intermediate_size")), tied=bool(True if tied is None else tied),
                qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=mlp_bias, qk_norm=gemma, ffn_norms=gemma)


def padded_vocab(vocab: int, padding: int = VOCAB_PADDING) -> int:
    return -(-vocab // padding) * padding


def hf_param_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every HF parameter name (as `named_parameters(remove_duplicate=False)` lists them: lm_head.weight
    included even when tied) -> shape, in the module order of transformers' Llama/Qwen2/Gemma3."""
    a = arch(config)
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (a.vocab, a.hidden)}
    for i in range(a.layers):
        p = f"model.layers.{i}."
        for proj, rows in (("q_proj", a.q_size), ("k_proj", a.kv_size), ("v_proj", a.kv_size)):
            out[f"{p}self_attn.{proj}.weight"] = (rows, a.hidden)
            if a.qkv_bias:
                out[f"{p}self_attn.{proj}.bias"] = (rows,)
        out[f"{p}self_attn.o_proj.weight"] = (a.hidden, a.q_size)
        if a.o_bias:
            out[f"{p}self_attn.o_proj.bias"] = (a.hidden,)
        if a.qk_norm:
            out[f"{p}self_attn.q_norm.weight"] = (a.head_dim,)
            out[f"{p}self_attn.k_norm.weight"] = (a.head_dim,)
        for proj in ("gate_proj", "up_proj"):
            out[f"{p}mlp.{proj}.weight"] = (a.intermediate, a.hidden)
            if a.mlp_bias:
                out[f"{p}mlp.{proj}.bias"] = (a.intermediate,)
        out[f"{p}mlp.down_proj.weight"] = (a.hidden, a.intermediate)
        if a.mlp_bias:
            out[f"{p}mlp.down_proj.bias"] = (a.hidden,)
        out[f"{p}input_layernorm.weight"] = (a.hidden,)
        out[f"{p}post_attention_layernorm.weight"] = (a.hidden,)
        if a.ffn_norms:
            out[f"{p}pre_feedforward_layernorm.weight"] = (a.hidden,)
            out[f"{p}post_feedforward_layernorm.weight"] = (a.hidden,)
    out["model.norm.weight"] = (a.hidden,)
    out["lm_head.weight"] = (a.vocab, a.hidden)
    return out


def hf_to_vllm_name(name: str, tied: bool = False) -> tuple[str, str | int | None]:
    """(vLLM parameter name, shard id) of an HF parameter name.

    The shard id is what vLLM's weight loaders call it: "q"/"k"/"v" for the parts of `qkv_proj`, 0/1 for
    gate/up in `gate_up_proj`, None for an unfused tensor. With `tied`, lm_head.weight is the embedding.
    """
    if name == "lm_head.weight" and tied:
        return "model.embed_tokens.weight", None
    m = _LAYER.match(name)
    if m and m.group(3) in _FUSED:
        fused, shard = _FUSED[m.group(3)]
        return f"model.layers.{m.group(1)}.{m.group(2)}.{fused}.{m.group(4)}", shard
    return name, None


def vllm_slices(config) -> dict[str, tuple[str, int, int, int]]:
    """{HF name: (vLLM name, dim, start, stop)}: the HF tensor equals `vllm[vllm_name].narrow(dim, start,
    stop - start)`. dim is always 0 (tensor parallel size 1); lm_head.weight is included (mapped onto the
    embedding when tied)."""
    a = arch(config)
    offsets = {"q": (0, a.q_size), "k": (a.q_size, a.q_size + a.kv_size),
               "v": (a.q_size + a.kv_size, a.q_size + 2 * a.kv_size),
               0: (0, a.intermediate), 1: (a.intermediate, 2 * a.intermediate)}
    out = {}
    for name, shape in hf_param_shapes(config).items():
        vname, shard = hf_to_vllm_name(name, tied=a.tied)
        start, stop = offsets[shard] if shard is not None else (0, shape[0])
        out[name] = (vname, 0, start, stop)
    return out


def vllm_shapes(config, vocab_padding: int = VOCAB_PADDING) -> dict[str, tuple[int, ...]]:
    """{vLLM name: shape} of the fused model (vocabulary rows padded to `vocab_padding`)."""
    a = arch(config)
    hf = hf_param_shapes(config)
    out: dict[str, tuple[int, ...]] = {}
    for name, (vname, _dim, _start, stop) in vllm_slices(config).items():
        rows = padded_vocab(a.vocab, vocab_padding) if vname in ("model.embed_tokens.weight", "lm_head.weight") \
            else stop
        prev = out.get(vname, (0,))[0]
        out[vname] = (max(prev, rows), *hf[name][1:])
    return out


def hf_unique_names(config) -> list[str]:
    """HF parameter names without the tied duplicate (what ES trains and checksums), in module order."""
    tied = arch(config).tied
    return [n for n in hf_param_shapes(config) if not (tied and n == "lm_head.weight")]


def fuse(hf_state_dict: dict[str, torch.Tensor], config,
         vocab_padding: int = VOCAB_PADDING) -> dict[str, torch.Tensor]:
    """The vLLM state dict (fused q/k/v and gate/up, padded vocabulary rows zero) of an HF state dict.

    With tied embeddings lm_head.weight may be present or not; it is not read (the embedding is used).
    Dtypes are kept; all inputs must share one dtype.
    """
    shapes = vllm_shapes(config, vocab_padding)
    slices = vllm_slices(config)
    names = hf_unique_names(config)
    missing = [n for n in names if n not in hf_state_dict]
    extra = [n for n in hf_state_dict if n not in slices]
    if missing or extra:
        raise DeltalensError(f"state dict does not match the {arch(config).model_type} config: missing "
                             f"{missing[:3]}, unexpected {extra[:3]}")
    dtypes = {hf_state_dict[n].dtype for n in names}
    if len(dtypes) != 1:
        raise DeltalensError(f"fuse needs one dtype for all tensors, got {sorted(map(str, dtypes))}")
    dtype = dtypes.pop()
    out = {v: torch.zeros(s, dtype=dtype) for v, s in shapes.items()}
    for n in names:
        vname, dim, start, stop = slices[n]
        t = hf_state_dict[n]
        target = out[vname].narrow(dim, start, stop - start)
        if tuple(t.shape) != tuple(target.shape):
            raise DeltalensError(f"{n}: shape {tuple(t.shape)} does not fit {vname}[{start}:{stop}] "
                                 f"{tuple(target.shape)}")
        target.copy_(t)
    return out


def unfuse(vllm_state_dict: dict[str, torch.Tensor], config, include_tied: bool = True) -> dict[str, torch.Tensor]:
    """The HF state dict (contiguous copies, HF module order) of a fused vLLM state dict; inverse of `fuse`.
    With tied embeddings lm_head.weight is included (a copy of the embedding) unless include_tied=False."""
    slices = vllm_slices(config)
    shapes = hf_param_shapes(config)
    keep = set(hf_unique_names(config)) | ({"lm_head.weight"} if include_tied else set())
    out = {}
    for n in shapes:
        if n not in keep:
            continue
        vname, dim, start, stop = slices[n]
        if vname not in vllm_state_dict:
            raise DeltalensError(f"vLLM state dict has no {vname} (needed for {n})")
        out[n] = vllm_state_dict[vname].narrow(dim, start, stop - start).contiguous().clone()
        if tuple(out[n].shape) != shapes[n]:
            raise DeltalensError(f"{vname}[{start}:{stop}] has shape {tuple(out[n].shape)}, {n} needs {shapes[n]}")
    return out


def flat_range(name: str, config, vllm_shape: tuple[int, ...]) -> tuple[str, int, int]:
    """(vLLM name, first flat element, element count) of HF tensor `name` inside the flattened vLLM tensor
    of shape `vllm_shape` (a dim-0 slice of a contiguous tensor is one contiguous range)."""
    vname, dim, start, stop = vllm_slices(config)[name]
    assert dim == 0
    row = 1
    for s in vllm_shape[1:]:
        row *= s
    if stop > vllm_shape[0]:
        raise DeltalensError(f"{name} needs rows [{start}, {stop}) of {vname}, which has {vllm_shape[0]} rows "
                             "(tensor parallelism? ES with vLLM needs tensor_parallel_size=1)")
    return vname, start * row, (stop - start) * row
