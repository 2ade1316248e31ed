"""Load (model, tokenizer) from any model spec (`deltalens.io.spec`), in eval mode on a device.

The tokenizer always comes from the same place as the architecture; bare weight files are applied onto
an architecture given by `config=` (any spec), else the config.json beside the file. Weight files are
read through `deltalens.io.tensors` (`.pt` always with weights_only=True).

Every model handed out holds exactly the tensors of its architecture, all read from its checkpoint: a
checkpoint that lacks a tensor (truncated, hand-edited, another model's) would otherwise run on the
randomly initialized values transformers fills in (its only sign a "newly initialized" report), and
one with extra tensors would silently ignore them. Both are refused at load, before any command does
work, naming the tensors: for bare files by comparing names with the architecture's state dict
(`apply_state_dict`), for everything from_pretrained loads (HF and run directories, hub ids, GGUF) from
its loading report (`output_loading_info`). Both leave out what is legitimately absent from a
checkpoint: a tied lm_head.weight and non-persistent buffers (rotary inv_freq), which are not in the
state dict to begin with.

Every model handed out (and every state dict applied onto one) has finite weights: a NaN or Inf weight
makes generation fail or sample garbage deep inside sampling, so it is refused here with the names of
the offending tensors. `weights_checksum` identifies a model's exact weights (ES and GRPO store it with
each checkpoint and verify it on resume).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Iterable
from pathlib import Path

import torch

from deltalens.errors import DeltalensError
from deltalens.io.quiet import quiet_transformers
from deltalens.io.spec import ModelRef, resolve
from deltalens.io.tensors import load_state_dict

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """The short name (fp32, bf16, fp16) of a torch dtype, else torch's own."""
    return next((k for k, v in DTYPES.items() if v == dtype), str(dtype))


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise DeltalensError(f"unknown dtype {name!r}; use one of fp32, bf16, fp16") from None


def weights_checksum(model: torch.nn.Module) -> str:
    """blake2b of every unique parameter's bytes (in order): equal checksums = bit-identical weights."""
    h = hashlib.blake2b(digest_size=16)
    seen = set()
    for name, p in model.named_parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        h.update(name.encode())
        h.update(p.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy())
    return h.hexdigest()


