"""Compute dtype of HF generation: auto picks bf16 only where bf16 is fast (AMX-BF16 CPU, bf16 GPU), bf16
generation runs on a bf16 copy that follows the master weights and leaves them bit-identical, and
non-fp32 weights generate as they are."""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path

import pytest
import torch
from support import small_llama

from deltalens.errors import DeltalensError
from deltalens.generation import HFBackend, SamplingParams, backend_for_spec, make_generator
from deltalens.generation import dtype as cd

GREEDY = SamplingParams(n=1, temperature=0.0, max_new_tokens=12)
PROMPTS = ["Q: 1+2=?\nA:", "Q: 10+20+30=?\nA:", "x"]


def checksum(model) -> str:
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny generate calls: a thread team only waits on a busy machine
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(("flags", "want"), [
    ({"avx512f", "avx512_bf16"}, torch.bfloat16),  # AVX512-BF16 without AMX (EPYC): 1.8x on SmolLM2
    ({"avx2", "fma", "avx512f"}, torch.float32),   # no bf16 instructions: a software path, ~10x slower
    (set(), torch.float32),
    ({"avx512_bf16", "amx_tile", "amx_bf16"}, torch.bfloat16),
])
def test_auto_picks_bf16_only_on_a_cpu_with_bf16_instructions(monkeypatch, flags, want):
    monkeypatch.setattr(cd, "cpu_flags", lambda: frozenset(flags))
    assert cd.resolve_compute_dtype("auto", "cpu") == want
    assert cd.resolve_compute_dtype("auto", "cpu", hidden_size=576) == want
    model, tok = small_llama(hidden=576, layers=1, heads=9, kv_heads=3, intermediate=64)
    assert HFBackend(model, tok, compute_dtype="auto").dtype == want
    # a narrow model (tiny's width and below) stays fp32 even with AMX: its matmuls gain nothing
    assert cd.resolve_compute_dtype("auto", "cpu", hidden_size=128) == torch.float32
    model, tok = small_llama()
    assert HFBackend(model, tok, compute_dtype="auto").dtype == torch.float32
    # explicit names do not look at the CPU
    assert cd.resolve_compute_dtype("fp32", "cpu") == torch.float32
    assert cd.resolve_compute_dtype("bf16", "cpu") == torch.bfloat16


@pytest.mark.parametrize("supported", [True, False])
def test_auto_on_cuda_follows_bf16_support(monkeypatch, supported):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: supported)
    monkeypatch.setattr(cd, "cpu_flags", lambda: frozenset({"amx_bf16"}))  # the CPU's flags do not count
    assert cd.resolve_compute_dtype("auto", "cuda:0") == (torch.bfloat16 if supported else torch.float32)


@pytest.mark.parametrize(("flags", "want"), [({"avx512_bf16"}, "bf16"), ({"avx2"}, "fp32")])
def test_planned_compute_dtype_reads_the_width_from_the_config_not_the_weights(monkeypatch, tmp_path, flags, want):
    """What plan lines and the study's cache keys use: the rule of `resolve_compute_dtype` on a spec's
    config.json, said before any weights load."""
    monkeypatch.setattr(cd, "cpu_flags", lambda: frozenset(flags))
    model, tok = small_llama(hidden=576, layers=1, heads=9, kv_heads=3, intermediate=64)
    model.save_pretrained(tmp_path / "wide")
    tok.save_pretrained(tmp_path / "wide")
    monkeypatch.setattr("deltalens.io.models.load_model", lambda *a, **k: pytest.fail("weights loaded"))
    assert cd.planned_compute_dtype(str(tmp_path / "wide"), "auto") == want
    assert cd.planned_compute_dtype("tiny", "auto") == "fp32"  # hidden 128: the width rule
    assert cd.planned_compute_dtype("tiny", "bf16") == "bf16"
    assert cd.planned_compute_dtype(str(tmp_path / "wide"), "auto", dtype="fp16") == "fp16"
    assert cd.planned_compute_dtype(str(tmp_path / "wide"), "fp32") == "fp32"


def test_cpu_flags_reads_proc_cpuinfo():
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), None)
    assert cd.cpu_flags() == (frozenset(line.partition(":")[2].split()) if line else frozenset())


