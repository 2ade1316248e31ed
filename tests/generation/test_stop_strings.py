"""Stop strings: completions cut before the first stop string, rows that wrote one leave the batch, and
tasks give one for raw few-shot prompts only."""

import pytest
import torch
from support import tiny_spec

import deltalens.generation.hf as hf_mod
from deltalens.errors import DeltalensError
from deltalens.generation import HFBackend, SamplingParams
from deltalens.generation.params import cut_at_stop
from deltalens.tasks import get_task


def test_cut_at_stop_takes_the_earliest_stop_string():
    assert cut_at_stop(" 3 + 4 = 7.\n#### 7\n\nQ: What is 1 + 1?", ("\n\nQ:",)) == (" 3 + 4 = 7.\n#### 7", True)
    assert cut_at_stop("a. b; c.", (";", ".")) == ("a", True)  # the earliest occurrence, whichever string
    assert cut_at_stop("no stop here", ("\n\n",)) == ("no stop here", False)
    assert cut_at_stop("\n\nQ: at once", ("\n\nQ:",)) == ("", True)
    assert cut_at_stop("anything", ()) == ("anything", False)


@pytest.mark.parametrize("stop", ["\n\n", ("",), (None,)])
def test_sampling_params_refuse_a_bare_string_or_empty_stop(stop):
    with pytest.raises(DeltalensError, match="stop must be a tuple of non-empty strings"):
        SamplingParams(stop=stop)


def test_sampling_params_keep_stop_as_a_tuple():
    assert SamplingParams(stop=["\n\nQ:"]).stop == ("\n\nQ:",)


def test_tasks_stop_raw_few_shot_prompts_before_the_next_example():
    shots = get_task("add:digits=1-2,terms=2,shots=2")
    assert shots.stop_strings(chat=False) == ("\n\nQ:",)
    # the separator the prompt itself uses between examples, then the start of the next question
    assert "#### " in shots.test(1)[0].prompt and "\n\nQ:" in shots.test(1)[0].prompt
    assert shots.stop_strings(chat=True) == ()  # the chat template ends the turn with EOS
    assert get_task("add:digits=1-2,terms=2").stop_strings(chat=False) == ()  # zero-shot: nothing to copy


@pytest.fixture(scope="module")
def tiny():
    from deltalens.io.models import load_model

    model, tok = load_model(tiny_spec())
    prompts = [p.prompt for p in get_task("arith").test(6)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield model, tok, prompts
    torch.set_num_threads(threads)


def _decoding_steps(model, monkeypatch):
    """Counts the rows of every one-token forward (the decoding steps)."""
    steps = []
    forward = type(model).forward

    def spy(self, input_ids=None, **kw):
        if input_ids.shape[1] == 1:
            steps.append(input_ids.shape[0])
        return forward(self, input_ids=input_ids, **kw)

    monkeypatch.setattr(type(model), "forward", spy)
    return steps


@pytest.mark.parametrize("n", [1, 3])
def test_hf_completions_are_the_full_ones_cut_and_stop_early(tiny, monkeypatch, n):
    model, tok, prompts = tiny
    monkeypatch.setattr(hf_mod, "SEGMENT", 4)
    steps = _decoding_steps(model, monkeypatch)
    full = HFBackend(model, tok).generate(prompts, SamplingParams(n=n, temperature=0.0, max_new_tokens=64))
    without = sum(steps)
    assert all("=" in c and ". " in c for cs in full for c in cs)  # tiny writes " a+b=c. c-d=e. ..."
    steps.clear()
    cut = HFBackend(model, tok).generate(prompts, SamplingParams(n=n, temperature=0.0, max_new_tokens=64,
                                                                 stop=(". ",)))
    assert cut == [[cut_at_stop(c, (". ",))[0] for c in cs] for cs in full]
    assert all(". " not in c and "#### " not in c for cs in cut for c in cs)
    # rows that wrote the stop string left the batch: far fewer row-steps than running each to EOS
    assert sum(steps) < without / 2, (sum(steps), without)


def test_sampled_completions_hold_no_stop_string(tiny):
    model, tok, prompts = tiny
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=48, seed=1, stop=("=",))
    out = HFBackend(model, tok).generate(prompts, params)
    assert all("=" not in c for cs in out for c in cs)
    assert all(c.strip() for cs in out for c in cs)  # each sample wrote something before its "="


def test_population_generation_cuts_as_the_backend_does(tiny):
    from deltalens.training.es.population import generate_replicated

    model, tok, prompts = tiny
    gen = HFBackend(model, tok, batch_tokens=250)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=48, stop=("-",))
    want = [c[0] for c in gen.generate(prompts, params)]
    assert any("-" in c for c in (x[0] for x in gen.generate(prompts, SamplingParams(n=1, temperature=0.0,
                                                                                      max_new_tokens=48))))
    for segment in (5, None):
        assert generate_replicated(gen, prompts, 2, params, segment=segment) == [want] * 2


def test_evaluate_records_the_stop_string_of_a_raw_few_shot_task(tiny):
    from deltalens.evaluation.evaluate import evaluate

    model, tok, _ = tiny
    few = evaluate(model, tok, get_task("arith:shots=1"), samples=2, ks=(1,), limit=3, max_new_tokens=24,
                   keep_completions=2)
    assert few["stop"] == ["\n\nQ:"]
    assert all("\n\nQ:" not in c for p in few["per_problem"] for c in p["completions"])
    zero = evaluate(model, tok, get_task("arith"), samples=2, ks=(1,), limit=3, max_new_tokens=24)
    assert "stop" not in zero
