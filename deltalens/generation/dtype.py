"""Compute dtype of generation, apart from the master dtype of the weights.

The master weights stay as they are loaded (fp32 by default) and every update is made to them; only
generation may run on a lower-precision copy of them (`HFBackend`, `compute_copy`). Names:

- `fp32`: generate on the master weights themselves (what deltalens always did).
- `bf16`: generate on a bf16 copy of fp32 master weights, cast from the masters at the start of every
  `generate` call (so a copy never lags behind an update; for the evaluation of a fixed model that is
  one cast). Parameters only: buffers (e.g. rotary frequencies) stay in their own dtype, and transformers
  takes the next-token logits in fp32 before sampling, so the softmax and sampling are fp32 as before.
  RMSNorm layers keep their weights in the master dtype (`norm_modules`: class names ending in RMSNorm);
  their output is cast to the input's dtype (bf16), so the matmuls all run in bf16. LayerNorm is cast like
  the rest: CUDA's layer_norm wants weight and bias in the input's dtype, and none of our models has one.
  Linear layers' biases stay in the master dtype too (`biased_linears`; Qwen2.5's q/k/v projections, whose
  q biases have median |b| ~1.5): x·Wᵀ in bf16, then the fp32 bias added and the sum rounded once.
  Why: a norm weight of ~1-2 (SmolLM2's final norm, median 1.78; Qwen2.5's, ~2; Gemma's 1 + w) has a
  bf16 step of ~0.008-0.016, so an ES perturbation σ = 1.5e-3 .. 3e-3 of it rounds away, the same way for
  every token: the member would not see what it is scored for. Kept in fp32 and multiplied into the
  bf16-rounded normalised activation, the product is rounded once per element and the perturbation
  survives in expectation (a dither). 1-D tensors, ~0.02% of SmolLM2's parameters. The departures from a
  pure-bf16 forward: a norm's product is rounded once instead of twice; a biased linear rounds x·Wᵀ to bf16
  before the fp32 bias is added (a fused bf16 linear adds the bf16 bias before its one rounding).
- `auto`: bf16 where bf16 matmuls are fast: a CPU with bf16 matrix instructions (`amx_bf16` or
  `avx512_bf16` among the flags of /proc/cpuinfo, `BF16_CPU_FLAGS`) or a CUDA device with bf16
  (`torch.cuda.is_bf16_supported()`), for a model of hidden size >= 512 (`MIN_BF16_HIDDEN`); fp32
  elsewhere: on a CPU with neither (AVX2 only: bf16 runs a software path there, ~10x slower than fp32),
  and for narrower models, whose small matmuls gain nothing (measured on `tiny`, hidden 128: 0.8-1.1x).
  The width rule is ours, not the issue's; it keeps `tiny` in fp32.

Weights loaded in bf16 or fp16 (`--dtype`) are already low precision: they generate as they are,
whatever the compute dtype says (no copy, no upcast).

Measured figures (speed-ups per CPU and model width, bf16/fp32 agreement): benchmarks/README.md,
"bench_generation.py".
"""

from __future__ import annotations

import copy
import types
from functools import lru_cache

import torch
import torch.nn.functional as F

from deltalens.errors import DeltalensError
from deltalens.io.models import contiguous_head, dtype_name, load_config, torch_dtype
from deltalens.io.spec import ModelRef

COMPUTE_DTYPES = ("auto", "fp32", "bf16")
BF16_CPU_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})  # AMX tiles, or AVX-512 bf16 dot products
MIN_BF16_HIDDEN = 512  # auto: narrower models stay fp32 (tiny, 128: no gain; SmolLM2 width, 576: 1.4-1.9x)


@lru_cache(maxsize=4)
def _cpuinfo(field: str) -> str:
    """The first `field` line's value in /proc/cpuinfo ("" where there is none, e.g. macOS)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(field):
                    return line.partition(":")[2]
    except OSError:
        pass
    return ""


def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where there is none, e.g. macOS)."""
    return frozenset(_cpuinfo("flags").split())


def cpu_model() -> str:
    """The CPU's model name of /proc/cpuinfo ("" where there is none)."""
    return " ".join(_cpuinfo("model name").split())


