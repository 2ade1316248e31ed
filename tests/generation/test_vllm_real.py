"""VLLMBackend on a real vLLM (the CPU build in CI) against the HF backend, on the bundled tiny model.

Run with `-m vllm_real` in an environment with vLLM (`.ci/run` builds one); skipped without vLLM. One
engine serves the whole module (an engine start costs about a minute on 2 cores).
"""

from __future__ import annotations

import math

import pytest
from support import real_vllm, tiny_spec

pytestmark = pytest.mark.vllm_real

N_PROBLEMS = 100


@pytest.fixture(scope="module")
def backends():
    """(HF backend, vLLM backend, task) on tiny in fp32, seed 0."""
    real_vllm()
    from deltalens.generation import HFBackend
    from deltalens.generation.vllm import VLLMBackend
    from deltalens.io.models import load_model
    from deltalens.tasks import get_task

    spec = tiny_spec()
    model, tok = load_model(spec)
    vllm = VLLMBackend.from_spec(spec, dtype="fp32", seed=0)
    yield HFBackend(model, tok), vllm, get_task("arith")
    vllm.close()


def test_greedy_completions_identical(backends):
    """Greedy completions of 100 test problems are the same strings with both backends."""
    from deltalens.generation import SamplingParams

    hf, vllm, task = backends
    prompts = [p.prompt for p in task.test(N_PROBLEMS)]
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=task.max_new_tokens)
    want = hf.generate(prompts, greedy)
    got = vllm.generate(prompts, greedy)
    differ = [i for i, (a, b) in enumerate(zip(want, got)) if a != b]
    assert not differ, f"{len(differ)} of {N_PROBLEMS} differ, first: {want[differ[0]]} vs {got[differ[0]]}"


def test_stop_strings_cut_as_hf_cuts(backends):
    """With a stop string, vLLM's greedy completions are HF's: the text before its first occurrence."""
    from deltalens.generation import SamplingParams

    hf, vllm, task = backends
    prompts = [p.prompt for p in task.test(20)]
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=task.max_new_tokens, stop=(". ",))
    want = hf.generate(prompts, greedy)
    assert all(". " not in c[0] and "#### " not in c[0] for c in want)  # tiny writes "a+b=c. c-d=e. ..."
    assert vllm.generate(prompts, greedy) == want


def test_pass_at_1_agrees(backends):
    """Pass@1 of 100 problems x 16 samples at T=0.6 (`deltalens.evaluation.evaluate`, as `deltalens eval`
    runs it) agrees between the backends within 3 standard errors of the paired per-problem difference
    (the random streams differ, so the samples do)."""
    from deltalens.evaluation import evaluate

    hf, vllm, task = backends
    kw = {"samples": 16, "ks": [1], "temperature": 0.6, "limit": N_PROBLEMS, "seed": 0}
    r_hf = evaluate(None, None, task, backend=hf, **kw)
    r_vllm = evaluate(None, None, task, backend=vllm, **kw)
    d = [b["correct"] / b["n"] - a["correct"] / a["n"] for a, b in zip(r_hf["per_problem"], r_vllm["per_problem"])]
    mean = sum(d) / len(d)
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d))
    p_hf, p_vllm = r_hf["pass_at_k"]["1"], r_vllm["pass_at_k"]["1"]
    assert p_vllm - p_hf == pytest.approx(mean)
    assert abs(mean) <= 3 * se, f"Pass@1 HF {p_hf:.4f} vs vLLM {p_vllm:.4f}: difference {mean:+.4f}, se {se:.4f}"
    assert 0.1 < p_hf < 0.5  # tiny's Pass@1 is about 0.27: the comparison is not between two zeros


def test_loaded_state_dict_is_what_the_engine_computes_with(backends):
    """`VLLMBackend.load_state_dict` on the real engine (the CPU build repacks its linear weights, so this
    goes through vLLM's in-place reload, the tied LM head processed again): after loading noisy weights,
    greedy completions of 100 problems are the HF model's on those weights (and differ from the base's);
    loading the base back restores its completions. (These prompts are shorter than one KV block, so the
    prefix cache plays no part here; the next test is about it.)"""
    import torch

    from deltalens.generation import HFBackend, SamplingParams
    from deltalens.io.models import apply_state_dict, load_model

    _, vllm, task = backends
    model, tok = load_model(tiny_spec())
    base = {k: v.clone() for k, v in model.state_dict().items()}  # (tiny's LM head is not tied)
    g = torch.Generator().manual_seed(0)
    noisy = {k: v + 0.05 * v.std() * torch.randn(v.shape, generator=g) if v.numel() > 1 else v.clone()
             for k, v in base.items()}
    apply_state_dict(model, noisy)
    prompts = [p.prompt for p in task.test(N_PROBLEMS)]
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=task.max_new_tokens)
    before = vllm.generate(prompts, greedy)
    try:
        assert vllm.load_state_dict(noisy)["tensors"] == len(base)
        got = vllm.generate(prompts, greedy)
    finally:
        vllm.load_state_dict(base)  # the module's engine serves the other tests with the base's weights
    want = HFBackend(model, tok).generate(prompts, greedy)
    differ = [i for i, (a, b) in enumerate(zip(want, got)) if a != b]
    assert not differ, f"{len(differ)} of {N_PROBLEMS} differ, first: {want[differ[0]]} vs {got[differ[0]]}"
    assert sum(a != b for a, b in zip(before, got)) >= 10  # the noise changed what the model says
    assert vllm.generate(prompts, greedy) == before