@pytest.mark.parametrize("flags, says", [({"amx_bf16", "avx512_bf16"}, "bf16: amx_bf16+avx512_bf16"),
                                         ({"avx512_bf16"}, "bf16: avx512_bf16"), ({"avx2"}, "bf16: none")])
def test_machine_names_the_cpu_its_bf16_instructions_and_threads(monkeypatch, flags, says):
    """Every timing says what it ran on: an AMX Xeon and an AVX512-BF16 EPYC differ ~3x in bf16 generation."""
    monkeypatch.setattr(cd, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(cd, "cpu_model", lambda: "Some CPU")
    assert cd.machine("cpu") == f"cpu: Some CPU, {says}, {torch.get_num_threads()} threads"


def test_low_precision_weights_generate_as_they_are():
    for master in (torch.bfloat16, torch.float16):
        for name in cd.COMPUTE_DTYPES:
            assert cd.resolve_compute_dtype(name, "cpu", master) == master
    model, tok = small_llama(dtype=torch.bfloat16)
    be = HFBackend(model, tok, compute_dtype="fp32")
    be.generate(PROMPTS, GREEDY)
    assert be.compute_model is None and next(model.parameters()).dtype == torch.bfloat16


def test_unknown_compute_dtype_is_one_line_error(monkeypatch):
    model, tok = small_llama()
    for make in (lambda: HFBackend(model, tok, compute_dtype="fp16"),
                 lambda: make_generator("hf", model, tok, compute_dtype="int8")):
        with pytest.raises(DeltalensError, match="unknown compute dtype .* auto, fp32, bf16"):
            make()

    def no_load(*a, **k):
        raise AssertionError("loaded a model before checking --compute-dtype")

    monkeypatch.setattr("deltalens.io.models.load_model", no_load)
    with pytest.raises(DeltalensError, match="unknown compute dtype"):
        backend_for_spec("hf", "tiny", compute_dtype="bf32")


@pytest.mark.parametrize("tied", [False, True])
def test_bf16_generation_leaves_master_bit_identical(tied):
    model, tok = small_llama(tied=tied, hidden=64, heads=4, kv_heads=2, intermediate=128)
    before = checksum(model)
    be = HFBackend(model, tok, compute_dtype="bf16")
    out = be.generate(PROMPTS, SamplingParams(n=2, temperature=0.8, max_new_tokens=12))
    be.generate(PROMPTS, GREEDY)
    assert checksum(model) == before
    assert all(p.dtype == torch.float32 for p in model.parameters())
    cm = be.compute_model
    kept = cd.master_dtype_params(cm)  # the norm layers' weights stay fp32 (module doc)
    assert kept == {n for n, _ in cm.named_parameters() if "norm" in n}
    assert cm is not model and all(q.dtype == (torch.float32 if n in kept else torch.bfloat16)
                                   for n, q in cm.named_parameters())
    assert {p.data_ptr() for p in model.parameters()}.isdisjoint(q.data_ptr() for q in cm.parameters())
    assert all(b.dtype == torch.float32 for b in cm.buffers() if b.is_floating_point())  # rotary: not cast
    if tied:
        assert cm.lm_head.weight is cm.model.embed_tokens.weight
    assert len(out) == len(PROMPTS) and all(len(c) == 2 for c in out)


def test_bf16_generation_is_the_bf16_cast_model():
    """Same completions as a model whose parameters (only) were cast to bf16 by hand."""
    model, tok = small_llama(hidden=64, heads=4, kv_heads=2, intermediate=128)
    ref = copy.deepcopy(model)
    for p in ref.parameters():
        p.data = p.data.to(torch.bfloat16)
    want = HFBackend(ref, tok).generate(PROMPTS, GREEDY)
    assert HFBackend(model, tok, compute_dtype="bf16").generate(PROMPTS, GREEDY) == want
    # and a difference from fp32 exists somewhere, so the comparison means something
    logits = [m(**tok(PROMPTS[1], return_tensors="pt")).logits for m in (model, ref)]
    assert not torch.equal(logits[0], logits[1].float())


def test_bf16_copy_follows_updates_of_the_master():
    model, tok = small_llama(hidden=64, heads=4, kv_heads=2, intermediate=128)
    be = HFBackend(model, tok, compute_dtype="bf16")
    first = be.generate(PROMPTS, GREEDY)
    with torch.no_grad():
        torch.manual_seed(1)
        for p in model.parameters():
            p.data.add_(torch.randn_like(p), alpha=0.5)  # through .data: no version counter sees it
    after = be.generate(PROMPTS, GREEDY)
    assert after == HFBackend(model, tok, compute_dtype="bf16").generate(PROMPTS, GREEDY)
    assert after != first


def test_eval_cli_passes_compute_dtype_through(monkeypatch):
    from support import run_cli

    import deltalens.evaluation as ev

    seen = {}

    def stop(*a, **kw):
        seen.update(kw)
        raise DeltalensError("stopped here")

    monkeypatch.setattr(ev, "evaluate_models", stop)
    r = run_cli(["eval", "tiny", "--limit", "1", "--samples", "1", "--k", "1", "--compute-dtype", "bf16"])
    assert r.exit_code == 2 and seen["compute_dtype"] == "bf16"
    run_cli(["eval", "tiny", "--limit", "1", "--samples", "1", "--k", "1"])
    assert seen["compute_dtype"] == "auto"  # the default (tiny itself resolves to fp32: hidden 128)
    monkeypatch.undo()
    r = run_cli(["eval", "tiny", "--limit", "1", "--samples", "1", "--k", "1", "--compute-dtype", "fp16"])
    assert r.exit_code == 2 and r.stderr.strip().splitlines()[-1] == \
        "error: unknown compute dtype 'fp16'; choose one of auto, fp32, bf16"


def _head_inputs(model) -> list[bool]:
    """Record, for every call of `model`'s LM head, whether its input arrived contiguous."""
    seen: list[bool] = []
    model.get_output_embeddings().register_forward_hook(lambda mod, args, out: seen.append(args[0].is_contiguous()))
    return seen


def test_bf16_compute_copy_feeds_its_head_contiguous_input_with_identical_logits():
    """transformers hands the head `hidden[:, -1:, :]`, a strided view (torch 2.13's bf16 CPU linear is
    ~180x slower on it under no_grad); the compute copy's pre-hook makes it contiguous, the logits
    bit-identical to the strided call, and the fp32 master keeps no hook (its results unchanged)."""
    model, tok = small_llama(seed=0)
    be = HFBackend(model, tok, compute_dtype="bf16")
    seen = _head_inputs(be.runner())
    be.generate(PROMPTS, SamplingParams(n=2, temperature=0.6, max_new_tokens=4, seed=0))
    assert seen and all(seen)  # the prefill's last-position view included
    assert not model.get_output_embeddings()._forward_pre_hooks  # fp32 master: no hook
    head = be.runner().get_output_embeddings()
    hidden = torch.randn(3, 7, head.in_features, dtype=torch.bfloat16)
    with torch.no_grad():
        hooked = head(hidden[:, -1:, :])
        plain = torch.nn.functional.linear(hidden[:, -1:, :], head.weight, head.bias)
    assert torch.equal(hooked, plain)
    assert cd.compute_copy(be.runner(), torch.bfloat16).get_output_embeddings()._forward_pre_hooks.__len__() == 1


def test_weights_loaded_in_bf16_get_the_contiguous_head_and_fp32_does_not():
    from deltalens.io.models import load_model

    bf16, _ = load_model("tiny", dtype="bf16")
    fp32, _ = load_model("tiny")
    assert len(bf16.get_output_embeddings()._forward_pre_hooks) == 1
    assert not fp32.get_output_embeddings()._forward_pre_hooks


def test_bf16_compute_copy_keeps_norm_weights_fp32_and_rounds_their_output_once():
    """A norm layer of the bf16 copy: its fp32 weight times the bf16-rounded normalised input, rounded once
    to bf16 (the next layer's dtype); a perturbation under half a bf16 step of the weight reaches it."""
    model, _ = small_llama(hidden=64, heads=4, kv_heads=2, intermediate=128)
    with torch.no_grad():
        model.model.norm.weight.add_(1e-3 * torch.randn(64, generator=torch.Generator().manual_seed(1)))
    cm = cd.compute_copy(model, torch.bfloat16)
    norm = cm.model.norm
    assert norm.weight.dtype == torch.float32 and torch.equal(norm.weight, model.model.norm.weight)
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad():
        y = norm(x)
        h = x.float()
        want = (norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))
                .to(torch.bfloat16)).to(torch.bfloat16)
        rounded = (norm.weight.to(torch.bfloat16) * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) +
                                                                     norm.variance_epsilon)).to(torch.bfloat16))
    assert y.dtype == torch.bfloat16 and torch.equal(y, want)
    assert not torch.equal(y, rounded)  # what a bf16 weight gives: the 1e-3 perturbation partly rounded away
    with torch.no_grad():
        logits = cm(torch.tensor([[1, 4, 7, 2]])).logits
    assert torch.isfinite(logits.float()).all()  # the whole forward runs: every matmul gets a bf16 input


