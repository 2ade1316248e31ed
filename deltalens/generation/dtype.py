"""Compute dtype of generation, apart from the master dtype of the weights.

The master weights stay as they are loaded (fp32 by default) and every update is made to them; only
generation may run on a lower-precision copy of them (`HFBackend`, `compute_copy`). Names:

- `fp32`: generate on the master weights themselves (what deltalens always did).
- `bf16`: generate on a bf16 copy of fp32 master weights, cast from the masters at the start of every
  `generate` call (so a copy never lags behind an update; for the evaluation of a fixed model that is
  one cast). Parameters only: buffers (e.g. rotary frequencies) stay in their own dtype, and transformers
  takes the next-token logits in fp32 before sampling, so the softmax and sampling are fp32 as before.
- `auto`: bf16 where bf16 matmuls are fast: a CPU with AMX-BF16 (the `amx_bf16` flag of /proc/cpuinfo)
  or a CUDA device with bf16 (`torch.cuda.is_bf16_supported()`), for a model of hidden size >= 512
  (`MIN_BF16_HIDDEN`); fp32 elsewhere: on a CPU with only AVX-512-BF16 or none, where bf16 matmuls are
  not faster than fp32 ones, and for narrower models, whose small matmuls gain nothing (measured on
  `tiny`, hidden 128: 0.8-1.1x). This width rule is ours, not the issue's; it keeps `tiny` in fp32.

Weights loaded in bf16 or fp16 (`--dtype`) are already low precision: they generate as they are,
whatever the compute dtype says (no copy, no upcast).

Measured (benchmarks/bench_generation.py, benchmarks/README.md; one thread, a loaded 2-core AMX VM): bf16
decodes 1.99x (64 rows) and 1.60x (16 rows) faster than fp32 on a random Llama of SmolLM2-135M's width
(hidden 576, 6 layers), 1.51x on the real SmolLM2-135M (50 greedy rows); on `tiny` (hidden 128) 0.86-1.05x,
its matmuls too small for AMX. A bf16 copy beats `torch.autocast(cpu, bfloat16)` (1.75x / 1.44x), which
casts every weight again at every decoding step. Agreement: 3 of 100 greedy tiny completions differ from
fp32, 0 of 50 on SmolLM2; sampled Pass@1 on tiny (100 x 8) 0.280 vs 0.2825, within 2 paired SE.
"""

from __future__ import annotations

import copy
from functools import lru_cache

import torch

from deltalens.errors import DeltalensError

COMPUTE_DTYPES = ("auto", "fp32", "bf16")
MIN_BF16_HIDDEN = 512  # auto: narrower models stay fp32 (tiny, 128: no gain; SmolLM2 width, 576: 1.4-1.9x)


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where there is none, e.g. macOS)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def bf16_is_fast(device: torch.device | str = "cpu") -> bool:
    """Whether bf16 matmuls are faster than fp32 ones on `device`: AMX-BF16 on CPU, bf16 support on CUDA."""
    device = torch.device(device)
    if device.type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if device.type == "cpu":
        return "amx_bf16" in cpu_flags()
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


def compute_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of `model` whose parameters are `dtype` (buffers and tied parameters kept as they are in
    `model`); `sync_copy` refreshes it from the masters. The fp32 parameters are never copied whole."""
    memo = {id(p): torch.nn.Parameter(torch.empty(p.shape, dtype=dtype, device=p.device), requires_grad=False)
            for p in model.parameters()}
    out = copy.deepcopy(model, memo)
    sync_copy(model, out)
    return out.eval()


@torch.no_grad()
def sync_copy(master: torch.nn.Module, compute: torch.nn.Module) -> None:
    """Cast the master parameters into the compute copy's (same names, same order)."""
    for p, q in zip(master.parameters(), compute.parameters(), strict=True):
        q.copy_(p)
