"""Verifier and reward cases: right, wrong, malformed and tricky formats; split hygiene."""

import hashlib
import random

import pytest

from deltalens.errors import DeltalensError
from deltalens.tasks import (
    AddTask,
    ArithTask,
    CountdownTask,
    GSM8KTask,
    JsonlTask,
    Problem,
    arith_solution,
    final_answer,
    get_task,
    lenient_number,
    normalize_number,
    parse_spec,
)


@pytest.mark.parametrize("text,want", [("1,234", "1234"), ("$5.00", "5"), ("-3.", "-3"), ("0.50", "0.5"),
                                       (" 42 ", "42"), ("abc", None), ("", None), ("4 5", None), (None, None)])
def test_normalize_number(text, want):
    assert normalize_number(text) == want


def test_final_answer_takes_first_marker():
    assert final_answer("blah\n#### 17\n#### 3") == "17"
    assert final_answer("no marker") is None


@pytest.mark.parametrize("completion,score", [
    (" 12-35=-23. -23+40=17.\n#### 17", 1.0),
    ("#### 17", 1.0),
    ("#### 1,7", 1.0),  # commas stripped (GSM8K style)
    ("#### 18", 0.1),  # well formatted, wrong
    ("the answer is 17", 0.0),  # no marker: malformed
    ("#### seventeen", 0.0),
    ("#### ", 0.0),
])
def test_arith_scoring(completion, score):
    assert ArithTask().score(completion, "17") == score


def test_reward_fn_scores_only_completions_trl_interface():
    task = ArithTask()
    fn = task.reward_fn()
    # the prompt contains a correct-looking marker; only the completion may be scored
    prompts = ["#### 17 Q: 10+7=?\nA:"] * 2
    assert fn(prompts=prompts, completions=["#### 17", "nothing"], answer=["17", "17"]) == [1.0, 0.0]
    # conversational completions (TRL passes message lists)
    assert fn(prompts=prompts, completions=[[{"role": "assistant", "content": "#### 17"}]], answer=["17"]) == [1.0]


def test_arith_solutions_are_correct_for_every_strategy():
    rng = random.Random(0)
    task = ArithTask()
    for _ in range(200):
        terms, value = task._draw(rng)
        for strat in ("ltr", "pos", "grouped"):
            sol = arith_solution(terms, strat)
            assert task.verify(sol, str(value)), (terms, strat, sol)
            for step in sol.split("\n")[0].split(". "):
                lhs, rhs = step.rstrip(".").strip().split("=")
                assert eval(lhs) == int(rhs)  # every worked step is arithmetically right


def test_arith_splits_do_not_overlap_and_are_seeded():
    a, b = ArithTask(seed=0), ArithTask(seed=0)
    assert [p.prompt for p in a.test(50)] == [p.prompt for p in b.test(50)]
    test = {p.prompt for p in a.test()}
    assert len(test) == a.n_test
    train = a.train(3000, random.Random(1))
    assert not test & {p.prompt for p in train}
    assert ArithTask(seed=1).test(5) != a.test(5)
    # several strategies in use, and some problems go negative left-to-right
    assert {p.meta["strategy"] for p in train} == {"ltr", "pos", "grouped"}
    assert 0.05 < sum(p.meta["ltr_negative"] for p in train) / len(train) < 0.5


def test_held_out_variants_differ():
    long, big = get_task("arith-long"), get_task("arith-big")
    assert long.test(1)[0].prompt.count("+") + long.test(1)[0].prompt.count("-") == 5
    assert all(int(x) >= 100 for x in big.test(1)[0].prompt[3:].split("=")[0].replace("-", "+").split("+"))


def test_countdown_verifier():
    task = CountdownTask()
    p = Problem("Numbers: 3 5 2 4. Target: 12.\nA:", "12", meta={"numbers": [3, 5, 2, 4]})
    assert task.score_problem("#### (3+5)*2-4", p) == 1.0
    assert task.score_problem("#### 3*4", p) == 0.1  # right value, numbers not all used
    assert task.score_problem("#### (3+5)*2-4-0", p) == 0.1  # an extra number
    assert task.score_problem("#### 3+5+2+4", p) == 0.1  # wrong value
    assert task.score_problem("#### __import__('os')", p) == 0.0  # not arithmetic: never evaluated
    assert task.score_problem("#### 3/0+5+2+4", p) == 0.0
    assert task.score_problem("no answer", p) == 0.0
    fn = task.reward_fn()
    assert fn(prompts=[p.prompt], completions=["#### (3+5)*2-4"], answer=["12"]) == [1.0]
    for q in task.test(50):
        assert task.score_problem(q.solution, q) == 1.0, q


