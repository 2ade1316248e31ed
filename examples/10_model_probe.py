"""Before training a model on a task: does it ever earn a reward? (why SmolLM2-135M was not trained)

    python examples/10_model_probe.py --model smollm2                 # ~4 min on 1 CPU thread
    python examples/10_model_probe.py --quick                         # seconds (tests; tiny)

ES z-scores rewards within a population and GRPO within a group: when every response of every member
scores the same (all 0), both updates are exactly zero and training is a no-op. This probe samples a
few prompts per setting and counts correct (reward 1) and well-formatted (`#### n`, reward >= 0.1)
responses, for the prompt styles a user would try first:

  zero-shot          the task's prompt, chat template, greedy
  instruction        + "Write the final answer on the last line as: #### <number>", T=0.6
  3-shot             three solved training problems before the prompt (no chat template), T=0.6
  two-term addition  "What is a+b?" with 2-digit a, b; correct = the last number in the reply

Writes <out>/10_model_probe.json. docs/reproduction.md ("What was not run") has the SmolLM2 table.
"""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C

INSTRUCTION = "Write the final answer on the last line as: #### <number>"


def probe(model, tok, task_name: str, style: str, n_problems: int, samples: int, max_new: int, data=None) -> dict:
    from deltalens.generation import HFBackend, SamplingParams
    from deltalens.tasks import get_task

    chat = style in ("zero-shot", "instruction", "addition")
    be = HFBackend(model, tok, chat_template=chat and tok.chat_template is not None)
    temperature = 0.0 if style == "zero-shot" else 0.6
    n = 1 if style == "zero-shot" else samples
    params = SamplingParams(n=n, temperature=temperature, max_new_tokens=max_new, seed=0)
    if style == "addition":
        rng = random.Random(0)
        pairs = [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(n_problems)]
        outs = be.generate([f"What is {a}+{b}? End with the line: #### <answer>" for a, b in pairs], params)
        correct = sum(bool(nums := re.findall(r"-?\d+", o)) and int(nums[-1]) == a + b
                      for (a, b), oo in zip(pairs, outs) for o in oo)
        formatted = sum("####" in o for oo in outs for o in oo)
        return {"task": "a+b", "style": style, "responses": n_problems * n, "correct": correct,
                "formatted": formatted, "example": outs[0][0][:200]}
    task = get_task(task_name, data=data)
    problems = task.test(n_problems)
    if style == "zero-shot":
        prompts = [p.prompt for p in problems]
    elif style == "instruction":
        prompts = [f"{p.prompt}\n{INSTRUCTION}" for p in problems]
    else:  # 3-shot
        shots = task.train(3, random.Random(1))
        prefix = "".join(f"{s.prompt} {s.solution}\n\n" for s in shots)
        prompts = [prefix + p.prompt for p in problems]
    outs = be.generate(prompts, params)
    if style == "3-shot":  # the model goes on to invent the next problem: judge the first answer only
        outs = [[o.split("\n\n")[0] for o in oo] for oo in outs]
    scores = [task.score_problem(o, p) for oo, p in zip(outs, problems) for o in oo]
    return {"task": task_name, "style": style, "responses": len(scores), "correct": sum(s == 1.0 for s in scores),
            "formatted": sum(s > 0 for s in scores), "example": outs[0][0][:200]}


def main(argv=None) -> dict:
    from deltalens.io.models import load_model

    ap = C.parser(__doc__, seeds="0")
    ap.add_argument("--problems", type=int, default=16, help="prompts per setting (zero-shot: 8)")
    ap.add_argument("--data", default=None, help="GSM8K jsonl file or directory (default: ../shared/data/gsm8k)")
    args = ap.parse_args(argv)
    model, tok = load_model(args.model)
    gsm8k = args.data or str(Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k")
    settings = [("arith", "zero-shot"), ("arith", "instruction"), ("arith-3", "3-shot"), ("arith", "3-shot"),
                ("-", "addition")]
    if Path(gsm8k).exists():
        settings.insert(1, ("gsm8k", "zero-shot"))
    n, samples, max_new = (2, 2, 16) if args.quick else (args.problems, 4, 128)
    rows, results = [], []
    for task_name, style in settings:
        k = n if style != "zero-shot" or args.quick else max(1, n // 2)
        r = probe(model, tok, task_name, style, k, samples, 200 if task_name == "gsm8k" and not args.quick else max_new,
                  data=gsm8k if task_name == "gsm8k" else None)
        C.log(f"{task_name} {style}: {r['correct']}/{r['responses']} correct, {r['formatted']} formatted")
        results.append(r)
        rows.append([r["task"], style, f"{r['correct']} / {r['responses']}", f"{r['formatted']} / {r['responses']}"])
    md = (f"Reward probe of {args.model}\n\n"
          + C.table(["task", "prompt style", "correct", "`####` formatted"], rows))
    result = {"model": args.model, "results": results}
    C.save(args.out, "10_model_probe", result, md)
    return result


if __name__ == "__main__":
    main()
