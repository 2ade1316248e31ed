"""Population-batched ES evaluation: G members generate together, one batch of G x P prompts.

EGGROLL (arXiv 2511.16652) runs ES at close
to batch-inference throughput by never materialising perturbed weights: member i's linear layer
computes x·Wᵀ + x·(σ/√r)·B_i·A_iᵀ, so every member shares one batched forward over W. We do that
inside our decoding loop (`deltalens.generation.decode`, the ids transformers' `generate` computes; KV cache,
padding, EOS unchanged): the batch holds G members x B
prompts (member-major rows), and for the duration of the call the modules that own trained tensors
get a member-aware forward that views the batch as [G, B·T, ...] and applies each member's weights:

    nn.Linear     full rank: stacked W + σε_i [G, out, in], one bmm (baddbmm with a bias)
                  low rank:  x·Wᵀ for all rows, then (x_i·B_i)·(±σ/√r)·A_iᵀ accumulated into it per
                             member (one in-place baddbmm_: the rank-r product is never a tensor of its own)
    nn.Embedding  full rank: rows gathered from the stacked tables
                  low rank:  W[t] + (±σ/√r)·A_i[t]·B_iᵀ (accumulated the same way)
    RMSNorm       (1-D weight: full-rank noise in both modes) stacked weights [G, d]; Llama's w·x̂ and
                  Gemma's x̂·(1 + w) (its stored w, as the master holds it), each recognised by its output

Stragglers: one decoding call runs until its longest row ends, and among G perturbed members some
row often runs to the token budget (on tiny, N=32 x P=64: the centre's rows all end by token 45, the
members' batch ran to 80 and took 2.3x as long). So `generate_replicated` generates SEGMENT tokens per
call, continuing from the returned KV cache, and between calls retires the members whose rows have all
ended (their rows leave the batch and the cache, their tensors leave `Members`): a finished member
stops costing compute within SEGMENT tokens (rows that ended inside a member still running are computed
on), and each member keeps its B rows, so the arithmetic per row does not change.

Shared prefix (`ESConfig.shared_prefix`, on by default since 2026-12-06): a chat model's prompts share
most of their tokens (SmolLM2's chat template and two few-shot examples: ~120 of ~149), and every row of
G x B recomputed them and every decoding step read them B times per member. With the option, a batch's
common token prefix goes through the model once per member (G rows, each member's weights), each member's
B rows read it in place (`deltalens.generation.shared_prefix`: the prefix keys and values once per member
and step, fp32, the split softmax), and each row's own rest of its prompt, left padded after the prefix
with positions continuing from it, is prefilled in the first decoding call (several query tokens per
row: attention over whole rows). Completions equal the unshared batch's up to rounding (fp32 on tiny:
identical, tests/training/es/test_population.py); measured figures in benchmarks/README.md.

Which members and which noise: the local backend (`deltalens.training.es.backends.local`) sends each
group of `population_batch` members here. Noise is the engine's noise family, from the same seeds
(`deltalens.training.es.noise`: the dense rows through `ESEngine.perturber`, the low-rank factors from
`LowRankNoise.member_factors`), antithetic signs included; the update is `ESEngine.update` either way
(it depends only on the rewards).

Compute dtype: members run on `ESEngine.compute_model()`, the master itself (fp32 compute) or the
generator's bf16 copy, cast from the master once per iteration. Full-rank rows are then built in fp32
from the fp32 master and rounded once to bf16 (the bits the sequential path generates with: perturb
the master in fp32, cast once); low-rank keeps W in bf16 and adds the rank-r term in bf16. The norm
layers' rows stay fp32, as the compute copy's norm weights do (`deltalens.generation.dtype`).

Equality with the one-member-at-a-time loop (greedy decoding, the ES default):
- full rank: each stacked W + σε_i is built with the very op `ESEngine.perturb` applies (same blocks,
  same fp32 `add_`), so the member weights are bit-identical; prompts are cut into the same batches as
  `HFBackend.generate` (same padding), and on CPU torch's bmm rounds each member's rows like the
  sequential matmul. Result: identical responses and rewards, hence a bit-identical update
  (tests/training/es/test_population.py checks it on the tiny model). This is an observed property of the
  CPU kernels, not a guarantee: on an H200, cuBLAS rounded bmm differently (logits within 7.7e-7,
  benchmarks/gpu_es_population.py), and then a near-tie in the greedy argmax can flip a token
  (rewards "within fp32 rounding").
- low rank: the sequential path materialises W + (σ/√r)·A·Bᵀ; this path adds the low-rank term to the
  shared product, a different rounding: logits agree within fp32 rounding (the test allows 1e-5),
  responses almost always agree (a near-tie can flip; on tiny they were identical), and the test
  compares both. In bf16/fp16 the gap is no longer fp32 rounding: the sequential path rounds
  W + σE to bf16, this path never forms it (a small tied Llama in bf16, r=1, σ=1.5e-3: logits differed
  by up to 3.9e-3 where the perturbation itself moved them by 6.1e-2). Train low-rank batched runs in
  fp32 when they must match the sequential path.
- temperature > 0: the sampler (`deltalens.generation.sampling`) draws one random stream for the whole
  batch of G·B rows after `torch.manual_seed(seed + batch index)`, so a member's samples differ from the
  ones it draws alone (the sequential path gives every member the same stream); the distribution is the
  same.

Memory: full rank stacks G copies of every trained tensor (G x parameters x dtype bytes, plus up to
G - 1 more while the survivors of a batch are gathered; checked against the free memory first, with an
error that says which `--population-batch` fits); low rank
holds G·r·(out + in) floats per matrix. The KV cache grows with G·B rows either way.

Departures from EGGROLL: members run inside the HF model's forward (decoded in segments, see above) rather than a custom
JAX inference engine;
full-rank members are batched too (stacked weights), for exact agreement with the paper's dense ES;
the 1-D tensors keep dense noise; modules whose forward is not one of the above are refused rather than
guessed (exclude them with --params). A subclass of nn.Linear or nn.Embedding with a forward of its own is
taken only where its output is checked equal to ours on a small input: Gemma 3's embedding
(`Gemma3TextScaledWordEmbedding`, rows times √hidden, the scale in the table's dtype) is, with its scale
applied; anything else is refused (a member forward that dropped the scale would generate from the wrong
activations without an error).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from deltalens.errors import DeltalensError
from deltalens.generation.batching import left_pad, length_batches
from deltalens.generation.decode import generate_or_decode
from deltalens.generation.hf import ended_rows, prefill_prompts
from deltalens.generation.kv_cache import can_share, new_cache
from deltalens.generation.params import decode_completion
from deltalens.generation.prompts import problem_prompts
from deltalens.generation.shared_prefix import shared_prompt_attention
from deltalens.io.heap import release_freed_memory
from deltalens.training.es.noise import block_in

# ----------------------------------------------------------------------------------------------
# per-member tensors


def _key(p: torch.Tensor) -> tuple:
    """Identity of a parameter's storage (tied weights are one tensor)."""
    return p.data_ptr(), tuple(p.shape)