def machine(device: torch.device | str = "cpu") -> str:
    """What a timing was measured on, in one line: the GPU's name, or the CPU's model name, its bf16 matrix
    instructions (AMX-BF16 / AVX512-BF16, or none: the ones `auto` reads) and torch's thread count. Timings
    from different machines are not comparable: bf16 generation on an AMX Xeon and on an AVX512-BF16 EPYC
    differ severalfold (docs/reproduction.md, "Claim 7 on SmolLM2")."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return f"cuda: {torch.cuda.get_device_name(device)}"
    bf16 = [f for f in ("amx_bf16", "avx512_bf16") if f in cpu_flags()]
    return f"cpu: {cpu_model() or 'unknown'}, bf16: {'+'.join(bf16) or 'none'}, {torch.get_num_threads()} threads"


def bf16_is_fast(device: torch.device | str = "cpu") -> bool:
    """Whether bf16 matmuls are faster than fp32 ones on `device`: AMX-BF16 or AVX512-BF16 on CPU (an
    AVX512-BF16 EPYC without AMX: 2.2x fp32's matmul peak, SmolLM2-135M generation 1.8x; docs in
    benchmarks/README.md), bf16 support on CUDA."""
    device = torch.device(device)
    if device.type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if device.type == "cpu":
        return bool(BF16_CPU_FLAGS & cpu_flags())
    return False


def check_compute_dtype(name: str) -> str:
    """`name` if it is a compute dtype, else a one-line DeltalensError."""
    if name not in COMPUTE_DTYPES:
        raise DeltalensError(f"unknown compute dtype {name!r}; choose one of {', '.join(COMPUTE_DTYPES)}")
    return name


def resolve_compute_dtype(name: str, device: torch.device | str = "cpu", master: torch.dtype = torch.float32,
                          hidden_size: int | None = None) -> torch.dtype:
    """The torch dtype generation runs in for weights of dtype `master` on `device`, for a model of
    `hidden_size` (None: unknown, no width rule) (see module doc)."""
    check_compute_dtype(name)
    if master != torch.float32:
        return master
    if name == "auto":
        wide = hidden_size is None or hidden_size >= MIN_BF16_HIDDEN
        name = "bf16" if wide and bf16_is_fast(device) else "fp32"
    return torch.bfloat16 if name == "bf16" else torch.float32


def model_compute_dtype(name: str, model: torch.nn.Module, device: torch.device | str | None = None) -> torch.dtype:
    """`resolve_compute_dtype` for a loaded `model`: its weights' dtype and hidden size (config.hidden_size),
    on `device` (default: where its weights are; CPU for a model without parameters)."""
    param = next(model.parameters(), None)
    where = device if device is not None else ("cpu" if param is None else param.device)
    return resolve_compute_dtype(name, where, torch.float32 if param is None else param.dtype,
                                 getattr(getattr(model, "config", None), "hidden_size", None))


def planned_compute_dtype(spec: str | ModelRef, compute_dtype: str = "fp32", *, dtype: str = "fp32", device: str | None = "cpu",
                          config: str | None = None) -> str:
    """The name of the dtype generation of the model `spec` will run in (fp32, bf16, fp16), said before the
    model loads: weights loaded in `dtype` other than fp32 generate as they are; `auto` on a device where bf16
    is fast reads the model's config (not its weights: `load_config`) for the width rule, and takes no width
    rule when that config cannot be read. Cost estimates and cache keys use it; generation itself resolves
    the same rule on the loaded model (`resolve_compute_dtype`)."""
    check_compute_dtype(compute_dtype)
    master = torch_dtype(dtype)
    dev = "cpu" if device in (None, "auto", "-") else device
    wide = master == torch.float32 and compute_dtype == "auto" and bf16_is_fast(dev)
    return dtype_name(resolve_compute_dtype(compute_dtype, dev, master, _hidden_size(spec, config) if wide else None))


@lru_cache(maxsize=32)
def _hidden_size(spec: str | ModelRef, config: str | None) -> int | None:
    """hidden_size of a spec's config, read once per process (a GGUF's header: ~10 s for Qwen2.5's vocabulary;
    a study's and a report's plan lines ask for the same base several times); None when it cannot be read."""
    try:
        return getattr(load_config(spec, config=config), "hidden_size", None)
    except DeltalensError:
        return None


NORM_CLASS_SUFFIXES = ("RMSNorm",)  # LlamaRMSNorm, Qwen2RMSNorm, Gemma3RMSNorm, ...; not LayerNorm (module doc)


def norm_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of the RMSNorm layers, whose parameters a compute copy keeps in the master dtype."""
    return [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith(NORM_CLASS_SUFFIXES)]