def check_finite(tensors: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
    """Refuse weights holding NaN or Inf, naming the tensors (generation cannot sample from them)."""
    bad = []
    for name, t in tensors:
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            bad.append(f"{name} ({int(t.numel() - torch.isfinite(t).sum())} values)")
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise DeltalensError(f"{source} has non-finite weights (NaN/Inf) in {', '.join(bad[:3])}{more}: "
                             "it cannot generate; `deltalens diff` still compares it")


def _need_gguf(loc) -> None:
    """transformers reads a .gguf only with the `gguf` package; say so before it reports something else
    (its tokenizer path raised "no tokenizer could be loaded" for a missing package)."""
    try:
        import gguf  # noqa: F401
    except ImportError as e:
        raise DeltalensError(f"loading {loc} needs the gguf package: pip install 'deltalens[gguf]'") from e


def _pretrained(auto_cls, ref: ModelRef, **kw):
    """`auto_cls.from_pretrained` of a resolved spec: a directory or hub id as it is, a .gguf through
    `gguf_file=` (the gguf package checked first), transformers' noise about GGUF quieted."""
    kind, loc = ref.kind, ref.location
    if kind == "gguf":
        _need_gguf(loc)
        kw["gguf_file"] = loc.name
    if kind == "hub":  # offline: the local HF cache only, else one line (no retries): deltalens.io.hub
        from deltalens.io.hub import model_options

        kw.update(model_options(str(loc)))
    with quiet_transformers(gguf=kind == "gguf"):
        return auto_cls.from_pretrained(str(loc.parent if kind == "gguf" else loc), **kw)


def load_tokenizer(ref: ModelRef):
    from transformers import AutoTokenizer

    loc = ref.location
    try:
        tok = _pretrained(AutoTokenizer, ref)
    except DeltalensError:
        raise
    except Exception as e:  # transformers raises OSError/ValueError/... for a missing tokenizer
        raise DeltalensError(f"no tokenizer could be loaded from {loc} ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:160]}); put tokenizer files beside the model") from e
    tok.padding_side = "left"  # generation appends to the right, so pad on the left
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if ref.kind == "gguf":
        gguf_bos(tok, loc)
    return tok


GGUF_ADD_BOS = "tokenizer.ggml.add_bos_token"


def gguf_bos(tok, file) -> None:
    """Make `tok` start every plain (non-chat) prompt with BOS exactly when the GGUF says so
    (`tokenizer.ggml.add_bos_token`, as llama.cpp applies it), then check that it does.

    transformers' GGUF tokenizer conversion has not always read that flag: 5.19 (the version vLLM's CPU
    build pins) loads Gemma 3's tokenizer without BOS, 5.25 with it, from the same file. Gemma without
    its BOS is another model (measured: 0 of 24 validation answers right against 13 of 100 with BOS,
    docs/models.md), and vLLM takes deltalens's token ids, so the flag is set here, once, for every
    backend. Only BOS: the file's add_eos flag is for training sequences; a prompt never ends in EOS."""
    from deltalens.io.gguf import read_metadata

    want = read_metadata(file, [GGUF_ADD_BOS]).get(GGUF_ADD_BOS)
    if want is None or tok.bos_token_id is None:
        return  # the file does not say, or the vocabulary has no BOS: transformers' choice stands
    want = bool(want)
    if getattr(tok, "add_bos_token", None) != want:
        tok.add_bos_token = want
    ids = tok("1", add_special_tokens=True)["input_ids"]
    if (ids[:1] == [tok.bos_token_id]) != want:
        raise DeltalensError(f"{file}: the GGUF says {GGUF_ADD_BOS}={want}, but this transformers' tokenizer "
                             f"cannot be made to follow it (it encodes '1' as {ids[:3]})")


def _names(names) -> str:
    """Up to three tensor names of a mismatch, then how many more."""
    names = sorted(names)
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return ", ".join(names[:3]) + more


def _mismatch(missing, unexpected) -> str:
    """'missing A, B; unexpected C' (the parts that are non-empty)."""
    parts = [f"missing {_names(missing)}"] if missing else []
    return "; ".join(parts + ([f"unexpected {_names(unexpected)}"] if unexpected else []))


def _check_loading_info(model, info: dict, loc) -> None:
    """Refuse a from_pretrained load whose checkpoint lacks (randomly initialized), adds (ignored) or
    reshapes tensors. transformers already leaves tied weights and the keys a model declares ignorable
    out of these sets."""
    missing, unexpected = set(info.get("missing_keys") or ()), set(info.get("unexpected_keys") or ())
    if missing or unexpected:
        arch = type(model).__name__
        raise DeltalensError(f"{loc} does not match its architecture ({arch}): {_mismatch(missing, unexpected)}; "
                             "it would run with randomly initialized or ignored weights")
    for name, file_shape, model_shape in sorted(info.get("mismatched_keys") or ()):
        raise DeltalensError(f"{loc}: shape mismatch for {name}: file {tuple(file_shape)} vs model "
                             f"{tuple(model_shape)} (the weights are for another architecture)")


@contextlib.contextmanager
def _no_load_report():
    """transformers logs a multi-line "LOAD REPORT" table of missing/unexpected/mismatched tensors as a
    warning; `_check_loading_info` refuses those loads with one line of its own, so the table is muted."""
    # a filter, not a level: transformers runs (and logs) an unrelated tensor-parallel plan check whenever
    # this logger's own level is WARNING or above
    log = logging.getLogger("transformers.modeling_utils")

    def drop(record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in str(record.msg)

    log.addFilter(drop)
    try:
        yield
    finally:
        log.removeFilter(drop)


def _gguf_dequantized() -> dict:
    """`quantization_config=GgufConfig(dequantize=True)` where transformers has it (5.19 on): a GGUF is our base
    as plain dequantized tensors. transformers 5.25's new GGUF loader keeps the weights packed in their quantized
    blocks for the architectures it covers (lfm2, qwen3.5 so far; llama, qwen2 and gemma3 still go through the
    legacy loader, which dequantizes) once it finds a matmul kernel on the hub: ES, diff and sparsify would
    then see no ordinary weights. Asking for the dequantized model also skips that lookup and the warning a
    non-fp32 load printed ("the weights stay quantized regardless"), which was not true of our models."""
    import inspect

    try:
        from transformers import GgufConfig
    except ImportError:  # older transformers: always dequantized
        return {}
    if "dequantize" not in inspect.signature(GgufConfig.__init__).parameters:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _from_pretrained(ref: ModelRef, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    kind, loc = ref.kind, ref.location
    extra = _gguf_dequantized() if kind == "gguf" else {}
    try:
        # sizes that do not match are reported (and refused by _check_loading_info), not raised by
        # transformers with a pointer to the report muted here
        with _no_load_report():
            model, info = _pretrained(AutoModelForCausalLM, ref, dtype=dtype, output_loading_info=True,
                                      ignore_mismatched_sizes=True, **extra)
    except DeltalensError:
        raise
    except ImportError as e:
        raise DeltalensError(f"loading {loc} needs an optional package: {e}; "
                             "try `pip install 'deltalens[gguf]'`") from e
    except OSError as e:
        if kind == "hub":
            raise DeltalensError(f"could not load {loc!r} from the hub (offline, or no such repo?); "
                                 "download it and pass the local directory") from e
        raise DeltalensError(f"could not load a model from {loc}: {str(e).splitlines()[0][:200]}") from e
    except Exception as e:
        raise DeltalensError(f"could not load a model from {loc} ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:200]})") from e
    _check_loading_info(model, info, loc)
    return model


def _architecture(loc, config: str | None) -> str:
    """The spec naming the architecture of a bare weights file: --arch, else the directory beside it."""
    if config is not None:
        return config
    if not (Path(loc).parent / "config.json").exists():
        raise DeltalensError(f"{loc} holds weights only; pass --arch with the base model "
                             "(e.g. --arch tiny or an HF directory) to name its architecture")
    return str(Path(loc).parent)


def load_config(spec: str | ModelRef, *, config: str | None = None):
    """The transformers config of a model spec, without loading its weights (a GGUF's from its header)."""
    from transformers import AutoConfig

    ref = resolve(spec)
    kind, loc = ref.kind, ref.location
    if kind == "weights":
        return load_config(_architecture(loc, config))
    try:
        return _pretrained(AutoConfig, ref)
    except DeltalensError:
        raise
    except Exception as e:  # OSError offline, ValueError on a bad config, ...
        raise DeltalensError(f"could not read the config of {loc} ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:200] if str(e) else ''})") from e


def apply_state_dict(model, state_dict: dict[str, torch.Tensor], source: str = "weights") -> None:
    """Copy `state_dict` into `model` (strict on names and shapes, casting dtype); errors name the keys.
    Non-finite weights are refused (`check_finite`) before anything is copied."""
    own = model.state_dict()
    tied = {k for k in own if k == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False)}
    missing = sorted(set(own) - set(state_dict) - tied)
    unexpected = sorted(set(state_dict) - set(own))
    if missing or unexpected:
        raise DeltalensError(f"{source} does not match the architecture: {_mismatch(missing, unexpected)}; "
                             "pass the right --arch")
    for k, v in state_dict.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise DeltalensError(f"{source}: shape mismatch for {k}: file {tuple(v.shape)} vs "
                                 f"model {tuple(own[k].shape)}; pass the right --arch")
    check_finite(state_dict.items(), source)
    with torch.no_grad():
        for k, v in state_dict.items():
            own[k].copy_(v.to(own[k].dtype))


def resolve_device(device: str = "auto") -> str:
    """'auto' -> 'cuda' when a GPU is visible, else 'cpu'; 'cpu', 'cuda', 'cuda:N' are checked."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return device
    if device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit()):
        if not torch.cuda.is_available():
            raise DeltalensError(f"--device {device}: no CUDA GPU is visible to torch {torch.__version__}; "
                                 "use --device cpu (or install a CUDA build of torch)")
        return device
    raise DeltalensError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N")


def _contiguous_input(module, args):
    return (args[0].contiguous(),) + tuple(args[1:]) if args and not args[0].is_contiguous() else None


def contiguous_head(model: torch.nn.Module) -> torch.nn.Module:
    """Make the LM head's input contiguous before it multiplies (a forward pre-hook, registered once).

    transformers calls `lm_head(hidden[:, -1:, :])` (`logits_to_keep=1`), a strided view of the last
    position. torch 2.13's CPU linear takes a slow path for that view in bf16 under no_grad: on
    SmolLM2-135M's head (576 -> 49,152) at 16 rows x 30 prompt positions, 2,045 ms against 11 ms for the
    same values contiguous (one thread; benchmarks/bench_generation.py `bf16_strided_head`), and it
    materialises a [rows, 576, 49152] intermediate (3.6 GB at 64 rows). The hook copies rows x hidden
    values; the logits are bit-identical. Applied to low-precision models only (bf16/fp16 compute
    copies and weights loaded so), so fp32 results stay exactly as they were.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and not getattr(head, "_deltalens_contiguous", False):
        head.register_forward_pre_hook(_contiguous_input)
        head._deltalens_contiguous = True
    return model


def load_model(spec: str | ModelRef = "tiny", *, config: str | None = None, dtype: str = "fp32",
               device: str = "cpu"):
    """Load (model, tokenizer) from any supported spec; the model is in eval mode on `device`
    (cpu, cuda, cuda:N or auto)."""
    device = resolve_device(device)
    ref = resolve(spec)
    kind, loc = ref.kind, ref.location
    td = torch_dtype(dtype)
    if kind == "weights":
        model, tok = load_model(_architecture(loc, config), dtype=dtype, device="cpu")
        apply_state_dict(model, load_state_dict(loc), source=str(loc))
    else:
        if config is not None:
            raise DeltalensError(f"--arch is only for bare weight files (.pt/.safetensors), not {spec}")
        tok = load_tokenizer(ref)
        model = _from_pretrained(ref, td)
        if kind == "gguf":
            # transformers dequantises GGUF weights into plain tensors but keeps a "gguf quantizer" on
            # the model that refuses save_pretrained; the weights are ordinary now, so drop it.
            model.hf_quantizer = None
            model.is_quantized = False  # else Trainer (GRPO) refuses it as a "purely quantized" model
            if hasattr(model, "quantization_method"):
                model.quantization_method = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
        check_finite(model.named_parameters(), str(loc))
    model.to(device)
    model.eval()
    if td != torch.float32:
        contiguous_head(model)
    return model, tok