def available_memory(device: torch.device) -> int | None:
    """Bytes free for new tensors on `device` (None when unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info.get("MemAvailable")
    except OSError:
        return None


def check_stack_memory(engine, group_size: int, dtype: torch.dtype | None = None) -> None:
    """Refuse a full-rank stack of `group_size` members (in `dtype`, default the weights') that does not
    fit in the free memory."""
    tensors = {j for j, _, _ in engine.dense_blocks}
    per_member = sum(engine.params[j][2].numel() * (dtype or engine.params[j][2].dtype).itemsize for j in tensors)
    free = available_memory(engine.params[0][2].device)
    # G stacked copies, plus up to G - 1 more while `Members.retire` gathers the survivors of a batch
    need = (2 * group_size - 1) * per_member
    if free is None or need <= 0.8 * free:
        return
    fits = int((0.8 * free // max(per_member, 1) + 1) // 2)
    hint = f"--population-batch {fits}" if fits >= 2 else "--population-batch 0"
    raise DeltalensError(f"--population-batch {group_size} with full-rank noise stacks {group_size} "
                         f"perturbed copies (up to {need / 1e9:.1f} GB while finished members are dropped) but "
                         f"{free / 1e9:.1f} GB is free; use {hint} or --noise lowrank")


def _runner_params(engine, runner: nn.Module) -> dict[tuple, list[torch.Tensor]]:
    """`_key` of each master parameter -> the parameters of `runner` that stand for it (the master's own
    when runner is the master; the compute copy's, same order as `sync_copy` pairs them, otherwise)."""
    out: dict[tuple, list[torch.Tensor]] = {}
    for p, q in zip(engine.model.parameters(), runner.parameters(), strict=True):
        targets = out.setdefault(_key(p), [])
        if all(q is not t for t in targets):
            targets.append(q)
    return out


@torch.no_grad()
def member_weights(engine, iteration: int, members: Sequence[int], timing: dict,
                   runner: nn.Module | None = None) -> dict:
    """The per-member tensors of `members` (in order), keyed by `_key` of the parameters of `runner` (the
    module that generates: default the master; with bf16 compute the engine's compute copy): a stacked
    [G, *shape] tensor (dense noise), or (A, B) with A [G, out, r] = ±σ/√r·A_k, B [G, in, r] (low-rank
    noise), in runner's dtype. Dense rows are θ + s·ε_k of the engine's noise family through its
    `Perturber` (fp32, rounded once to the row dtype: the bits the sequential path generates with)."""
    cfg = engine.config
    runner = engine.model if runner is None else runner
    targets = _runner_params(engine, runner)
    g_size = len(members)
    users: dict[int, list[tuple[int, float]]] = {}  # noise vector k -> [(row g, ±σ)]
    for g, m in enumerate(members):
        k, s = engine.es.shift_of(m)  # the noise and sign `ESEngine.perturb` gives member m
        users.setdefault(k, []).append((g, s))
    t0 = time.perf_counter()
    buffers = engine.member_buffers  # allocated once (population_batch rows), reused by every group
    dense = sorted({j for j, _, _ in engine.dense_blocks})

    def dtype_of(j: int) -> torch.dtype:
        return targets[_key(engine.params[j][2])][0].dtype

    if any(j not in buffers or len(buffers[j]) < g_size or buffers[j].dtype != dtype_of(j) for j in dense):
        rows = max(g_size, cfg.population_batch)
        buffers.clear()
        if not engine.family.items:
            check_stack_memory(engine, rows, dtype_of(dense[0]) if dense else None)
        for j in dense:
            p = engine.params[j][2]
            buffers[j] = torch.empty((rows, *p.shape), dtype=dtype_of(j), device=p.device)
    stacks = {j: buffers[j][:g_size] for j in dense}
    timing["perturb_restore_s"] += time.perf_counter() - t0

    def row(block, g):  # row g's copy of the block
        j, flat, _ = block
        return block_in(flat, engine.params[j][2], stacks[j][g])

    engine.perturber.members(iteration, users, row, timing)
    out = {}
    for j, st in stacks.items():
        for q in targets[_key(engine.params[j][2])]:
            out[_key(q)] = st
    t1 = time.perf_counter()
    for j, (a_st, b_st) in engine.family.member_factors(iteration, users, g_size).items():
        for q in targets[_key(engine.params[j][2])]:
            out[_key(q)] = (a_st.to(device=q.device, dtype=q.dtype), b_st.to(device=q.device, dtype=q.dtype))
    timing["noise_s"] += time.perf_counter() - t1
    return out


# ----------------------------------------------------------------------------------------------
# member-aware forwards


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x), computed in fp32 (returned fp32)."""
    h = x.to(torch.float32)
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def _rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm's arithmetic without the weight: x / rms(x) in fp32, cast back."""
    return _rms(x, eps).to(x.dtype)


def _norm_kind(mod: nn.Module) -> tuple[float, str] | None:
    """(eps, "llama" | "gemma") of an RMSNorm with a 1-D weight and no other parameter, recognised by its output
    on a random input: Llama's forward = w · (x / rms(x)).to(x's dtype), Gemma's = ((x / rms(x)) · (1 + w)),
    in fp32, cast to x's dtype (Gemma stores w, 1 + w acts: docs/models.md). None for anything else."""
    eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", None))
    w = getattr(mod, "weight", None)
    if (not type(mod).__name__.endswith("RMSNorm") or not isinstance(eps, float) or w is None or w.dim() != 1
            or set(dict(mod.named_parameters(recurse=False))) != {"weight"}):
        return None
    x = torch.randn(2, 3, w.shape[0], generator=torch.Generator().manual_seed(0)).to(w)
    with torch.no_grad():
        y = mod(x)
        if torch.equal(y, w * _rms_norm(x, eps)):
            return eps, "llama"
        if torch.equal(y, (_rms(x, eps) * (1.0 + w.float())).to(x.dtype)):
            return eps, "gemma"
    return None


def _embedding_scale(mod: nn.Embedding) -> torch.Tensor | None | bool:
    """None for nn.Embedding itself; for a subclass, the scale its forward multiplies the rows by (Gemma 3's
    `embed_scale`, in the table's dtype, as its forward casts it) where its output on a few ids is checked to
    be exactly that; False where it computes anything else."""
    if type(mod) is nn.Embedding:
        return None
    w = mod.weight
    ids = torch.arange(min(8, w.shape[0]), device=w.device).unsqueeze(0)
    scale = getattr(mod, "embed_scale", None)
    try:
        scale = torch.as_tensor(1.0 if scale is None else scale).to(device=w.device, dtype=w.dtype)
        with torch.no_grad():
            return scale if torch.equal(mod(ids), F.embedding(ids, w, mod.padding_idx) * scale) else False
    except Exception:  # noqa: BLE001 -- any error of a foreign table (packed, quantized): not ours to batch
        return False


def _linear_is_plain(mod: nn.Linear) -> bool:
    """nn.Linear itself, or a subclass whose output on a random input is exactly what the member forward
    computes (x·Wᵀ, then the bias: fused where it has x's dtype, added after where a compute copy keeps it fp32)."""
    if type(mod) is nn.Linear:
        return True
    w, bias = mod.weight, mod.bias
    try:
        x = torch.randn(2, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w)
        with torch.no_grad():
            fused = bias is None or bias.dtype == x.dtype
            want = F.linear(x, w, bias) if fused else F.linear(x, w).add_(bias)
            return torch.equal(mod(x), want)
    except Exception:  # noqa: BLE001 -- packed or quantized weights, another signature: not ours to batch
        return False


class Members:
    """The per-member tensors the member-aware forwards read (`member_weights`' dict), for the members
    still generating: `retire` keeps some of them, so finished members stop costing compute."""

    def __init__(self, weights: dict, count: int):
        self.all, self.size = weights, count
        self.weights, self.count = weights, count

    def reset(self) -> None:
        """All members again (the next batch of prompts)."""
        self.weights, self.count = self.all, self.size

    def get(self, p):
        return self.weights.get(_key(p)) if isinstance(p, torch.Tensor) else None

    def retire(self, keep: list[int]) -> None:
        """Keep only the members at positions `keep` (in order) of the current ones."""
        idx = torch.tensor(keep)
        self.weights = {k: (v[idx.to(v.device)] if isinstance(v, torch.Tensor)
                            else tuple(t[idx.to(t.device)] for t in v)) for k, v in self.weights.items()}
        self.count = len(keep)


def _member_forward(name: str, mod: nn.Module, members: Members):
    """A forward for `mod` that treats its batch as `members.count` blocks of rows with their own weights."""
    w, bias = getattr(mod, "weight", None), getattr(mod, "bias", None)

    def split(x: torch.Tensor) -> torch.Tensor:  # [G·B, ..., d] -> [G, B·..., d]
        if x.shape[0] % members.count:
            raise DeltalensError(f"{name}: batch {x.shape[0]} is not {members.count} member blocks; "
                                 "population batching needs batch-first modules (use --population-batch 0)")
        return x.reshape(members.count, -1, x.shape[-1])

    if isinstance(mod, nn.Linear) and not _linear_is_plain(mod):
        raise DeltalensError(f"population batching: {name} ({type(mod).__name__}) is a Linear with a forward of "
                             f"its own; exclude it with --params '*,!{name}.*' or use --population-batch 0")
    if isinstance(mod, nn.Linear):
        def linear(x):
            w_m, b_m, xv = members.get(w), members.get(bias), split(x)
            if isinstance(w_m, torch.Tensor):  # full rank: stacked weights, one bmm
                b = b_m if b_m is not None else (bias.expand(members.count, -1) if bias is not None else None)
                if b is None:
                    y = torch.bmm(xv, w_m.transpose(1, 2))
                elif b.dtype == xv.dtype:
                    y = torch.baddbmm(b.unsqueeze(1), xv, w_m.transpose(1, 2))
                else:  # a compute copy's fp32 bias: added in fp32 after the product, as its forward does
                    y = torch.bmm(xv, w_m.transpose(1, 2)).add_(b.unsqueeze(1))
                return y.reshape(*x.shape[:-1], y.shape[-1])
            fused = bias is not None and b_m is None and bias.dtype == x.dtype
            y = F.linear(x, w, bias if fused else None)  # shared weights, all rows at once
            yv = y.view(members.count, -1, y.shape[-1])  # y is ours (fresh): updated in place below
            if b_m is not None:
                yv.add_(b_m.unsqueeze(1))
            elif bias is not None and not fused:
                y.add_(bias)  # a compute copy's fp32 bias (deltalens.generation.dtype)
            if w_m is not None:  # low rank: += (x B_i)(±σ/√r A_i)ᵀ, accumulated into y (see module doc)
                a, b = w_m
                yv.baddbmm_(torch.bmm(xv, b), a.transpose(1, 2))
            return y
        return linear

    if isinstance(mod, nn.Embedding):
        if mod.max_norm is not None:
            raise DeltalensError(f"{name}: population batching does not support Embedding(max_norm=...); "
                                 "use --population-batch 0")
        scale = _embedding_scale(mod)  # Gemma 3: rows x √hidden (its forward's own cast and product)
        if scale is False:
            raise DeltalensError(f"population batching: {name} ({type(mod).__name__}) is an Embedding with a "
                                 f"forward of its own; exclude it with --params '*,!{name}.*' or use "
                                 "--population-batch 0")

        def embedding(ids):
            w_m, iv = members.get(w), ids.reshape(members.count, -1)
            rows = torch.arange(members.count, device=ids.device).unsqueeze(1)
            if isinstance(w_m, torch.Tensor):  # full rank: gather from the stacked tables
                y = w_m[rows, iv].reshape(*ids.shape, w.shape[1])
            else:
                a, b = w_m  # low rank: W[t] + (±σ/√r A_i[t]) B_iᵀ
                y = F.embedding(ids, w, mod.padding_idx)  # fresh: the low-rank rows are accumulated into it
                y.view(members.count, -1, w.shape[1]).baddbmm_(a[rows, iv], b.transpose(1, 2))
            return y if scale is None else y * scale
        return embedding

    kind = _norm_kind(mod)
    if kind is not None:
        eps, style = kind

        def rms_norm(x):  # a compute copy's norm weights stay fp32: the product is rounded once, to x's dtype
            if style == "llama":  # w · x̂, x̂ rounded to x's dtype first
                y = members.get(w).unsqueeze(1) * split(_rms_norm(x, eps))
            else:  # gemma: x̂ · (1 + w), all in fp32
                y = split(_rms(x, eps)) * (1.0 + members.get(w).float()).unsqueeze(1)
            return y.reshape(x.shape).to(x.dtype)
        return rms_norm

    raise DeltalensError(f"population batching supports nn.Linear, nn.Embedding and Llama- or Gemma-style RMSNorm; "
                         f"{name} ({type(mod).__name__}) has trained parameters: exclude them with "
                         f"--params '*,!{name}.*' or use --population-batch 0")


@contextlib.contextmanager
def member_modules(model: nn.Module, members: Members):
    """Within the block, every module owning a tensor of `members` runs all members at once."""
    plan = []
    for name, mod in model.named_modules():
        if any(_key(p) in members.weights for p in mod.parameters(recurse=False)):
            plan.append((mod, _member_forward(name, mod, members), mod.__dict__.get("forward")))
    try:
        for mod, fwd, _ in plan:
            mod.forward = fwd
        yield members
    finally:
        for mod, _, old in plan:
            if old is None:
                mod.__dict__.pop("forward", None)
            else:
                mod.forward = old


# ----------------------------------------------------------------------------------------------
# generation and scoring

SEGMENT = 16  # new tokens per decoding call between retirements of finished members
MIN_SHARED = 8  # the least common prefix (tokens) worth a prefill and a shared cache of its own


def common_prefix(seqs: list[list[int]]) -> int:
    """Tokens every sequence of `seqs` starts with, short of the shortest's last (each row keeps at least
    one token of its own: the prefill of the rows needs a query)."""
    first, n = seqs[0], min(len(s) for s in seqs) - 1
    for s in seqs[1:]:
        n = next((i for i in range(n) if s[i] != first[i]), n)
    return max(n, 0)


@torch.no_grad()
def generate_replicated(generator, prompts: list[str], replicas: int, params, members: Members | None = None,
                        segment: int | None = SEGMENT, model: nn.Module | None = None,
                        shared: bool = False) -> list[list[str]]:
    """out[g][i]: the completion of prompt i by replica g (one completion per prompt).

    The prompts are cut into the batches `HFBackend.generate` makes (sorted by length, same size bound,
    same padding, `torch.manual_seed(seed + batch index)`), and each batch is repeated `replicas` times,
    replica-major: rows g·b .. g·b + b - 1 belong to replica g. Generation runs `segment` tokens per
    decoding call (`generation.decode`), continuing from the returned KV cache (the same arithmetic as one call); between
    calls the replicas whose rows have all ended are retired (rows, cache and `members` cut down), so
    a member that ends early stops costing compute, as it would alone. segment=None: one call.
    `model`: the module that generates (default generator.model; the engine's compute copy in bf16).
    shared: a batch's prompts' common token prefix (chat template, few-shot examples: ~120 of SmolLM2's
    ~149 prompt tokens) is prefilled once per replica, not once per row, and its rows read it in place
    (`generation.hf.prefill_prompts`, the prefill HFBackend gives a prompt's samples); each row then prefills its
    own rest (left padded after the prefix, positions continuing from it) inside the first decoding call.
    The same arithmetic up to rounding (the split softmax; prefix keys and values kept in fp32).
    """
    from transformers.utils import logging as hf_logging

    if params.n != 1:
        raise DeltalensError("population batching generates one completion per prompt (n = 1)")
    tok, model = generator.tok, generator.model if model is None else model
    enc = generator.encode(prompts)
    out = [[""] * len(prompts) for _ in range(replicas)]
    device = next(model.parameters()).device
    eos = tok.eos_token_id
    verbosity = hf_logging.get_verbosity()
    batches = length_batches([len(e) for e in enc], 1, params.max_new_tokens, generator.batch_tokens,
                             generator.max_batch)
    share = shared and can_share(model)
    for batch, items in enumerate(batches):
        chunk = [i for i, _ in items]
        cut = common_prefix([enc[i] for i in chunk]) if share else 0
        cut = cut if cut >= MIN_SHARED else 0
        ids, att = left_pad([enc[i][cut:] for i in chunk], tok.pad_token_id)  # padding after the prefix
        if cut:
            ids = torch.cat([torch.tensor(enc[chunk[0]][:cut]).expand(len(chunk), -1), ids], dim=1)
            att = torch.cat([att.new_ones(len(chunk), cut), att], dim=1)
        t = ids.shape[1]
        seqs, mask = ids.repeat(replicas, 1).to(device), att.repeat(replicas, 1).to(device)
        live, produced = list(range(replicas)), 0
        cache = new_cache(model.config, segment or params.max_new_tokens)  # in place (`kv_cache`)
        if members is not None:
            members.reset()
        torch.manual_seed(params.seed + batch)
        with shared_prompt_attention(model, bool(cut)):  # the prefix read in place (a no-op without one)
            try:
                if cut:  # the prefix once per replica (its weights), read in place by its rows
                    prefix = torch.tensor(enc[chunk[0]][:cut], device=device).expand(replicas, -1)
                    prefill_prompts(model, prefix, torch.ones_like(prefix),
                                    torch.arange(replicas, device=device).repeat_interleave(len(chunk)), cache, True)
                while live:
                    if produced:  # rows that ended end in padding: not the right padding transformers warns of
                        hf_logging.set_verbosity_error()
                    step = min(segment or params.max_new_tokens, params.max_new_tokens - produced)
                    res = generate_or_decode(model, seqs, mask, cache, step, pad_token_id=tok.pad_token_id,
                                             eos_token_id=eos, temperature=params.temperature, top_p=params.top_p)
                    new = res.shape[1] - seqs.shape[1]
                    seqs, produced = res, produced + new  # the cache filled in place
                    mask = torch.cat([mask, mask.new_ones(mask.shape[0], new)], dim=1)
                    gen = seqs[:, t:].cpu()
                    ended = ended_rows(tok, gen, params.stop).view(len(live), len(chunk)).all(1).tolist()
                    stop = produced >= params.max_new_tokens or new < step
                    keep = [k for k in range(len(live)) if not (stop or ended[k])]
                    for k, g in enumerate(live):
                        if k not in keep:
                            for r, i in enumerate(chunk):
                                out[g][i] = decode_completion(tok, gen[k * len(chunk) + r].tolist(), params.stop)
                    if keep and len(keep) < len(live):
                        rows = torch.cat([torch.arange(k * len(chunk), (k + 1) * len(chunk)) for k in keep])
                        rows = rows.to(device)
                        seqs, mask = seqs[rows], mask[rows]
                        cache.batch_select_indices(rows)
                        if members is not None:
                            members.retire(keep)
                    live = [live[k] for k in keep]
            finally:
                hf_logging.set_verbosity(verbosity)
        cache = res = None  # this batch's cache and outputs freed before the trim
        release_freed_memory()  # the batch's cache and logits, back to the OS (`kv_cache`)
    return out


def evaluate_batched(engine, iteration: int, members: Sequence[int], problems,
                     timing: dict) -> dict[int, float]:
    """Reward of each member, `engine.config.population_batch` members per batched generation."""
    members = list(members)
    size = engine.config.population_batch
    prompts = problem_prompts(problems, engine.generator.chat)
    out = {}
    t0 = time.perf_counter()
    runner = engine.compute_model()  # the master, or its compute copy cast from it once here
    timing["generation_s"] += time.perf_counter() - t0  # as the sequential path's cast, inside generate
    for start in range(0, len(members), size):
        group = members[start:start + size]
        weights = member_weights(engine, iteration, group, timing, runner)
        t0 = time.perf_counter()
        with member_modules(runner, Members(weights, len(group))) as live:
            completions = generate_replicated(engine.generator, prompts, len(group), engine.sampling_params(),
                                              live, segment=SEGMENT, model=runner,
                                              shared=engine.config.shared_prefix)
        for g, m in enumerate(group):
            out[m] = engine.mean_reward(completions[g], problems, timing)
        timing["generation_s"] += time.perf_counter() - t0
    return out
