"""Cost up front: what an evaluation will do, and how long it should take here, said before it starts.

`plan_line` is the one line every evaluating command prints (stderr) before its first generation:

    eval: 2 models x 100 problems x 32 samples = 6,400 generations (<= 64 new tokens each); ~2.1 min at
    51 seq/s measured here on tiny/hf

The rate comes from earlier evaluations on this machine: `evaluate` calls `record_rate` after every
generation pass, which keeps one measured rate (sequences per second) per key in
`<cache dir>/rates.json` (DELTALENS_CACHE_DIR, else ~/.cache/deltalens; `deltalens.io.cache`). Without a
measurement the line says so, and the progress line gives the ETA once work starts.

A key is the model's identity, the backend (and device for HF), the dtype generation runs in (HF: the
compute dtype, e.g. bf16 for fp32 weights under `--compute-dtype auto` on a bf16-fast CPU; vLLM: its dtype;
`generation_dtype`), and the generation budget
rounded up to a power of two (the cost of a sequence grows with the tokens it may generate). The model's
identity must survive a rename or a copy, and be computable from a spec without loading the model: a
named GGUF (`smollm2`) keeps its name; anything with a config.json (tiny, an HF or run directory, bare
weights with their config) is the hash of the config fields that set the cost of a forward pass
(`arch-...`), which a loaded model's config gives too; other specs (a .gguf path, a hub id) are their
spec string.

A rate from a small run (a test, a probe of a few problems) says little about a big one (batching), so it
replaces a stored rate only when it has at least a quarter of its sequences. Recording never breaks an
evaluation: an unreadable, unwritable or read-only cache is ignored. Two processes recording at once
each write a complete file (atomic rename); the last one wins.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from pathlib import Path

from deltalens.io.cache import cache_dir
from deltalens.timefmt import duration

RATES_FILE = "rates.json"
# the config fields that set what one forward pass costs
_ARCH_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "vocab_size")
_NAMED = ("smollm2",)  # named specs without a config.json beside them (a GGUF)
_MIN_SECONDS = 0.2  # shorter passes measure start-up overhead, not throughput


def rates_path() -> Path:
    return cache_dir() / RATES_FILE


def _fingerprint(cfg: dict) -> str:
    text = json.dumps({k: cfg.get(k) for k in _ARCH_KEYS}, sort_keys=True)
    return "arch-" + hashlib.blake2b(text.encode(), digest_size=6).hexdigest()


def model_identity(model, config: str | None = None) -> str | None:
    """The stable identity of a model (module docstring): `model` is a spec (str or path) or a loaded model;
    `config` the architecture of bare weights. None when nothing identifies it."""
    if not isinstance(model, (str, os.PathLike)):
        cfg = getattr(model, "config", None)
        return _fingerprint(cfg.to_dict()) if cfg is not None and hasattr(cfg, "to_dict") else None
    spec = str(model)
    if spec in _NAMED:
        return spec
    from deltalens.errors import DeltalensError
    from deltalens.io.spec import resolve

    try:
        ref = resolve(spec)
    except DeltalensError:
        return spec
    if ref.kind == "hub":
        return ref.spec
    loc = Path(ref.location)
    if ref.kind == "weights" and config is not None:
        return model_identity(config)
    cfg_file = loc / "config.json" if loc.is_dir() else loc.parent / "config.json"
    if ref.kind == "gguf" or not cfg_file.is_file():
        return str(loc)
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return str(loc)
    return _fingerprint(cfg) if isinstance(cfg, dict) else str(loc)


def _bucket(max_new_tokens: int) -> int:
    b = 16
    while b < max_new_tokens:
        b *= 2
    return b


def _device(backend: str, device: str | None) -> str:
    if backend != "hf":
        return "-"  # vLLM places itself
    if device in (None, "auto"):
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if str(device).startswith("cuda") else str(device)


def rate_key(identity: str, *, backend: str, max_new_tokens: int, dtype: str = "fp32",
             device: str | None = None) -> str:
    return f"{identity}|{backend}|{_device(backend, device)}|{dtype}|<={_bucket(max_new_tokens)}"


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def measured_rate(*, model, backend: str = "hf", max_new_tokens: int, dtype: str = "fp32",
                  device: str | None = None, config: str | None = None) -> float | None:
    """Sequences per second measured on this machine for this key, or None."""
    try:
        ident = model_identity(model, config)
        if ident is None:
            return None
        entry = _read(rates_path()).get(rate_key(ident, backend=backend, max_new_tokens=max_new_tokens,
                                                 dtype=dtype, device=device))
        rate = entry.get("seq_per_s") if isinstance(entry, dict) else None
        return float(rate) if isinstance(rate, (int, float)) and rate > 0 else None
    except Exception:  # noqa: BLE001 - a cost estimate must never stop the work it estimates
        return None


def record_rate(*, model, backend: str, max_new_tokens: int, sequences: int, seconds: float,
                dtype: str = "fp32", device: str | None = "cpu", config: str | None = None) -> None:
    """Remember `sequences` generated in `seconds` for this key (module docstring); never raises."""
    if seconds < _MIN_SECONDS or sequences < 1:
        return
    try:
        ident = model_identity(model, config)
        if ident is None:
            return
        path = rates_path()
        rates = _read(path)
        key = rate_key(ident, backend=backend, max_new_tokens=max_new_tokens, dtype=dtype, device=device)
        old = rates.get(key)
        if isinstance(old, dict) and isinstance(old.get("sequences"), int) and sequences * 4 < old["sequences"]:
            return
        rates[key] = {"seq_per_s": round(sequences / seconds, 3), "sequences": sequences,
                      "seconds": round(seconds, 3), "when": time.strftime("%Y-%m-%dT%H:%M:%S")}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(rates, indent=1, sort_keys=True) + "\n", encoding="utf-8")
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
    except Exception:  # noqa: BLE001 - read-only home, full disk, a file in the way: the evaluation goes on
        return


def _label(model) -> str:
    from deltalens.io.spec import default_label

    return default_label(str(model))  # tiny, smollm2, a directory's or file's name


def _n(count: int, noun: str) -> str:
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def generation_dtype(*, model, backend: str = "hf", dtype: str = "fp32", compute_dtype: str = "fp32",
                     device: str | None = None, config: str | None = None) -> str:
    """The dtype a rate is keyed by: what generation runs in. HF: the compute dtype `compute_dtype` resolves
    to for weights loaded in `dtype` (`deltalens.generation.dtype.planned_compute_dtype`); vLLM: its `dtype`."""
    if backend != "hf":
        return dtype
    from deltalens.generation.dtype import planned_compute_dtype

    try:
        return planned_compute_dtype(model, compute_dtype, dtype=dtype, device=_device(backend, device),
                                     config=config)
    except Exception:  # noqa: BLE001 - a cost estimate must never stop the work it estimates
        return dtype


def plan_line(*, what: str, models: int, problems: int, samples: int, max_new_tokens: int, model: str,
              backend: str = "hf", points: int = 1, dtype: str = "fp32", device: str | None = None,
              config: str | None = None, compute_dtype: str = "fp32") -> str:
    """One line: what `what` will generate (models x points x problems x samples) and, from a rate measured
    here for `model` (the first or base model) on `backend` in the dtype generation will run in
    (`generation_dtype`: weights in `dtype`, HF generating in `compute_dtype`), about how long it will take."""
    generations = models * points * problems * samples
    text = f"{what}: {_n(models, 'model')}"
    if points != 1:
        text += f" x {_n(points, 'point')}"
    text += (f" x {_n(problems, 'problem')} x {_n(samples, 'sample')} = {_n(generations, 'generation')} "
             f"(<= {max_new_tokens} new tokens each)")
    dev = _device(backend, device)
    where = f"{_label(model)}/{backend}" + ("" if dev in ("cpu", "-") else f"/{dev}")
    gen = generation_dtype(model=model, backend=backend, dtype=dtype, compute_dtype=compute_dtype, device=device,
                           config=config)
    where += "" if gen == "fp32" else f" in {gen}"
    rate = measured_rate(model=model, backend=backend, max_new_tokens=max_new_tokens, dtype=gen, device=device,
                         config=config)
    if rate is None:
        return text + f"; no rate measured yet on this machine for {where}: the progress line gives an ETA"
    return text + f"; ~{duration(generations / rate)} at {rate:.3g} seq/s measured here on {where}"
