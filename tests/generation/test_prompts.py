"""Chat templates end to end: one setting (auto/on/off) gives the same token ids on every path that builds a
prompt: the HF backend, ES (one by one and population-batched), GRPO's dataset, diversity."""

from __future__ import annotations

import pytest
from support import small_llama

from deltalens.errors import DeltalensError
from deltalens.generation import HFBackend
from deltalens.generation.prompts import encode_prompts, format_prompt, problem_prompts, uses_chat
from deltalens.tasks import get_task

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture
def chat_model():
    model, tok = small_llama()
    tok.chat_template = TEMPLATE
    return model, tok


def test_modes(chat_model):
    _, tok = chat_model
    _, plain = small_llama()
    assert uses_chat(tok, "auto") and uses_chat(tok, "on") and not uses_chat(tok, "off")
    assert not uses_chat(plain, "auto") and not uses_chat(plain, "off")
    with pytest.raises(DeltalensError, match="has no chat template"):
        uses_chat(plain, "on")
    with pytest.raises(DeltalensError, match="auto, on or off"):
        uses_chat(tok, "yes")


def test_known_answer_rendering(chat_model):
    _, tok = chat_model
    p = get_task("add:shots=1").test(1)[0]
    text = format_prompt(tok, p.chat(), True)
    ex = get_task("add:shots=1").examples()[0]
    want = (f"<user>What is {ex.meta['expr']}? End your reply with the final answer as #### <answer>.\n"
            f"<assistant>{ex.solution.strip()}\n"
            f"<user>What is {p.meta['expr']}? End your reply with the final answer as #### <answer>.\n<assistant>")
    assert text == want
    # chat rendering: no special tokens added on top of the template's own (no BOS/EOS here)
    assert encode_prompts(tok, [p.chat()], True)[0] == tok(want, add_special_tokens=False)["input_ids"]
    assert format_prompt(tok, "Q: 1+1=?\nA:", False) == "Q: 1+1=?\nA:"
    with pytest.raises(DeltalensError, match="need the chat template"):
        format_prompt(tok, p.chat(), False)


def test_every_path_encodes_the_same_ids(chat_model):
    from deltalens.analysis.diversity import encode_prompts as diversity_encode
    from deltalens.training.es.config import ESConfig
    from deltalens.training.es.engine import ESEngine
    from deltalens.training.es.strategy import iteration_problems

    model, tok = chat_model
    task = get_task("add:shots=1")
    problems = task.test(3)
    want = encode_prompts(tok, [p.chat() for p in problems], True)
    assert HFBackend(model, tok).encode(problem_prompts(problems, True)) == want
    assert diversity_encode(tok, problem_prompts(problems, True)) == want
    eng = ESEngine(model, tok, task, ESConfig(population=2, prompts_per_iteration=2, max_new_tokens=2))
    assert eng.generator.chat and eng.generator.encode(problem_prompts(problems, eng.generator.chat)) == want
    # what the ES engine sends (one by one and population-batched) for an iteration's problems
    seen = []
    original = eng.generator.encode
    eng.generator.encode = lambda prompts: seen.append(original(prompts)) or seen[-1]
    probs = iteration_problems(task, eng.config, 1)
    eng.evaluate_members(1, [0], probs)
    from deltalens.training.es.population import evaluate_batched

    eng.config.population_batch = 2
    evaluate_batched(eng, 1, [0, 1], probs, {"generation_s": 0.0, "noise_s": 0.0, "perturb_restore_s": 0.0})
    target = encode_prompts(tok, [p.chat() for p in probs], True)
    assert seen[0] == target and seen[-1] == target
    off = ESEngine(model, tok, task, ESConfig(population=2, prompts_per_iteration=2, chat_template="off"))
    assert not off.generator.chat
    eng.close()
    off.close()


def test_grpo_dataset_uses_the_chat_form(chat_model):
    pytest.importorskip("datasets")
    from deltalens.training.grpo.config import GRPOConfig
    from deltalens.training.grpo.train import build_dataset

    task = get_task("add:shots=1")
    ds = build_dataset(task, GRPOConfig(prompts_per_step=2, num_generations=2), 1, 1, chat=True)
    _, tok = chat_model
    rendered = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in ds["prompt"]]
    assert rendered[0].startswith("<user>What is") and rendered[0].endswith("<assistant>")
    assert rendered[0].count("<user>") == 2  # the few-shot turn, then the question