def test_gsm8k_and_jsonl_from_files(tmp_path):
    f = tmp_path / "qa.jsonl"
    f.write_text('{"question": "2+2?", "answer": "So 4.\\n#### 1,004"}\n{"question": "x", "answer": "#### 7"}\n')
    g = GSM8KTask(f)
    assert [p.answer for p in g.test()] == ["1004", "7"]
    assert g.verify("... #### 1004", "1004") and g.verify("#### 1,004", "1004")
    j = JsonlTask(f, question_field="question", answer_field="answer")
    assert j.test()[0].prompt.startswith("Question: 2+2?")
    with pytest.raises(DeltalensError, match="missing field"):
        JsonlTask(f, question_field="q").test()
    with pytest.raises(DeltalensError, match="no such file"):
        get_task("jsonl", data=str(tmp_path / "nope.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(DeltalensError, match="bad.jsonl:1"):
        JsonlTask(bad).test()


def test_real_gsm8k_if_present():
    from pathlib import Path

    d = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
    if not (d / "test.jsonl").exists():
        pytest.skip("GSM8K not found at ../shared/data/gsm8k (only present in the project's CI and dev machines)")
    t = get_task("gsm8k", data=str(d))
    probs = t.test()
    assert len(probs) == 1319
    assert all(normalize_number(p.answer) is not None for p in probs)


def test_unknown_task():
    with pytest.raises(DeltalensError, match="unknown task"):
        get_task("nope")


# ---------------------------------------------------------------------------- splits, specs, chat forms



def _digest(problems) -> str:
    return hashlib.sha256("\n".join(p.prompt + "=" + p.answer for p in problems).encode()).hexdigest()[:16]


@pytest.mark.parametrize("spec", ["arith", "add", "add:digits=1-3,terms=3,ops=+-*", "countdown"])
def test_splits_are_disjoint_and_the_stream_avoids_them(spec):
    task = get_task(spec)
    test, val = task.test(), task.validation()
    assert len(test) == len(val) == 500
    assert not {p.prompt for p in test} & {p.prompt for p in val}
    train = task.train(2000, random.Random(7))
    assert not {p.prompt for p in train} & ({p.prompt for p in test} | {p.prompt for p in val})


# Pinned: a change of these digests changes every figure measured on these splits (say so in docs/). The arith
# and countdown test digests are those of deltalens before validation splits existed (same test problems).
PINNED = {
    "arith": ("b230f1cae1f18a1a", "3656cd4204744fc2"),
    "add": ("a2f3fc6268e68f74", "7109b24b481d5a11"),
    "countdown": ("50732e9294a3fc70", "96cc0ebc99f27f15"),
}


@pytest.mark.parametrize("spec", list(PINNED))
def test_splits_are_stable_across_versions(spec):
    task = get_task(spec)
    want_test, want_val = PINNED[spec]
    got = (_digest(task.test(20)), _digest(task.validation(20)))
    assert got == (want_test, want_val)


def test_arith_test_split_is_the_one_earlier_versions_reported():
    # the first test problems of `arith` (seed 0) as every earlier deltalens version drew them
    assert [p.prompt for p in get_task("arith").test(3)] == [p.prompt for p in ArithTask(seed=0).test(3)]


@pytest.mark.parametrize("completion,want", [
    ("The answer is 42.", "42"), ("So 40 + 2 = 42", "42"), ("\\boxed{1,234}", "1234"), ("**Answer:** 42", "42"),
    ("It is 42 apples, I think.", "42"), ("The result is -7.", "-7"), ("$12.00", "12"), ("no number here", None),
    ("First 3, then 5, finally 8\nDone", "8"),
])
def test_lenient_answers_read_what_chat_models_write(completion, want):
    assert lenient_number(completion) == want


@pytest.mark.parametrize("completion,score", [
    ("#### 68", 1.0), ("23 + 45 = 68", 1.0), ("The answer is 68.", 1.0), ("\\boxed{68}", 1.0),
    ("#### 67", 0.1),  # the stated format, wrong: the paper's 0.1
    ("The answer is 67.", 0.0),  # wrong and not in the stated format: 0
    ("#### 67\nActually it is 68", 0.1),  # the stated answer counts, not a later number
    ("nothing", 0.0),
])
def test_add_reward_is_correct_or_formatted(completion, score):
    assert AddTask().score(completion, "68") == score


def test_task_specs_and_options():
    assert parse_spec("add:digits=1-3, terms=3") == ("add", {"digits": "1-3", "terms": "3"})
    t = get_task("add:digits=3,terms=3,ops=-+")
    assert t.name == "add:digits=3,terms=3,ops=+-" and t.terms == 3 and t.digits == (3, 3)
    q = t.test(1)[0]
    assert q.prompt.startswith("Q: What is ") and str(eval(q.meta["expr"])) == q.answer
    for bad, msg in [("add:size=3", "has no option 'size'"), ("add:digits", "must be key=value"),
                     ("add:terms=x", "not a valid int"), ("add:ops=/", "ops must be"), ("add:digits=0", "between 1"),
                     ("arith:lenient=maybe", "not a valid _bool")]:
        with pytest.raises(DeltalensError, match=msg):
            get_task(bad)
    assert get_task("arith:lenient=true").score("the answer is 17", "17") == 1.0  # strict by default


def test_few_shot_examples_are_prior_turns_or_prefixed_text():
    t = get_task("add:shots=2")
    p = t.test(1)[0]
    msgs = p.chat()
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant", "user"]
    assert msgs[1]["content"].endswith(f"#### {t.examples()[0].answer}") and "What is" in msgs[-1]["content"]
    assert p.prompt.count("Q: What is") == 3 and p.prompt.endswith(get_task("add").test(1)[0].prompt)
    shots = {e.prompt for e in t.examples()}
    assert not shots & {q.prompt for q in get_task("add").test()}  # examples come from the training stream
    assert get_task("arith").test(1)[0].chat() == [
        {"role": "user", "content": get_task("arith").chat_question(get_task("arith").test(1)[0])}]


def test_jsonl_splits(tmp_path):
    f = tmp_path / "qa.jsonl"
    f.write_text("".join(f'{{"question": "q{i}?", "answer": "#### {i}"}}\n' for i in range(10)))
    with pytest.raises(DeltalensError, match="is a test set"):
        JsonlTask(f).train(2, random.Random(0))  # a single file is never trained on
    d = tmp_path / "ds"
    d.mkdir()
    (d / "test.jsonl").write_text(f.read_text())
    (d / "train.jsonl").write_text("".join(f'{{"question": "t{i}?", "answer": "#### {i}"}}\n' for i in range(20)))
    g = GSM8KTask(d, n_validation=5)
    val, train = g.validation(), g.train(200, random.Random(0))
    assert len(val) == 5 and not {p.prompt for p in val} & {p.prompt for p in train}
    assert len({p.prompt for p in train}) == 15


def test_small_problem_space_refused_not_looping():
    """add:digits=1,terms=2 has 100 problems: 500 test + 500 validation cannot be drawn (it used to loop
    forever); smaller splits work, leave half the space to training, and keep the test prefix stable."""
    with pytest.raises(DeltalensError, match="only 100 distinct problems.*test=25,validation=25"):
        get_task("add:digits=1,terms=2")
    t = get_task("add:digits=1,terms=2,test=25,validation=25")
    test, val = t.split("test"), t.split("validation")
    assert len(test) == len(val) == 25 and not {p.prompt for p in test} & {p.prompt for p in val}
    assert [p.prompt for p in test[:10]] == [p.prompt for p in get_task("add:digits=1,terms=2,test=10,validation=10")
                                             .split("test")]
    assert get_task("add:digits=1-2,terms=3,ops=+-").n_distinct() == 100 ** 3 * 4


def test_draw_backstop_for_tasks_without_a_size(monkeypatch):
    """A synthetic task that cannot make enough distinct problems fails with one line, not a hang."""
    from deltalens.tasks import base

    monkeypatch.setattr(base, "MAX_DRAWS", 50)
    t = get_task("add:digits=1,terms=2,test=25,validation=25")
    monkeypatch.setattr(type(t), "n_distinct", lambda self: None)
    t.n_test = 200
    t.__dict__.pop("_raw", None)
    with pytest.raises(DeltalensError, match="could not be drawn"):
        t.split("test")


@pytest.mark.parametrize("spec, want", [
    ("arith", "arith"),
    ("add:digits=1-2,terms=2,shots=2", "add:digits=1-2,terms=2,ops=+,shots=2"),
    ("add:shots=1,lenient=yes", "add:digits=2,terms=2,ops=+,lenient=true,shots=1"),
    ("countdown:numbers=3", "countdown:numbers=3"),
])
def test_spec_records_every_option(spec, want):
    """Results and cache keys record `task.spec`: it names shots/lenient/sizes (which `name` omits) and
    rebuilds the same task (same prompts)."""
    t = get_task(spec)
    assert t.spec == want
    again = get_task(t.spec)
    assert again.spec == want
    assert [p.chat() for p in again.test(3)] == [p.chat() for p in t.test(3)]
    assert get_task("add:shots=1").spec != get_task("add").spec
