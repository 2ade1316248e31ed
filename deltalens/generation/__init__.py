"""Generation backends: sample `n` completions per prompt, batched, seeded.

The interface (`GenerationBackend`) is one method, `generate(prompts, params) -> list[list[str]]`
(outer: prompts, inner: the `params.n` completions of that prompt, prompt text excluded). Backends:
`hf` (transformers' `generate`, `deltalens.generation.hf`) and `vllm` (a vLLM engine,
`deltalens.generation.vllm`, imported only when asked for). Prompt formatting (chat template) and the
batching loop are shared (`prompts`, `batching`). The HF backend's compute dtype (fp32, or a bf16 copy
of fp32 weights; `dtype`) is apart from the weights' dtype; vLLM computes in the dtype it loads.
"""

from __future__ import annotations

from deltalens.errors import DeltalensError
from deltalens.generation.dtype import COMPUTE_DTYPES, cast_in_place, check_compute_dtype
from deltalens.generation.hf import HFBackend
from deltalens.generation.params import GenerationBackend, SamplingParams

BACKENDS = ("hf", "vllm")


def make_generator(name: str, model, tokenizer, *, compute_dtype: str = "fp32", **kw) -> GenerationBackend:
    """A generation backend by name for an in-memory model (vLLM saves it to a temporary directory).
    compute_dtype: the HF backend's (`deltalens.generation.dtype`); vLLM ignores it."""
    check_compute_dtype(compute_dtype)
    if name == "vllm":
        from deltalens.generation.vllm import VLLMBackend  # imports vllm lazily; clear error without it

        return VLLMBackend.from_model(model, tokenizer, **kw)
    if name != "hf":
        raise DeltalensError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return HFBackend(model, tokenizer, compute_dtype=compute_dtype, **kw)


def backend_for_spec(name: str, spec: str, *, dtype: str = "fp32", config: str | None = None,
                     device: str = "auto", chat_template="auto", compute_dtype: str = "fp32",
                     in_place: bool = False):
    """(backend, model, tokenizer) for a model spec: vLLM loads its own weights (model None, no HF copy in
    memory); HF loads the model in `dtype` and generates in `compute_dtype` (`deltalens.generation.dtype`).
    in_place: the caller needs only generation, not the loaded weights: where the compute dtype differs
    from theirs the model is cast in place (`dtype.cast_in_place`, the bits of the compute copy) instead of
    keeping a copy beside it (SmolLM2 in bf16: 269 MB of weights instead of 538 + 269)."""
    check_compute_dtype(compute_dtype)
    if name == "vllm":
        from deltalens.generation.vllm import VLLMBackend  # imports vllm lazily; clear error without it

        be = VLLMBackend.from_spec(spec, dtype=dtype, config=config, chat_template=chat_template)
        return be, None, be.tok
    from deltalens.io.models import load_model

    model, tok = load_model(spec, config=config, dtype=dtype, device=device)
    gen = make_generator(name, model, tok, chat_template=chat_template, compute_dtype=compute_dtype)
    if in_place and isinstance(gen, HFBackend) and gen.dtype != next(model.parameters()).dtype:
        cast_in_place(model, gen.dtype)
    return gen, model, tok


__all__ = ["BACKENDS", "COMPUTE_DTYPES", "GenerationBackend", "HFBackend", "SamplingParams", "backend_for_spec", "make_generator"]