def biased_linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    """(name, module) of the nn.Linear layers with a bias, whose bias a compute copy keeps in the master dtype."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m.bias is not None]


def _kept(model: torch.nn.Module) -> set[int]:
    """ids of the parameters a compute copy keeps in the master dtype (module doc): the RMSNorm layers'
    weights and the Linear layers' biases."""
    return ({id(p) for _, m in norm_modules(model) for p in m.parameters(recurse=False)}
            | {id(m.bias) for _, m in biased_linears(model)})


def master_dtype_params(model: torch.nn.Module) -> set[str]:
    """Names (as `model.named_parameters()` gives them) of the parameters a compute copy keeps in the master
    dtype: the RMSNorm layers' weights and the Linear layers' biases."""
    kept = _kept(model)
    return {n for n, p in model.named_parameters() if id(p) in kept}


def _linear_with_master_bias(self, x: torch.Tensor) -> torch.Tensor:
    """The forward of a compute copy's nn.Linear whose bias stays fp32: x·Wᵀ in the compute dtype, then the
    bias added in fp32 and rounded once (an in-place bf16 += fp32 adds in fp32)."""
    return F.linear(x, self.weight).add_(self.bias)


def _output_in_input_dtype(module, args, kwargs, out):
    """Forward hook of a compute copy's norm layer: its fp32 weight promotes the output to fp32; the next
    layer takes the input's dtype (bf16), so cast once here."""
    x = args[0] if args else next(iter(kwargs.values()), None)
    if isinstance(out, torch.Tensor) and isinstance(x, torch.Tensor) and out.dtype != x.dtype:
        return out.to(x.dtype)
    return out


def compute_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of `model` whose parameters are `dtype`, except the RMSNorm weights and Linear biases (kept in
    the master dtype, `master_dtype_params`; see module doc); buffers and tied parameters are kept as they
    are in `model`; `sync_copy` refreshes it from the masters. The fp32 parameters are never copied whole.
    A `forward` set on a module instance of the master is not carried over: TRL's GRPO trainer replaces the
    policy's forward with a wrapper that closes over the master's own bound forward, so a deep copy of it
    ran the master (fp32 weights, its attention setting) instead of the copy; the copy is for generation
    and takes its classes' forward."""
    kept = _kept(model)
    memo = {id(p): torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype if id(p) in kept else dtype,
                                                  device=p.device), requires_grad=False)
            for p in model.parameters()}
    out = copy.deepcopy(model, memo)
    for m in out.modules():  # the copy generates with its classes' own forward (see the docstring)
        m.__dict__.pop("forward", None)
    sync_copy(model, out)
    if dtype != torch.float32:
        _compute_hooks(out)
    return out.eval()


@torch.no_grad()
def cast_in_place(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Make `model` its own compute copy: the parameters `compute_copy` would cast are cast in place (the
    fp32 storage is freed), the RMSNorm weights and Linear biases kept, with the copy's hooks: the same bits
    `compute_copy` gives, for a caller that needs no fp32 weights while it generates (`eval`, the probe's
    passes: SmolLM2's weights then hold 269 MB instead of 538 + 269)."""
    kept = _kept(model)
    for p in model.parameters():
        if id(p) not in kept:
            p.data = p.data.to(dtype)
    if dtype != torch.float32:
        _compute_hooks(model)
    return model


def _compute_hooks(model: torch.nn.Module) -> None:
    """The hooks of a low-precision compute model: norm outputs in their input's dtype, Linear biases added
    in fp32, a contiguous head input."""
    for _, mod in norm_modules(model):
        if not getattr(mod, "_deltalens_output_cast", False):
            mod.register_forward_hook(_output_in_input_dtype, with_kwargs=True)
            mod._deltalens_output_cast = True
    for _, mod in biased_linears(model):
        mod.forward = types.MethodType(_linear_with_master_bias, mod)  # an instance forward, as population's
    contiguous_head(model)  # the head's strided last-position input: 180x slower in bf16 otherwise


@torch.no_grad()
def sync_copy(master: torch.nn.Module, compute: torch.nn.Module) -> None:
    """Cast the master parameters into the compute copy's (same names, same order)."""
    for p, q in zip(master.parameters(), compute.parameters(), strict=True):
        q.copy_(p)