def test_loading_weights_drops_the_cached_kv_blocks(backends):
    """The prefix cache holds KV blocks computed with the weights of their time. Prompts longer than one
    block (the CPU build's blocks are 128 tokens) are cached by a first pass; after weights are loaded
    without dropping the cache, vLLM serves the old blocks (the completions differ from those computed
    afresh: this is what the test can see), and `load_state_dict`, which drops it, gives the fresh ones."""
    import tempfile

    import torch
    from safetensors.torch import save_file

    from deltalens.generation import SamplingParams
    from deltalens.generation.vllm_weights import LOAD_RPC
    from deltalens.io.models import load_model

    _, vllm, task = backends
    prefix = "".join(f"{i}+{i}={2 * i}\n" for i in range(10, 28))  # 126 characters of worked sums
    prompts = [prefix + p.prompt for p in task.test(20)]
    assert 140 < min(len(vllm.encode(p)) for p in prompts) <= 240  # over one full block; fits the 256 context
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=12)
    model, _ = load_model(tiny_spec())
    base = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    noisy = {k: v + 0.05 * v.std() * torch.randn(v.shape, generator=g) if v.numel() > 1 else v.clone()
             for k, v in base.items()}
    try:
        vllm.generate(prompts, greedy)  # caches the prompts' blocks under the base's weights
        with tempfile.TemporaryDirectory() as d:  # the worker's load alone, the cache kept
            save_file(noisy, f"{d}/w.safetensors")
            vllm.llm.collective_rpc(LOAD_RPC, args=(f"{d}/w.safetensors",))
        stale = vllm.generate(prompts, greedy)
        vllm.reset_prefix_cache()
        fresh = vllm.generate(prompts, greedy)
        vllm.load_state_dict(base)
        vllm.generate(prompts, greedy)  # the base's blocks cached again
        vllm.load_state_dict(noisy)
        got = vllm.generate(prompts, greedy)
    finally:
        vllm.load_state_dict(base)
    assert stale != fresh, "no completion used a cached block: the test cannot see a missing reset"
    assert got == fresh


def test_seeded_sampling_survives_chunked_scheduling():
    """vLLM 0.32's CPU build died ("CPU Generator does not use offset") when chunked prefill split the prompt
    of a seeded request; the backend turns chunked prefill off there. A small token budget per step (256)
    forces the split that killed `deltalens probe smollm2 --backend vllm` at 200 problems x 32 samples."""
    real_vllm()
    import psutil  # a dependency of vLLM

    from deltalens.generation import SamplingParams
    from deltalens.generation.vllm import VLLMBackend
    from deltalens.tasks import get_task

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    be = VLLMBackend.from_spec(tiny_spec(), dtype="fp32", max_num_batched_tokens=256, max_model_len=256)
    # the engine's processes (VLLM::EngineCore, VLLM::Worker), not helpers such as compile workers
    engine = [p for p in psutil.Process().children(recursive=True) if p.pid not in before
              and p.name().startswith("VLLM")]
    held = be.llm  # something else still references the LLM (as in a study, where the base's engine lived on)
    try:
        prompts = [p.prompt for p in get_task("arith").test(300)]
        out = be.generate(prompts, SamplingParams(n=8, temperature=1.0, max_new_tokens=40, seed=0))
    finally:
        be.close()
    assert len(out) == 300 and all(len(cs) == 8 for cs in out)
    # close() stops the engine itself, not whenever the LLM object happens to be garbage-collected
    assert engine, "the CPU build runs its engine core in a child process"
    _, alive = psutil.wait_procs(engine, timeout=30)
    assert not alive, f"engine processes still running after close(): {[p.name() for p in alive]}"
    del held
