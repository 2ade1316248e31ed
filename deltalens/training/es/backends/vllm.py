"""ES on vLLM's own (fused) weights: `VLLMESBackend`, a member backend like `LocalBackend`/`RayBackend`.

The driver keeps its HF `ESEngine` (for checkpoints and the noise plan) and one vLLM engine holds the
weights that are perturbed, scored and updated. Every weight operation runs inside vLLM's worker
process through the worker-extension API:

    LLM(model, worker_extension_cls="deltalens.training.es.backends.vllm.ESWorkerExtension", ...)
    llm.collective_rpc("es_perturb", args=(iteration, member))  ... generate ...  "es_restore"

The extension (`FusedES`) regenerates, for each trained HF parameter, exactly the noise the HF path
draws (the run's noise family, `deltalens.training.es.noise`: same seed, same CPU generator, same
4M-element blocks) and writes it into the slice of vLLM's fused tensor that holds that parameter
(`deltalens.generation.vllm_layout`: q/k/v inside qkv_proj, gate/up inside gate_up_proj, the embedding
inside its padded vocabulary, tied lm_head = embedding). Arithmetic is `ESEngine`'s, by the same code
(`noise.ReplicaES` around a `noise.Perturber` over blocks that are views into the fused tensors):
perturbation θ + s·ε in fp32 rounded once to the weight dtype; the update accumulated on the CPU in fp32
and added once. Restore copies back a base copy of the trained slices (kept on the GPU). vLLM computes
in the dtype it loads (`--dtype`): `--compute-dtype bf16` is refused with this backend (`ESConfig`).

That is the GPU way: there vLLM's linear layers multiply by their parameter tensors, so writing into them
changes the model. vLLM's CPU build repacks every linear weight after loading and computes with the packed
copies; there `FusedES` works on a fused copy of the checkpoint and every perturb/restore/update is pushed
into vLLM with vLLM's own weight reload (`deltalens.generation.vllm_weights`, which holds the
one platform decision). The ES arithmetic is the same code on both.

Noise is drawn on the CPU (torch's mt19937 generator: the HF path's numbers; a GPU generator would give
other numbers) by a thread pool, one block per thread at a time, and copied to the GPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import tempfile
import time
from collections.abc import Sequence

import torch
from safetensors.torch import load_file

from deltalens.errors import DeltalensError
from deltalens.generation import vllm_weights
from deltalens.generation.vllm import VLLMBackend
from deltalens.generation.vllm_layout import arch
from deltalens.io.models import apply_state_dict
from deltalens.training.es.engine import PARALLEL_MIN, new_timing
from deltalens.training.es.noise import Perturber, ReplicaES, make_family, noise_pool
from deltalens.training.es.strategy import iteration_problems

EXTENSION = "deltalens.training.es.backends.vllm.ESWorkerExtension"


# ----------------------------------------------------------------------------------------------
# ES noise on fused weights (device-agnostic: CPU in tests, the GPU inside vLLM's worker)


def layout_config(config) -> dict:
    """The config keys the layout needs (small and plain, to travel through collective_rpc)."""
    keys = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "intermediate_size", "tie_word_embeddings", "attention_bias",
            "mlp_bias")
    get = config.get if isinstance(config, dict) else (lambda k: getattr(config, k, None))
    return {k: get(k) for k in keys}


def es_plan(engine, threads: int = 0) -> dict:
    """Everything a weight replica in another layout needs to apply the driver engine's noise: the ES
    hyperparameters, the layout config, each trained HF tensor with its global block ids, and every
    unique HF parameter in checksum order (see `deltalens.training.es.engine.weights_checksum`)."""
    cfg, model = engine.config, engine.model
    trained = []
    for j, (_index, name, p) in enumerate(engine.params):
        trained.append([name, list(p.shape), [b for jj, _, b in engine.blocks if jj == j]])
    every, seen = [], set()
    for name, p in model.named_parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        every.append([name, list(p.shape)])
    return {"version": 1, "hf_config": layout_config(model.config), "seed": cfg.seed, "n_noise": engine.n_noise,
            "n_blocks": engine.n_blocks, "chunk": engine.chunk, "sigma": cfg.sigma, "alpha": cfg.alpha,
            "noise": cfg.noise, "noise_options": engine.family.options(cfg),
            "population": cfg.population, "antithetic": cfg.antithetic, "restore": cfg.restore,
            "dtype": str(engine.params[0][2].dtype), "trained": trained, "all": every, "threads": threads}


class FusedES:
    """ES perturb/restore/update on a model held in vLLM's fused layout, equal to `ESEngine` on the HF
    layout: same noise values on the same HF-named parameter, same arithmetic.

    `params`: vLLM parameter name -> live tensor (the worker's `model.named_parameters()`, or a fused
    state dict on the CPU in tests). `plan`: `es_plan(engine)` of the driver's engine.
    """

    def __init__(self, params: dict[str, torch.Tensor], plan: dict, threads: int | None = None):
        from deltalens.generation.vllm_layout import vllm_slices

        self.plan = plan
        self.seed, self.n_noise, self.n_blocks = plan["seed"], plan["n_noise"], plan["n_blocks"]
        self.chunk = plan["chunk"]
        slices = vllm_slices(plan["hf_config"])
        self.views: dict[str, torch.Tensor] = {}  # HF name -> its elements inside the vLLM tensor (flat view)
        self.shapes: dict[str, tuple[int, ...]] = {}
        for name, shape in plan["all"]:
            if name not in slices:
                raise DeltalensError(f"HF parameter {name} has no place in the vLLM layout")
            vname, dim, start, stop = slices[name]
            if vname not in params:
                raise DeltalensError(f"vLLM model has no parameter {vname} (holds HF {name}); its parameters "
                                     f"look like {list(params)[:4]}: is this vLLM version's layout supported?")
            t = params[vname]
            if str(t.dtype) != plan["dtype"]:
                raise DeltalensError(f"vLLM holds {vname} in {t.dtype}, the driver in {plan['dtype']}; "
                                     "load both with the same --dtype")
            if not t.is_contiguous() or dim != 0 or tuple(t.shape[1:]) != tuple(shape[1:]) \
                    or stop > t.shape[0] or stop - start != shape[0]:
                raise DeltalensError(
                    f"{name} {tuple(shape)} does not fit rows [{start}, {stop}) of vLLM's {vname} "
                    f"{tuple(t.shape)} (ES with vLLM needs tensor_parallel_size=1 and an unquantized model)")
            row = math.prod(shape[1:])
            self.views[name] = t.detach().view(-1)[start * row: stop * row]
            self.shapes[name] = tuple(shape)
        # blocks: (HF name, flat view of the block inside the vLLM tensor, global block id)
        self.blocks: list[tuple[str, torch.Tensor, int]] = []
        for name, _shape, block_ids in plan["trained"]:
            flat = self.views[name]
            for c, b in enumerate(block_ids):
                self.blocks.append((name, flat[c * self.chunk:(c + 1) * self.chunk], b))
        if not self.blocks:
            raise DeltalensError("the ES plan trains no parameter")
        self.trained = [name for name, _, _ in plan["trained"]]
        self.device = self.blocks[0][1].device
        self.n_trained = sum(self.views[n].numel() for n in self.trained)
        # the driver's noise family; it must draw every block (whole-tensor noise has no fused form here)
        self.family = make_family(plan.get("noise", "full"), self.seed, self.n_noise, self.n_blocks,
                                  options=plan.get("noise_options", {}))
        first = {name: ids[0] for name, _, ids in plan["trained"]}
        if self.family.bind([(n, n, self.views[n].view(self.shapes[n]), first[n]) for n in self.trained]):
            raise DeltalensError(f"noise {self.family.name!r} takes whole tensors; ES with vLLM draws block "
                                 "noise only (use --backend local)")
        if not threads or threads <= 0:
            threads = plan.get("threads") or _cpu_count()
        pool = noise_pool(threads, self.n_trained, len(self.blocks), PARALLEL_MIN, "es-vllm-noise")
        self.perturber = Perturber(self.family, self.blocks, pool)  # θ + s·ε and the update, as ESEngine
        # perturb / restore / update: ESEngine's steps (`ReplicaES`), on the trained slices
        self.es = ReplicaES(self.perturber, [self.views[n] for n in self.trained], sigma=plan["sigma"],
                            alpha=plan["alpha"], population=plan["population"], antithetic=plan["antithetic"],
                            restore=plan["restore"])

    @property
    def _pool(self):
        return self.perturber.pool

    @_pool.setter
    def _pool(self, pool) -> None:
        self.perturber.pool = pool

    # -- ES operations (each returns its timings)
    def perturb(self, iteration: int, member: int) -> dict:
        """θ ← θ + sign·σ·ε_k on the trained slices (`ReplicaES.perturb`, as `ESEngine.perturb`)."""
        timing = {"noise_s": 0.0, "perturb_restore_s": 0.0}
        self.es.perturb(iteration, member, timing)
        return timing

    def restore(self, iteration: int, member: int) -> dict:
        """Undo `perturb`: copy the base back (exact) or subtract the regenerated noise."""
        timing = {"noise_s": 0.0, "perturb_restore_s": 0.0}
        self.es.restore(iteration, member, timing)
        return timing

    def update(self, iteration: int, z: Sequence[float]) -> dict:
        """θ ← θ + (α/N) Σ_i z_i ε_i by `ESEngine.update`'s code (`ReplicaES.update`: per block on the CPU
        in fp32, same ops, same order), added to the weights once."""
        return self.es.update(iteration, z)

    # -- read-out
    def hf_tensor(self, name: str) -> torch.Tensor:
        """A CPU copy of HF parameter `name` (HF shape) taken out of the fused weights."""
        return self.views[name].view(self.shapes[name]).to("cpu", copy=True)

    def checksum(self) -> str:
        """`deltalens.training.es.engine.weights_checksum` of the equivalent HF model (same names, order and bytes)."""
        h = hashlib.blake2b(digest_size=16)
        for name, _ in self.plan["all"]:
            h.update(name.encode())
            h.update(self.hf_tensor(name).reshape(-1).view(torch.uint8).numpy())
        return h.hexdigest()

    def export(self, path: str | None = None) -> dict[str, torch.Tensor] | str:
        """HF-named CPU tensors of every unique parameter; written to a safetensors file if `path`."""
        sd = {name: self.hf_tensor(name) for name, _ in self.plan["all"]}
        if path is None:
            return sd
        from safetensors.torch import save_file

        save_file(sd, path)
        return path

    def close(self) -> None:
        self.es.close()  # the noise pool, and the base copy (GPU memory)


def _cpu_count() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class ESWorkerExtension(vllm_weights.WeightsWorkerExtension):
    """Mixed into vLLM's worker (`LLM(..., worker_extension_cls=EXTENSION)`); called through
    `llm.collective_rpc("es_...", args=(...))`. Holds one `FusedES`.

    Where vLLM computes with its parameters as they are (GPU builds), `FusedES` writes straight into them
    and `_es_publish` does nothing. Where it does not (`kernels_read_parameters` is False: the CPU
    build), `FusedES` works on a fused copy of the checkpoint (the shadow) and `_es_publish` pushes it
    into vLLM after every change (`vllm_weights.publish`: vLLM's in-place weight reload).
    """

    def _es_state(self) -> FusedES:
        es = getattr(self, "_deltalens_es", None)
        if es is None:
            raise DeltalensError("es_init was not called on this vLLM worker")
        return es

    def _es_checkpoint(self) -> dict[str, torch.Tensor]:
        """HF-named tensors of the checkpoint this worker loaded (the shadow's source in reload mode)."""
        return vllm_weights.read_checkpoint(self.vllm_config, self._deltalens_model())

    def _es_publish(self) -> float:
        """Make vLLM compute with FusedES's weights (reload mode; nothing in place); returns seconds."""
        if not getattr(self, "_deltalens_reload", False):
            return 0.0
        t0 = time.perf_counter()
        es = self._es_state()
        weights = [(name, es.views[name].view(es.shapes[name])) for name, _ in es.plan["all"]]
        vllm_weights.publish(getattr(self, "reload_weights", None), self._deltalens_model(), weights)
        return time.perf_counter() - t0

    def es_init(self, plan: dict) -> str:
        """Bind the plan to this worker's weights; returns the weights' HF checksum."""
        try:  # only where vLLM exposes its parallel state (the shape checks of FusedES catch shards anyway)
            from vllm.distributed import get_tensor_model_parallel_world_size

            tp = get_tensor_model_parallel_world_size()
        except Exception:  # noqa: BLE001 - older/newer vLLM: no such function, or no parallel state yet
            tp = 1
        if tp != 1:
            raise DeltalensError(f"ES with vLLM needs tensor_parallel_size=1 (got {tp}); run one engine per GPU")
        self.es_close()
        model = self._deltalens_model()
        self._deltalens_reload = not vllm_weights.kernels_read_parameters(model)
        if self._deltalens_reload:  # vLLM already computes with the checkpoint: nothing to publish yet
            from deltalens.generation.vllm_layout import fuse, vllm_slices

            slices = vllm_slices(plan["hf_config"])
            params = fuse({n: w for n, w in self._es_checkpoint().items() if n in slices}, plan["hf_config"])
        else:
            params = dict(model.named_parameters())
        self._deltalens_es = FusedES(params, plan)
        return self._deltalens_es.checksum()

    def es_perturb(self, iteration: int, member: int) -> dict:
        out = self._es_state().perturb(iteration, member)
        out["perturb_restore_s"] += self._es_publish()
        return out

    def es_restore(self, iteration: int, member: int, publish: bool = True) -> dict:
        """Undo `es_perturb`. publish=False leaves vLLM computing with the member's weights until the
        next perturb or update publishes (saves one weight reload per member in reload mode)."""
        out = self._es_state().restore(iteration, member)
        if publish:
            out["perturb_restore_s"] += self._es_publish()
        return out

    def es_update(self, iteration: int, z: list[float]) -> dict:
        es = self._es_state()
        out = es.update(iteration, z)
        out["update_s"] += self._es_publish()
        t0 = time.perf_counter()
        out["checksum"] = es.checksum()
        out["checksum_s"] = time.perf_counter() - t0
        return out

    def es_checksum(self) -> str:
        return self._es_state().checksum()

    def es_export(self, path: str) -> str:
        return self._es_state().export(path)

    def es_close(self) -> None:
        es = getattr(self, "_deltalens_es", None)
        if es is not None:
            es.close()
        self._deltalens_es = None  # drops the shadow in reload mode


# ----------------------------------------------------------------------------------------------
# the ES member-evaluation backend (driver side)


class VLLMESBackend:
    """ES members evaluated on one vLLM engine (one GPU); the interface of `deltalens.training.es.backends.MemberBackend`.

    Per member: `es_perturb` in the worker, greedy generation of the iteration's prompts through vLLM,
    `es_restore`. Per iteration: `es_update(iteration, z)` in the worker, which returns the checksum of
    the equivalent HF weights. The driver's HF model (`engine.model`) is refreshed from the worker
    (`es_export`, a safetensors file in $TMPDIR) when `sync` says so: "checkpoints" (the iterations
    train_es saves: every `checkpoint_every` and the last), "always", or "never"; after each refresh
    the driver's checksum must equal the worker's. `engine.generator` is replaced by the vLLM backend, so
    the held-out evaluation of train_es runs on vLLM too.

    GPU memory: besides vLLM's share (`gpu_memory_utilization`, default 0.7 here), the worker keeps a
    copy of the trained weights for restore="copy" and one noise block (16 MiB) per noise thread; both
    come out of the remaining share, so lower `gpu_memory_utilization` for large models (or use
    restore="subtract", which keeps no copy and is not bit-exact).

    On vLLM's CPU build the worker keeps a fused copy of all weights instead (reload mode,
    `ESWorkerExtension`), and each member's perturb and each update costs one vLLM weight reload (figures
    in docs/vllm.md). There set VLLM_CPU_KVCACHE_SPACE (GiB of KV cache, e.g. 1): without it vLLM reserves
    `gpu_memory_utilization` of the machine's memory and refuses to start when that much is not free.
    """

    name = "vllm"

    def __init__(self, engine, model_spec: str, *, gpu_memory_utilization: float = 0.7,
                 enforce_eager: bool = False, max_model_len: int | None = None, noise_threads: int = 0,
                 sync: str = "checkpoints", generator: VLLMBackend | None = None, **llm_kwargs):
        if sync not in ("checkpoints", "always", "never"):
            raise DeltalensError(f"sync must be checkpoints, always or never (got {sync!r})")
        arch(engine.model.config)  # an unsupported architecture fails here, before vLLM starts
        cfg = engine.config
        self.engine, self.sync = engine, sync
        self._owns_generator = generator is None
        self.generator = generator or VLLMBackend.from_spec(
            model_spec, dtype=cfg.dtype, gpu_memory_utilization=gpu_memory_utilization, seed=cfg.seed,
            enforce_eager=enforce_eager, max_model_len=max_model_len, enable_prefix_caching=False,
            worker_extension_cls=EXTENSION, **llm_kwargs)
        self.llm = self.generator.llm
        try:
            got = self._rpc("es_init", es_plan(engine, threads=noise_threads or cfg.noise_threads))
            want = engine.checksum()
            if any(g != want for g in got):
                raise DeltalensError(f"vLLM loaded different weights from {model_spec} than the driver "
                                     f"(checksum {got[0][:8]} vs {want[:8]}); load both with the same --dtype")
        except BaseException:
            self.close()
            raise
        engine.generator = self.generator  # member rewards and held-out evaluation through vLLM
        self.last_checksum = want

    def _rpc(self, method: str, *args) -> list:
        return self.llm.collective_rpc(method, args=args)

    def evaluate(self, iteration: int, problems) -> tuple[list[float], dict]:
        cfg = self.engine.config
        problems = problems if problems is not None else iteration_problems(self.engine.task, cfg, iteration)
        timing = new_timing()
        rewards = []
        for m in range(cfg.population):
            for k, v in self._rpc("es_perturb", iteration, m)[0].items():
                timing[k] += v
            self.generator.reset_prefix_cache()
            t0 = time.perf_counter()
            rewards.append(self.engine.score(problems, timing))
            timing["generation_s"] += time.perf_counter() - t0
            # no publish: the next member's perturb or the update publishes (one weight reload less on CPU)
            for k, v in self._rpc("es_restore", iteration, m, False)[0].items():
                timing[k] += v
        self.generator.reset_prefix_cache()
        return rewards, timing

    def _sync_due(self, iteration: int) -> bool:
        cfg = self.engine.config
        if self.sync == "always":
            return True
        if self.sync == "never":
            return False
        return iteration >= cfg.iterations or bool(cfg.checkpoint_every and iteration % cfg.checkpoint_every == 0)

    def sync_driver(self) -> str:
        """Copy the worker's weights into the driver's HF model; returns the driver's checksum."""
        with tempfile.TemporaryDirectory(prefix="deltalens-es-sync-") as d:
            path = os.path.join(d, "weights.safetensors")
            self._rpc("es_export", path)
            apply_state_dict(self.engine.model, load_file(path), source="vLLM weights")
        return self.engine.checksum()

    def update(self, iteration: int, z: Sequence[float]) -> dict:
        r = self._rpc("es_update", iteration, [float(x) for x in z])[0]
        self.generator.reset_prefix_cache()
        out = {"update_s": r["update_s"], "update_noise_s": r["update_noise_s"], "update_rms": r["update_rms"],
               "checksum": r["checksum"]}
        t0 = time.perf_counter()
        if self._sync_due(iteration):
            got = self.sync_driver()
            if got != r["checksum"]:
                raise DeltalensError(f"driver weights differ from vLLM's after iteration {iteration} "
                                     f"(checksum {got[:8]} vs {r['checksum'][:8]})")
        out["checksum_s"] = r["checksum_s"] + time.perf_counter() - t0
        self.last_checksum = r["checksum"]
        return out

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            with contextlib.suppress(Exception):
                self._rpc("es_close")
        if self._owns_generator and getattr(self, "generator", None) is not None:
            self.generator.close()
        self.llm = None