@pytest.mark.parametrize("tied", [False, True])
def test_cast_in_place_gives_the_compute_copys_bits(tied):
    """`cast_in_place` (the probe's passes, which need no fp32 weights) makes the model what `compute_copy`
    makes of it: same dtypes (norm weights fp32), same parameters, same logits, ties kept."""
    model, tok = small_llama(tied=tied, hidden=64, heads=4, kv_heads=2, intermediate=128)
    cm = cd.compute_copy(model, torch.bfloat16)
    ids = torch.tensor([[1, 4, 7, 2, 9]])
    with torch.no_grad():
        want = cm(ids).logits
        cd.cast_in_place(model, torch.bfloat16)
        got = model(ids).logits
    for (n, p), q in zip(model.named_parameters(), cm.parameters(), strict=True):
        assert p.dtype == q.dtype and torch.equal(p, q), n
    assert any(p.dtype == torch.float32 for p in model.parameters())  # the norm weights
    assert torch.equal(got, want)
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    be = HFBackend(model, tok, compute_dtype="bf16")
    assert be.runner() is model  # generates on itself: no second copy


def test_backend_for_spec_in_place_keeps_no_fp32_copy_and_generates_the_same():
    """`eval` and the probe need only generation: `in_place=True` casts the loaded model instead of keeping a
    bf16 copy beside it, and the completions are the copy's."""
    from support import tiny_spec

    be, model, _ = backend_for_spec("hf", tiny_spec(), device="cpu", compute_dtype="bf16", in_place=True)
    ref, ref_model, _ = backend_for_spec("hf", tiny_spec(), device="cpu", compute_dtype="bf16")
    assert be.runner() is model and be.compute_model is None
    assert ref.runner() is not ref_model and next(ref_model.parameters()).dtype == torch.float32
    params = SamplingParams(n=2, temperature=0.8, max_new_tokens=12, seed=3)
    assert be.generate(PROMPTS, params) == ref.generate(PROMPTS, params)
    assert be.generate(PROMPTS, GREEDY) == ref.generate(PROMPTS, GREEDY)
    _, m32, _ = backend_for_spec("hf", tiny_spec(), device="cpu", compute_dtype="fp32", in_place=True)
    assert all(p.dtype == torch.float32 for p in m32.parameters())  # nothing to cast


def test_compute_copy_runs_its_own_weights_under_a_patched_forward():
    """TRL's GRPO trainer sets the policy's forward to a wrapper closing over the master's own bound
    forward; a deep copy of that ran the master (fp32). The compute copy generates with its own weights."""
    import types

    model, _ = small_llama()
    original = model.forward
    model.forward = types.MethodType(lambda self, *a, **k: original(*a, **k), model)  # as TRL patches it
    copy_ = cd.compute_copy(model, torch.bfloat16)
    hits = []
    model.lm_head.register_forward_hook(lambda *a: hits.append("master"))
    copy_.lm_head.register_forward_hook(lambda *a: hits.append("copy"))
    out = copy_(input_ids=torch.tensor([[3, 4, 5]]))
    assert hits == ["copy"] and out.logits.dtype == torch.bfloat16
