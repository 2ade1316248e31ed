"""ES through a real vLLM (the CPU build in CI, where the worker's writes reach vLLM through its weight
reload; docs/vllm.md) against the in-process backend.

Run with `-m vllm_real` in an environment with vLLM (`.ci/run` builds one); skipped without vLLM.
"""

from __future__ import annotations

import json

import pytest
from support import assert_same_weights, final_weights, real_vllm, run_cli, tiny_spec

pytestmark = pytest.mark.vllm_real


def _resolver():
    try:
        from vllm.utils.import_utils import resolve_obj_by_qualname
    except ImportError:  # older vLLM
        from vllm.utils import resolve_obj_by_qualname
    return resolve_obj_by_qualname


def test_extension_resolves_and_fits_vllm_workers():
    """vLLM resolves the extension by its dotted name (as its worker does), and the extension can be mixed
    into both the CPU and the GPU worker classes: no attribute clashes (vLLM refuses those), and the
    workers have the reload_weights the CPU path needs."""
    real_vllm()
    from deltalens.training.es.backends.vllm import EXTENSION, ESWorkerExtension

    resolve = _resolver()
    assert resolve(EXTENSION) is ESWorkerExtension
    for qualname in ("vllm.v1.worker.cpu_worker.CPUWorker", "vllm.v1.worker.gpu_worker.Worker"):
        worker = resolve(qualname)
        clash = [a for a in dir(ESWorkerExtension) if not a.startswith("__") and hasattr(worker, a)]
        assert not clash, f"{qualname} already has {clash}"
        assert callable(getattr(worker, "reload_weights", None)), qualname


def _metrics(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_es_cli_equals_local(tmp_path):
    """`deltalens train es --backend vllm` (2 iterations, N=4, 8 prompts) ends with the local backend's
    weights bit for bit: same member rewards (scored by vLLM on the perturbed weights), same checksums,
    and the held-out Pass@1 after the last update (run on vLLM too) is the local backend's."""
    real_vllm()
    spec = tiny_spec()
    args = ["train", "es", "--model", spec, "--task", "arith", "--iterations", "2", "--population", "4",
            "--prompts", "8", "--seed", "0"]
    runs = {}
    for backend in ("local", "vllm"):
        runs[backend] = tmp_path / backend
        r = run_cli([*args, "--backend", backend, "--out", runs[backend]])
        assert r.exit_code == 0, r.output
    local, vllm = _metrics(runs["local"]), _metrics(runs["vllm"])
    it_local = [row for row in local if "rewards" in row]
    it_vllm = [row for row in vllm if "rewards" in row]
    assert [r["iteration"] for r in it_vllm] == [1, 2]
    for a, b in zip(it_local, it_vllm):
        assert b["rewards"] == a["rewards"] and b["checksum"] == a["checksum"], a["iteration"]
    assert any(r["update_rms"] > 0 for r in it_vllm)  # the weights moved
    evals_local = [(r["iteration"], r["eval"]["pass_at_1"]) for r in local if "eval" in r]
    evals_vllm = [(r["iteration"], r["eval"]["pass_at_1"]) for r in vllm if "eval" in r]
    assert evals_vllm == evals_local and evals_vllm[-1][0] == 2
    assert_same_weights(final_weights(runs["vllm"]), final_weights(runs["local"]))


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory):
    """tiny with its LM head tied to the embedding (as SmolLM2 and Qwen2.5 small models are)."""
    from deltalens.io.models import load_model

    model, tok = load_model(tiny_spec())
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    d = tmp_path_factory.mktemp("tiny-tied")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


def test_tied_embeddings_follow_es(tied_model):
    """With tied embeddings, the weights vLLM computes with follow every ES operation, LM head included
    (vLLM's reload refreshes only the embedding's packed copy; the extension processes the head again):
    greedy completions through vLLM equal the HF model's after a perturbation, a restore and an update."""
    real_vllm()
    from deltalens.generation import HFBackend, SamplingParams
    from deltalens.io.models import load_model
    from deltalens.training.es.backends.vllm import VLLMESBackend
    from deltalens.training.es.config import ESConfig
    from deltalens.training.es.engine import ESEngine, new_timing
    from deltalens.training.run import make_task

    cfg = ESConfig(model=tied_model, population=2, sigma=0.02, alpha=0.01, prompts_per_iteration=8,
                   max_new_tokens=24, eval_every=0, iterations=1)
    engines = []
    for _ in range(2):
        model, tok = load_model(tied_model)
        engines.append(ESEngine(model, tok, make_task(cfg), cfg))
    ref, driver = engines
    assert ref.model.lm_head.weight is ref.model.model.embed_tokens.weight
    backend = VLLMESBackend(driver, tied_model, enforce_eager=True)
    prompts = [p.prompt for p in ref.task.test(20)]
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=24)
    hf = HFBackend(ref.model, ref.tok)

    def both(what: str) -> list:
        backend.generator.reset_prefix_cache()
        want, got = hf.generate(prompts, greedy), backend.generator.generate(prompts, greedy)
        assert got == want, what
        return got

    try:
        base = both("base")
        timing = new_timing()
        ref.perturb(1, 0, timing)
        backend._rpc("es_perturb", 1, 0)
        assert both("member 0") != base  # the perturbation reached vLLM's kernels
        ref.restore(1, 0, timing)
        backend._rpc("es_restore", 1, 0)
        assert both("restored") == base
        z = [1.0, -1.0]
        ref.update(1, z)
        assert backend.update(1, z)["checksum"] == ref.checksum()
        assert both("updated") != base
    finally:
        backend.close()
