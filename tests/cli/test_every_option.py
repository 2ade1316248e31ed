"""Every option of every command, table-driven (issue #31): documented, routed, refused where unused.

The tests walk the CLI's command tree (as tests/cli/test_output_guard.py does) and, for every command and
option:

- it has a help line (`test_every_option_has_a_help_line`);
- it is routed: given a value on the command line, that value reaches the library call the command makes
  (the heavy entry points are replaced by recording fakes, so no model loads) or the file it names is
  written (`test_every_option_is_routed`). ROUTES says, per (command, option), what to pass and where the
  value must arrive; an option the tree has and ROUTES lacks fails `test_every_option_has_a_route`, so a
  new option cannot go untested, and a command that stops passing a value on fails its route;
- an option that means nothing in a combination (a `needs` rule of its config) is refused with exit 2
  and one `error:` line (`test_unused_options_are_refused`); NEEDS lists the rules, so dropping one fails;
- `--config FILE` is a YAML file of the command's options on every command that has options: its values
  arrive, unknown keys are refused, and an architecture there (the old meaning) is refused pointing at --arch;
- one name for one thing (`test_same_name_same_thing`): --k, --out (-o), --config, --arch, --seeds, with the
  old names (--ks, --output) still accepted.

The options generated from the training and study configs (`train`, `sweep`, `study`) are routed
generically: each must reach the options dict the command hands on (`given`), by its field name
(`test_generated_options_are_routed`); every other option of those commands (run options, the sweep's own,
--out, --config) has its route in ROUTES, as every option of the other commands has.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import cli_commands, run_cli, tiny_spec

from deltalens.analysis.options import DiffConfig, DiversityConfig, ProbeConfig, ReportConfig, SparsifyConfig
from deltalens.config import NOT_NONE, flag_name
from deltalens.errors import DeltalensError
from deltalens.evaluation.options import SHARED, EvalConfig
from deltalens.tiny import MODEL_DIR

CONFIGS = {"eval": EvalConfig, "report": ReportConfig, "diff": DiffConfig, "sparsify": SparsifyConfig,
           "diversity": DiversityConfig, "probe": ProbeConfig}


def tree() -> dict[str, dict[str, object]]:
    """command path -> {first option name: click parameter} for every option (--help aside)."""

    return {name: {p.opts[0]: p for p in cmd.params if p.param_type_name == "option" and p.name != "help"}
            for name, cmd in cli_commands()}


TREE = tree()


def test_every_option_has_a_help_line():
    bare = [f"{c} {o}" for c, opts in TREE.items() for o, p in opts.items()
            if len((p.help or "").replace("\\[", "[").split("[default:")[0].strip()) < 8]
    assert not bare, f"options without a help line: {bare}"
    assert {"eval", "report", "diff", "sparsify", "diversity", "probe", "train es", "study", "sweep es", "demo",
            "render"} <= set(TREE)


# ------------------------------------------------------------------ one option system


@pytest.mark.parametrize("name", CONFIGS)
def test_shared_options_are_declared_once(name):
    """A field named like a shared option has that option's type (or it, optional) and flags, and the help
    or default it states differs from SHARED's only where it declares so (`shared(...)`)."""
    cls = CONFIGS[name]
    types = cls.types()
    for f in dataclasses.fields(cls):
        if f.name not in SHARED:
            continue
        tp, _, _, extra = SHARED[f.name]
        assert types[f.name] in (tp, tp | None), f"{name}.{f.name}: {types[f.name]} is not SHARED's {tp}"
        assert f.metadata["flags"] == extra.get("flags", ()), f"{name}.{f.name}"


# commands with a YAML file of options (--config): every command with options but these
NO_CONFIG = {"train resume", "study scale", "study verify", "study merge", "render", "models list", "models fetch"}
# the option a command writes its output (a directory, or render's HTML file) to: --out, with -o; sparsify's --out
# is an extra (its sparsified checkpoints), so no -o
OUT = {"report", "render", "study", "study merge", "demo", "sweep es", "sweep grpo", "train es", "train grpo", "train chain",
       "sparsify"}


def _names(cmd: str) -> dict[str, set[str]]:
    """Every name of every option of `cmd` -> all names of that option."""
    return {n: {*p.opts, *p.secondary_opts} for p in TREE[cmd].values() for n in (*p.opts, *p.secondary_opts)}


@pytest.mark.parametrize("cmd", sorted(TREE))
def test_same_name_same_thing(cmd):
    """On every command: `--k` (--ks only as its old name), `--out`/-o for what it writes (--output only as its old
    name), `--config` for a YAML file of options, `--arch` for an architecture (the analysis commands)."""
    names = _names(cmd)
    first = set(TREE[cmd])  # every option's main name
    assert not {"--ks", "--output"} & first, cmd  # old names: never an option's main name
    assert ("--config" in names) == (cmd not in NO_CONFIG), cmd
    assert ("--k" in names) == (cmd in ("eval", "report", "sparsify", "study")), cmd
    if "--ks" in names:
        assert names["--ks"] == {"--k", "--ks"}, cmd
    assert ("--out" in names) == (cmd in OUT), cmd
    if "-o" in names or "--output" in names:
        assert "--out" in (names.get("-o", set()) | names.get("--output", set())), cmd
    if cmd in CONFIGS:
        assert ("--arch" in names) == (cmd != "probe"), cmd
        if "--compute-dtype" not in names:
            assert cmd == "diff", cmd  # every command that generates has it
    else:
        assert "--arch" not in names, cmd  # study, sweep, train take their model as a model spec


def test_same_option_same_names():
    """An option that several commands have has the same names on each (`--samples`/-n, `--task`/-t, ...)."""
    seen: dict[str, tuple[str, frozenset]] = {}
    for cmd in TREE:
        for name, all_names in _names(cmd).items():
            if not name.startswith("--") or name == "--help":
                continue
            short = frozenset(n for n in all_names if not n.startswith("--"))
            other = seen.setdefault(name, (cmd, short))
            assert other[1] == short or name in SHORT_DIFFERS, (name, other, (cmd, short))


# long names whose short alias differs between commands (why)
SHORT_DIFFERS = {
    "--out": "-o everywhere, but sparsify's --out is not its output (its sparsified checkpoints) and takes none",
    "--output": "the old name of --out",
    # two things under one name (deltalens.analysis.options, deltalens.training.*.config; not the CLI's to rename):
    # diversity's held-out prompts (-p) and training's prompts per iteration (an extra name of --prompts-per-iteration)
    "--prompts": "diversity's -p prompts are held-out prompts, training's --prompts are prompts per iteration",
}


# ------------------------------------------------------------------ the fakes


@dataclass
class Call:
    args: tuple
    kwargs: dict


class Seen(dict):
    """name -> the last Call of that fake."""

    def kw(self, name: str, key: str):
        return self[name].kwargs[key]


def _eval_doc(specs, task, **kw):
    row = {"n_problems": 1, "chat_template": False, "pass_at_k": {"1": 0.5}, "pass_at_k_se": {"1": None},
           "maj_at_k": {}, "mean_reward": 0.0, "format_rate": 0.0, "timing": {"generate_s": 0.0}}
    return {"evals": {lab: dict(row) for lab in (kw.get("labels") or ["m"])}}


PROBE_RES = {"pass_at_k": {"1": 0.5}, "greedy_pass_at_1": 0.0, "mean_reward": 0.0, "format_rate": 0.0,
             "grpo": {"share_with_signal": 0.0}, "es": None, "n_problems": 1, "chat_template": False,
             "verdict": "fake"}
TRAINED = ["p1", "p2"]  # the problems of the fake `trained_problems`


class FakeEngine:
    closed = False

    def close(self):
        self.closed = True


@pytest.fixture
def seen(monkeypatch) -> Seen:
    """Every library entry point of the commands replaced by a fake that records its call."""
    import deltalens.cli.diff
    import deltalens.cli.diversity
    import deltalens.cli.study
    import deltalens.cli.sweep
    import deltalens.cli.train
    import deltalens.reports

    import deltalens.analysis.delta
    import deltalens.analysis.diversity
    import deltalens.analysis.probe
    import deltalens.analysis.report
    import deltalens.analysis.sparsify
    import deltalens.demo
    import deltalens.evaluation
    import deltalens.generation
    import deltalens.generation.vllm
    import deltalens.study.merge
    import deltalens.study.run
    import deltalens.study.scale
    import deltalens.study.sweep
    import deltalens.study.verify
    import deltalens.training.launch
    import deltalens.training.trained
    from deltalens.tasks import get_task

    tiny_spec()
    s = Seen()

    def fake(name, result=None):
        def f(*args, **kwargs):
            s[name] = Call(args, kwargs)
            return result(*args, **kwargs) if callable(result) else result
        return f

    def sparsify_analysis(base, ckpt, taus, evaluate, **kw):
        evaluate({})  # one evaluation: what the command passes on to evaluate_state_dict
        return {"sparsify": {}}

    def render_report(doc, path):
        Path(path).write_text("<html></html>")

    monkeypatch.setattr(deltalens.evaluation, "evaluate_models", fake("evaluate_models", _eval_doc))
    monkeypatch.setattr(deltalens.training.trained, "trained_problems",
                        fake("trained_problems", lambda run: (get_task("arith"), TRAINED)))
    monkeypatch.setattr(deltalens.analysis.report, "build_analysis", fake("build_analysis", {"schema_version": 1}))
    monkeypatch.setattr(deltalens.reports, "render_report", fake("render_report", render_report))
    monkeypatch.setattr(deltalens.reports, "render_file", fake("render_file", lambda src, out=None: Path("x.html")))
    monkeypatch.setattr(deltalens.analysis.delta, "diff_analysis", fake("diff_analysis", {"diff": {}, "ratios": []}))
    monkeypatch.setattr(deltalens.cli.diff, "write_csv", fake("write_csv"))
    monkeypatch.setattr(deltalens.analysis.sparsify, "sparsify_analysis",
                        fake("sparsify_analysis", sparsify_analysis))
    monkeypatch.setattr(deltalens.evaluation, "evaluate_state_dict", fake("evaluate_state_dict", {}))
    monkeypatch.setattr(deltalens.generation.vllm, "import_vllm", fake("import_vllm"))
    monkeypatch.setattr(deltalens.generation.vllm, "check_weight_loading", fake("check_weight_loading"))
    monkeypatch.setattr(deltalens.generation, "backend_for_spec",
                        fake("backend_for_spec", lambda *a, **k: (FakeEngine(), None, None)))
    monkeypatch.setattr(deltalens.analysis.diversity, "diversity_analysis",
                        fake("diversity_analysis", {"diversity": {"m": {}}}))
    monkeypatch.setattr(deltalens.cli.diversity, "_summary", lambda *a: "")
    monkeypatch.setattr(deltalens.cli.diversity, "_plan_line", lambda *a, **k: "")
    monkeypatch.setattr(deltalens.analysis.probe, "probe", fake("probe", PROBE_RES))
    monkeypatch.setattr(deltalens.demo, "run_demo", fake("run_demo", {
        "evals": {"base": {"task": "arith", "n_problems": 1, "samples": 1, "pass_at_k": {"1": 0.5}}},
        "diff": {}, "study": {"seconds": 0}}))
    monkeypatch.setattr(deltalens.cli.study, "show", fake("show"))
    monkeypatch.setattr(deltalens.study.run, "run_study", fake("run_study", {}))
    monkeypatch.setattr(deltalens.study.sweep, "run_sweep", fake("run_sweep", {}))
    monkeypatch.setattr(deltalens.cli.sweep, "show", fake("show_sweep"))
    monkeypatch.setattr(deltalens.training.launch, "start", fake("start", lambda *a, out=None, **k: out or "run"))
    monkeypatch.setattr(deltalens.training.launch, "resume_run", fake("resume_run", lambda d, **k: d))
    monkeypatch.setattr(deltalens.cli.train, "summary", fake("summary"))
    monkeypatch.setattr(deltalens.study.scale, "scale_analysis", fake("scale_analysis", {"models": []}))
    monkeypatch.setattr(deltalens.cli.study, "show_scale", fake("show_scale"))
    monkeypatch.setattr(deltalens.study.verify, "verify", fake("verify", {"ok": True}))
    monkeypatch.setattr(deltalens.cli.study, "show_verify", fake("show_verify"))
    monkeypatch.setattr(deltalens.study.merge, "merge", fake("merge", ({}, [])))
    monkeypatch.setattr(deltalens.study.run, "write_study", fake("write_study"))
    return s


@pytest.fixture
def files(tmp_path) -> dict[str, Path]:
    """Inputs the routes name: a jsonl task file (default fields, and q/a fields), a bare weights file, an
    analysis.json, and a directory for outputs."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(30)))
    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps({"q": f"{i}+2", "a": str(i + 2)}) + "\n" for i in range(30)))
    (tmp_path / "bare").mkdir()
    weights = Path(shutil.copy(MODEL_DIR / "model.safetensors", tmp_path / "bare" / "w.safetensors"))
    analysis = tmp_path / "analysis.json"
    analysis.write_text(json.dumps({"schema_version": 1}))
    return {"data": data, "qa": qa, "weights": weights, "analysis": analysis, "out": tmp_path / "out"}


# ------------------------------------------------------------------ routes


def _from(task, question: str) -> bool:
    """The Task's problems come from the jsonl file whose first question is `question`."""
    return any(p.meta.get("question") == question for p in task.test(None))


@dataclass(frozen=True)
class Route:
    """`args`: what to add to the command's own (f-strings of the `files` names: {data}, {out}/x.json, ...);
    `check(seen, files)`: the value arrived. `refused`: instead, the option is declared but not passed on
    yet: it is refused with this text."""

    args: tuple[str, ...]
    check: Callable[[Seen, dict], bool] | None = None
    refused: str | None = None


def R(*args: str, check=None, refused=None) -> Route:
    return Route(tuple(args), check, refused)


def kw(name: str, key: str, value) -> Callable[[Seen, dict], bool]:
    return lambda s, f: s.kw(name, key) == value


def wrote(name: str) -> Callable[[Seen, dict], bool]:
    return lambda s, f: (f["out"] / name).is_file()


EM, BA, EV, PR, DA = "evaluate_models", "build_analysis", "evaluate_state_dict", "probe", "diversity_analysis"
TASK = ("--task", "arith")  # a report evaluates (and so uses its evaluation options) only with a task

BASE_ARGS: dict[str, list[str]] = {
    "eval": ["eval", "tiny"], "report": ["report", "tiny", "tiny", "--out", "{out}/report"],
    "diff": ["diff", "tiny", "tiny"], "sparsify": ["sparsify", "tiny"], "diversity": ["diversity", "tiny"],
    "probe": ["probe", "tiny"], "demo": ["demo", "--out", "{out}/demo"], "render": ["render", "{analysis}"],
    "study scale": ["study", "scale", "{analysis}"],
    "study verify": ["study", "verify", "{analysis}"],
    "study merge": ["study", "merge", "{analysis}", "{data}"],
    "sweep es": ["sweep", "es", "--model", "tiny", "--grid", "sigma=1e-3", "--out", "{out}/sweep"],
    "sweep grpo": ["sweep", "grpo", "--model", "tiny", "--grid", "lr=1e-6", "--out", "{out}/sweep"],
    "study": ["study", "tiny", "--out", "{out}/study"],
    "train es": ["train", "es", "--out", "{out}/run"], "train grpo": ["train", "grpo", "--out", "{out}/run"],
    "train chain": ["train", "chain", "--out", "{out}/run"], "train resume": ["train", "resume", "{out}/run"],
}

ROUTES: dict[str, dict[str, Route]] = {
    "study scale": {
        "--fraction": R("--fraction", "0.5", check=lambda s, f: s["scale_analysis"].args[1] == 0.5),
        "--json": R("--json", "{out}/scale.json", check=wrote("scale.json")),
    },
    "study merge": {
        "--out": R("--out", "{out}/merged", check=lambda s, f: s["write_study"].args[2] == f["out"] / "merged"
                   and s["merge"].args[0] == [f["analysis"], f["data"]]),
    },
    "study verify": {
        "--json": R("--json", "{out}/verify.json", check=lambda s, f: (f["out"] / "verify.json").is_file()
                    and s["verify"].args[0] == f["analysis"]),
    },
    "eval": {
        "--task": R("--task", "countdown", check=lambda s, f: s[EM].args[1].spec == "countdown"),
        "--samples": R("--samples", "3", "--k", "1", check=kw(EM, "samples", 3)),
        "--k": R("--k", "1,2", check=kw(EM, "ks", [1, 2])),
        "--temperature": R("--temperature", "0.25", check=kw(EM, "temperature", 0.25)),
        "--limit": R("--limit", "3", check=kw(EM, "limit", 3)),
        "--json": R("--json", "{out}/e.json", check=wrote("e.json")),
        "--label": R("--label", "a,b", check=kw(EM, "labels", ["a,b"])),
        "--data": R("--task", "jsonl", "--data", "{data}", check=lambda s, f: _from(s[EM].args[1], "0+1")),
        "--question-field": R("--task", "jsonl", "--data", "{qa}", "--question-field", "q", "--answer-field", "a",
                              check=lambda s, f: _from(s[EM].args[1], "0+2")),
        "--answer-field": R("--task", "jsonl", "--data", "{qa}", "--question-field", "q", "--answer-field", "a",
                            check=lambda s, f: s[EM].args[1].test(1)[0].answer == "2"),
        "--arch": R("--arch", "tiny", check=kw(EM, "config", "tiny")),
        "--dtype": R("--dtype", "bf16", check=kw(EM, "dtype", "bf16")),
        "--compute-dtype": R("--compute-dtype", "bf16", check=kw(EM, "compute_dtype", "bf16")),
        "--max-new-tokens": R("--max-new-tokens", "5", check=kw(EM, "max_new_tokens", 5)),
        "--seed": R("--seed", "7", check=kw(EM, "seed", 7)),
        "--backend": R("--backend", "vllm", check=kw(EM, "backend", "vllm")),
        "--chat-template": R("--chat-template", "off", check=kw(EM, "chat_template", "off")),
        "--split": R("--split", "validation", check=kw(EM, "split", "validation")),
        "--trained-on": R("--trained-on", "{out}/run", check=lambda s, f: s.kw(EM, "problems") == TRAINED
                          and s.kw(EM, "split") == "trained" and s["trained_problems"].args == (str(f["out"] / "run"),)),
        "--device": R("--device", "cpu", check=kw(EM, "device", "cpu")),
        "--log-samples": R("--log-samples", "{out}/s.jsonl",
                           check=lambda s, f: s.kw(EM, "on_samples") is not None and (f["out"] / "s.jsonl").is_file()),
        "--config": R("--config", "{yaml:samples: 5\nk: '1,5'}", check=kw(EM, "samples", 5)),
    },
    "study": {
        "--out": R(check=lambda s, f: Path(s["run_study"].args[1]) == f["out"] / "study"),
        "--config": R("--config", "{yaml:samples: 4\nk: [1, 4]\nseeds: [5]}",
                      check=lambda s, f: (s["run_study"].args[0].samples, s["run_study"].args[0].k,
                                          s["run_study"].args[0].seeds) == (4, (1, 4), (5,))),
    },
    "report": {
        "--out": R(check=lambda s, f: (f["out"] / "report" / "analysis.json").is_file()
                      and (f["out"] / "report" / "report.html").is_file()),
        "--label": R("--label", "x", check=kw(BA, "labels", ["x"])),
        "--task": R(*TASK, check=kw(BA, "task", "arith")),
        "--data": R("--task", "jsonl", "--data", "{data}", check=lambda s, f: s.kw(BA, "data") == str(f["data"])),
        "--samples": R(*TASK, "--samples", "4", check=kw(BA, "samples", 4)),
        "--k": R(*TASK, "--k", "1,4", check=kw(BA, "ks", "1,4")),
        "--temperature": R(*TASK, "--temperature", "0.3", check=kw(BA, "temperature", 0.3)),
        "--limit": R(*TASK, "--limit", "7", check=kw(BA, "limit", 7)),
        "--thresholds": R(*TASK, "--sparsify", "1e-3,2e-3", check=kw(BA, "sparsify", [1e-3, 2e-3])),
        "--sparsity": R(*TASK, "--sparsity", "0.5", check=kw(BA, "sparsity_targets", [0.5])),
        "--diversity": R(*TASK, "--diversity", check=kw(BA, "diversity", True)),
        "--held-out": R(*TASK, "--held-out", "arith-3,arith-long", check=kw(BA, "held_out", ["arith-3", "arith-long"])),
        "--arch": R("--arch", "tiny", check=kw(BA, "arch", "tiny")),
        "--seed": R(*TASK, "--seed", "9", check=kw(BA, "seed", 9)),
        "--no-cache": R("--no-cache", check=kw(BA, "cache_dir", None)),
        "--chat-template": R(*TASK, "--chat-template", "on", check=kw(BA, "chat_template", "on")),
        "--compute-dtype": R(*TASK, "--compute-dtype", "bf16", check=kw(BA, "compute_dtype", "bf16")),
        "--config": R("--config", "{yaml:task: arith\nsamples: 6}", check=kw(BA, "samples", 6)),
    },
    "diff": {
        "--json": R("--json", "{out}/d.json", check=wrote("d.json")),
        "--csv": R("--csv", "{out}/d.csv", check=lambda s, f: s["write_csv"].args[1] == f["out"] / "d.csv"),
        "--tol": R("--tol", "0.01", check=kw("diff_analysis", "tol", 0.01)),
        "--topk": R("--topk", "3", check=kw("diff_analysis", "topk", 3)),
        "--strict": R("--strict", check=kw("diff_analysis", "strict", True)),
        "--label": R("--label", "x", check=lambda s, f: s["diff_analysis"].args[2] == ["x"]),
        "--svd": R("--svd", "2", check=kw("diff_analysis", "svd", 2)),
        "--arch": R("--arch", "tiny", check=kw("diff_analysis", "arch", "tiny")),
        "--config": R("--config", "{yaml:topk: 4}", check=kw("diff_analysis", "topk", 4)),
    },
    "sparsify": {
        "--base": R("--base", "{weights}", "--arch", "tiny",
                    check=lambda s, f: str(s["sparsify_analysis"].args[0]) == str(f["weights"])  # resolved once
                    and s["sparsify_analysis"].args[0].arch.spec == "tiny"),
        "--arch": R("--base", "{weights}", "--arch", "tiny", check=lambda s, f: s[EV].args[0] == "tiny"),
        "--thresholds": R("--thresholds", "1e-3", check=lambda s, f: s["sparsify_analysis"].args[2] == [1e-3]),
        "--sparsity": R("--sparsity", "0.7", check=kw("sparsify_analysis", "sparsities", [0.7])),
        "--task": R("--task", "countdown", check=lambda s, f: s[EV].args[2].spec == "countdown"),
        "--samples": R("--samples", "4", "--k", "1", check=kw(EV, "samples", 4)),
        "--k": R("--k", "1,2", check=kw(EV, "ks", [1, 2])),
        "--temperature": R("--temperature", "0.2", check=kw(EV, "temperature", 0.2)),
        "--limit": R("--limit", "5", check=kw(EV, "limit", 5)),
        "--seed": R("--seed", "3", check=kw(EV, "seed", 3)),
        "--out": R("--out", "{out}/sp", check=lambda s, f: s.kw("sparsify_analysis", "out_dir") == f["out"] / "sp"),
        "--json": R("--json", "{out}/s.json", check=wrote("s.json")),
        "--label": R("--label", "x", check=kw("sparsify_analysis", "label", "x")),
        "--chat-template": R("--chat-template", "off", check=kw(EV, "chat_template", "off")),
        "--backend": R("--backend", "vllm", check=lambda s, f: isinstance(s.kw(EV, "backend"), FakeEngine)),
        "--compute-dtype": R("--compute-dtype", "bf16", check=kw(EV, "compute_dtype", "bf16")),
        "--config": R("--config", "{yaml:samples: 2\nk: '1'}", check=kw(EV, "samples", 2)),
    },
    "diversity": {
        "--task": R("--task", "countdown", check=lambda s, f: s[DA].args[1].spec == "countdown"),
        "--members": R("--members", "3", check=kw(DA, "members", 3)),
        "--sigma": R("--sigma", "0.01", check=kw(DA, "sigma", 0.01)),
        "--iteration": R("--iteration", "2", check=kw(DA, "iteration", 2)),
        "--prompts": R("--prompts", "2", check=kw(DA, "prompts", 2)),
        "--samples": R("--samples", "3", check=kw(DA, "samples", 3)),
        "--temperature": R("--temperature", "0.9", check=kw(DA, "temperature", 0.9)),
        "--sweep": R("--sweep", "1e-3,2e-3", check=kw(DA, "sweep", [1e-3, 2e-3])),
        "--fisher-samples": R("--sweep", "1e-3", "--fisher-samples", "5", check=kw(DA, "fisher_samples", 5)),
        "--max-new-tokens": R("--max-new-tokens", "6", check=kw(DA, "max_new_tokens", 6)),
        "--seed": R("--seed", "4", check=kw(DA, "seed", 4)),
        "--label": R("--label", "x", check=kw(DA, "label", "x")),
        "--data": R("--task", "jsonl", "--data", "{data}", check=lambda s, f: _from(s[DA].args[1], "0+1")),
        "--question-field": R("--task", "jsonl", "--data", "{qa}", "--question-field", "q", "--answer-field", "a",
                              check=lambda s, f: _from(s[DA].args[1], "0+2")),
        "--answer-field": R("--task", "jsonl", "--data", "{qa}", "--question-field", "q", "--answer-field", "a",
                            check=lambda s, f: s[DA].args[1].test(1)[0].answer == "2"),
        "--dtype": R("--dtype", "bf16", check=kw(DA, "dtype", "bf16")),
        # the model is a bare weights file here (MODEL_FOR): --arch is its architecture
        "--arch": R("--arch", "tiny", check=lambda s, f: str(s.kw(DA, "config")) == "tiny"),  # resolved once
        "--json": R("--json", "{out}/v.json", check=wrote("v.json")),
        "--chat-template": R("--chat-template", "on", check=kw(DA, "chat_template", "on")),
        "--compute-dtype": R("--compute-dtype", "bf16", refused="not yet supported by diversity"),
        "--config": R("--config", "{yaml:prompts: 3}", check=kw(DA, "prompts", 3)),
    },
    "probe": {
        "--task": R("--task", "countdown", check=lambda s, f: s[PR].args[1].spec == "countdown"),
        "--split": R("--split", "test", check=kw(PR, "split", "test")),
        "--limit": R("--limit", "9", check=kw(PR, "limit", 9)),
        "--samples": R("--samples", "16", check=kw(PR, "samples", 16)),
        "--group": R("--group", "4", check=kw(PR, "group", 4)),
        "--temperature": R("--temperature", "0.7", check=kw(PR, "temperature", 0.7)),
        "--temperatures": R("--temperatures", "0.5,1.0", check=kw(PR, "temperatures", (0.5, 1.0))),
        "--es-members": R("--es-members", "3", check=kw(PR, "es_members", 3)),
        "--es-prompts": R("--es-prompts", "5", check=kw(PR, "es_prompts", 5)),
        "--es-populations": R("--es-populations", "1", check=kw(PR, "es_populations", 1)),
        "--es-sigma": R("--es-sigma", "0.002", check=kw(PR, "es_sigma", 0.002)),
        "--preset": R("--preset", "paper", check=kw(PR, "es_preset", "paper")),  # tiny's own is tiny
        "--chat-template": R("--chat-template", "off", check=kw(PR, "chat_template", "off")),
        "--max-new-tokens": R("--max-new-tokens", "7", check=kw(PR, "max_new_tokens", 7)),
        # a single jsonl file is a test set only: the probe (validation by default) is pointed at it
        "--data": R("--split", "test", "--task", "jsonl", "--data", "{data}",
                    check=lambda s, f: _from(s[PR].args[1], "0+1")),
        "--question-field": R("--split", "test", "--task", "jsonl", "--data", "{qa}", "--question-field", "q",
                              "--answer-field", "a", check=lambda s, f: _from(s[PR].args[1], "0+2")),
        "--answer-field": R("--split", "test", "--task", "jsonl", "--data", "{qa}", "--question-field", "q",
                            "--answer-field", "a", check=lambda s, f: s[PR].args[1].test(1)[0].answer == "2"),
        "--dtype": R("--dtype", "bf16", check=kw(PR, "dtype", "bf16")),
        "--backend": R("--backend", "vllm", check=kw(PR, "backend", "vllm")),
        "--seed": R("--seed", "5", check=kw(PR, "seed", 5)),
        "--json": R("--json", "{out}/p.json", check=wrote("p.json")),
        "--compute-dtype": R("--compute-dtype", "bf16", check=kw(PR, "compute_dtype", "bf16")),
        "--config": R("--config", "{yaml:group: 4}", check=kw(PR, "group", 4)),
    },
    "demo": {
        "--out": R(check=lambda s, f: s["run_demo"].args[0] == str(f["out"] / "demo")),
        "--budget": R("--budget", "0.5", check=kw("run_demo", "budget", 0.5)),
        "--limit": R("--limit", "4", check=kw("run_demo", "limit", 4)),
        "--samples": R("--samples", "4", check=kw("run_demo", "samples", 4)),
        "--seed": R("--seed", "2", check=kw("run_demo", "seed", 2)),
        "--config": R("--config", "{yaml:budget: 0.25\nsamples: 2}", check=lambda s, f: (
            s.kw("run_demo", "budget"), s.kw("run_demo", "samples")) == (0.25, 2)),
    },
    "render": {
        "--out": R("--out", "{out}/r.html", check=lambda s, f: s["render_file"].args[1] == f["out"] / "r.html"),
    },
    "train resume": {
        "--iterations": R("--iterations", "5", check=lambda s, f: s.kw("resume_run", "given") == {"iterations": 5}),
        "--steps": R("--steps", "6", check=lambda s, f: s.kw("resume_run", "given") == {"steps": 6}),
    },
}
# the run options of `train es|grpo|chain` (their config's options: test_generated_options_are_routed)
TRAIN_RUN = {
    "--out": R(check=lambda s, f: s.kw("start", "out") == f["out"] / "run"),
    "--resume": R("--resume", "{out}/old", check=lambda s, f: s.kw("start", "resume") == f["out"] / "old"),
    "--config": R("--config", "{yaml:seed: 4}", check=lambda s, f: str(s.kw("start", "yaml_path")).endswith(".yaml")),
    "--preset": R("--preset", "paper", check=kw("start", "preset", "paper")),
    "--overwrite": R("--overwrite", check=kw("start", "overwrite", True)),
}
ROUTES.update({"train es": TRAIN_RUN, "train grpo": TRAIN_RUN, "train chain": TRAIN_RUN})


def _ev(name: str, value) -> Callable[[Seen, dict], bool]:
    return lambda s, f: getattr(s.kw("run_sweep", "ev"), name) == value


# the sweep's own options (SweepConfig), --out and --config (its method's options: test_generated_options_are_routed)
SWEEP_OWN = {
    "--out": R(check=lambda s, f: s["run_sweep"].args[3] == f["out"] / "sweep"),
    "--grid": R("--grid", "temperature=0.5,0.75", check=lambda s, f: s["run_sweep"].args[1]["temperature"] == [0.5, 0.75]),
    "--seeds": R("--seeds", "1,2", check=_ev("seeds", (1, 2))),
    "--preset": R("--preset", "paper", check=kw("run_sweep", "preset", "paper")),
    "--val-limit": R("--val-limit", "7", check=_ev("limit", 7)),
    "--val-samples": R("--val-samples", "3", check=_ev("samples", 3)),
    "--val-temperature": R("--val-temperature", "0.3", check=_ev("temperature", 0.3)),
    "--config": R("--config", "{yaml:seeds: [3]\nmax_new_tokens: 9\ncpus_per_run: 2\nray: auto}",
                  check=lambda s, f: s.kw("run_sweep", "ev").seeds == (3,) and s["run_sweep"].args[2]["max_new_tokens"]
                  == 9 and (s.kw("run_sweep", "ray").ray, s.kw("run_sweep", "ray").cpus_per_run) == ("auto", 2.0)),
}
# sweep's Ray options (RayOptions, the study's) arrive at run_sweep (a fake: no executor starts);
# tests/study/test_sweep_ray.py follows them into the executor and every task
def _ray(name: str, value) -> Callable[[Seen, dict], bool]:
    return lambda s, f: getattr(s.kw("run_sweep", "ray"), name) == value


SWEEP_RAY = {
    "--ray": R("--ray", "auto", check=_ray("ray", "auto")),
    "--ray-files": R("--ray", "auto", "--ray-files", "s3://bucket/x", check=_ray("ray_files", "s3://bucket/x")),
    "--cpus-per-run": R("--ray", "auto", "--cpus-per-run", "2", check=_ray("cpus_per_run", 2.0)),
    "--gpus-per-run": R("--ray", "auto", "--gpus-per-run", "1", check=_ray("gpus_per_run", 1.0)),
}
ROUTES.update({"sweep es": {**SWEEP_OWN, **SWEEP_RAY}, "sweep grpo": {**SWEEP_OWN, **SWEEP_RAY}})
# the model argument of a route where the command's usual one does not do (a model with its own config.json
# leaves --arch unused)
MODEL_FOR = {("diversity", "--arch"): "{weights}"}
# commands with no options
NO_OPTIONS = {"models list", "models fetch"}


def _args(words, files: dict, tmp: Path) -> list[str]:
    out = []
    for w in words:
        if w.startswith("{yaml:"):
            p = tmp / f"opts-{len(list(tmp.glob('opts-*')))}.yaml"
            p.write_text(w[len("{yaml:"):-1] + "\n")
            out.append(str(p))
        else:
            out.append(w.format(**{k: str(v) for k, v in files.items()}))
    return out


def test_every_option_has_a_route():
    """Every option of every command is in ROUTES, or generated from a training or study config and routed
    generically (GEN); none is both."""
    generated = {(c, _flag(n, cls)) for c, n, cls in GEN}
    missing = sorted(f"{c} {o}" for c, opts in TREE.items() if c not in NO_OPTIONS
                     for o in opts if o not in ROUTES.get(c, {}) and (c, o) not in generated)
    assert not missing, f"options without a route (add one to ROUTES): {missing}"
    gone = sorted(f"{c} {o}" for c, routes in ROUTES.items() for o in routes if o not in TREE.get(c, {}))
    assert not gone, f"ROUTES lists options the CLI does not have: {gone}"
    both = sorted(f"{c} {o}" for c, o in generated if o in ROUTES.get(c, {}))
    assert not both, f"routed twice: {both}"


CASES = sorted((c, o) for c, routes in ROUTES.items() for o in routes)


@pytest.mark.parametrize("command,option", CASES, ids=[f"{c} {o}" for c, o in CASES])
def test_every_option_is_routed(command, option, seen, files, tmp_path):
    route = ROUTES[command][option]
    files["out"].mkdir(exist_ok=True)
    base = list(BASE_ARGS[command])
    if (command, option) in MODEL_FOR:
        base[1] = MODEL_FOR[(command, option)]
    r = run_cli(_args([*base, *route.args], files, tmp_path))
    if route.refused is not None:
        lines = [ln for ln in r.output.splitlines() if ln.strip()]
        assert r.exit_code == 2 and len(lines) == 1 and route.refused in lines[0], r.output
        return
    assert r.exit_code == 0, r.output
    assert route.check(seen, files), (f"{command} {option}: the value did not arrive",
                                      {k: v.kwargs for k, v in seen.items()})


# ------------------------------------------------------------------ unused options are refused

# (command, option, the option it needs): every `needs` rule of the analysis commands' configs
NEEDS = {
    ("eval", "--device", "--backend"), ("eval", "--compute-dtype", "--backend"),
    ("sparsify", "--compute-dtype", "--backend"), ("probe", "--compute-dtype", "--backend"),
    ("diversity", "--fisher-samples", "--sweep"),
    *(("report", flag_name(f), "--task") for f in ("data", "samples", "k", "temperature", "limit", "thresholds",
                                                   "sparsity", "diversity", "held_out", "seed", "chat_template",
                                                   "compute_dtype")),
}


def _needs() -> list[tuple[str, str, str, object]]:
    out = []
    for cmd, cls in CONFIGS.items():
        for f in dataclasses.fields(cls):
            if f.metadata.get("needs"):
                other, allowed = f.metadata["needs"]
                out.append((cmd, f.name, other, allowed))
    return out


def test_needs_rules_are_the_listed_ones():
    assert {(c, flag_name(n), flag_name(o)) for c, n, o, _ in _needs()} == NEEDS


@pytest.mark.parametrize("command,name,other,allowed", _needs(), ids=[f"{c} --{n}" for c, n, *_ in _needs()])
def test_unused_options_are_refused(command, name, other, allowed, seen, files, tmp_path):
    """Given where its rule fails (the option it needs unset, or another value), the option is refused in one
    line before any work; with the rule holding, it is accepted (its route above)."""
    cls = CONFIGS[command]
    tp = typing.get_args(cls.types()[name]) or (cls.types()[name],)
    value = [] if bool in tp else [{int: "3", float: "0.5"}.get(tp[0], "bf16")]
    # the rule fails: a NOT_NONE option left unset (its default is None), another one set to a value it excludes
    assert allowed is NOT_NONE or "vllm" not in allowed
    fail = [] if allowed is NOT_NONE else [flag_name(other), "vllm"]
    files["out"].mkdir(exist_ok=True)
    r = run_cli(_args([*BASE_ARGS[command], *fail, flag_name(name), *value], files, tmp_path))
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert lines[0].startswith(f"error: {flag_name(name)} is only used when {flag_name(other)}"), lines[0]
    assert not any(k in seen for k in (EM, BA, EV, PR, DA, "sparsify_analysis", "diff_analysis")), "it did work"


# ------------------------------------------------------------------ --config FILE


@pytest.mark.parametrize("command", CONFIGS)
def test_config_is_a_yaml_file_of_options(command, seen, files, tmp_path):
    """An unknown key is refused; an architecture (the old meaning of --config) is refused pointing at --arch;
    the file's values sit under the command line's."""
    base = _args(BASE_ARGS[command], files, tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text("samplez: 3\n")
    cases = {str(bad): f"unknown {command} option(s) 'samplez'", "tiny": "use --arch for an architecture",
             str(MODEL_DIR): "use --arch for an architecture",
             str(MODEL_DIR / "config.json"): "use --arch for an architecture"}
    for value, message in cases.items():
        r = run_cli([*base, "--config", value])
        lines = [ln for ln in r.output.splitlines() if ln.strip()]
        assert r.exit_code == 2 and len(lines) == 1 and message in lines[0], (value, r.output)
    assert not seen


# the commands whose options come from the training, study and demo configs: (base words, the config's name in a
# refusal); none of them has --arch, so a model named by --config is refused as not options
FILE_COMMANDS = {"study": (BASE_ARGS["study"], "study"), "sweep es": (BASE_ARGS["sweep es"], "sweep es"),
                 "sweep grpo": (BASE_ARGS["sweep grpo"], "sweep grpo"), "demo": (BASE_ARGS["demo"], "demo")}


def _one_line(r) -> str:
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.output
    return lines[0]


@pytest.mark.parametrize("command", FILE_COMMANDS)
def test_config_file_of_study_sweep_demo(command, seen, files, tmp_path):
    """--config on study, sweep and demo: an unknown key, a wrong type, a model or a model's config.json are
    refused in one line with exit 2, before any work."""
    words, name = FILE_COMMANDS[command]
    base = _args(words, files, tmp_path)
    cases = {"samplez: 3\n": f"unknown {name} option(s) 'samplez'", "seeds: x\n" if command != "demo" else
             "seed: x\n": "must be an integer (got 'x')", "hidden_size: 8\n": "is a model's or run's config.json"}
    for text, message in cases.items():
        y = tmp_path / "o.yaml"
        y.write_text(text)
        assert message in _one_line(run_cli([*base, "--config", y])), (text, message)
    for value in ("tiny", MODEL_DIR):
        assert f"--config is a YAML file of {name} options, not a model" in _one_line(run_cli([*base, "--config", value]))
    assert not seen


def test_study_config_file(seen, files, tmp_path):
    """A study's YAML: k (or its old name ks, not both) and every option by its flag's name; MODEL stays the
    argument; flags override the file; a value the study refuses names --k, never the old --ks."""
    y = tmp_path / "s.yaml"
    base = _args(BASE_ARGS["study"], files, tmp_path)
    y.write_text("ks: [1, 2]\nsamples: 2\ntemperatures: [0.6, 1.0]\n")
    r = run_cli([*base, "--config", y, "--samples", "4"])
    assert r.exit_code == 0, r.output
    cfg = seen["run_study"].args[0]
    assert (cfg.k, cfg.samples, cfg.temperatures, cfg.model) == ((1, 2), 4, (0.6, 1.0), "tiny")
    y.write_text("k: [1]\nks: [1]\n")
    assert "give k or ks (its old name), not both" in _one_line(run_cli([*base, "--config", y]))
    y.write_text("model: smollm2\n")
    assert "model is the MODEL argument" in _one_line(run_cli([*base, "--config", y]))
    y.write_text("k: [1, 64]\n")
    assert _one_line(run_cli([*base, "--config", y])).startswith("error: --k must lie in 1..--samples")


def test_sweep_config_file(seen, files, tmp_path):
    """A sweep's YAML holds its own options (a grid as a mapping or a list), its method's and Ray's; flags override
    it; a method option it does not use is refused as on the command line."""
    y = tmp_path / "s.yaml"
    y.write_text("grid: {sigma: [1.0e-3, 2.0e-3]}\nseeds: [0, 1]\nval_limit: 9\npreset: paper\nmodel: tiny\n"
                 "iterations: 2\n")
    r = run_cli(["sweep", "es", "--config", y, "--val-limit", "8", "--out", tmp_path / "sw"])
    assert r.exit_code == 0, r.output
    call = seen["run_sweep"]
    assert call.args[1] == {"sigma": [1e-3, 2e-3]} and call.args[2] == {"model": "tiny", "iterations": 2}
    assert (call.kwargs["ev"].seeds, call.kwargs["ev"].limit, call.kwargs["preset"]) == ((0, 1), 8, "paper")
    y.write_text("grid: ['sigma=1e-3,2e-3', 'alpha=1e-3']\n")
    assert run_cli(["sweep", "es", "--config", y, "--out", tmp_path / "sw"]).exit_code == 0
    assert seen["run_sweep"].args[1] == {"sigma": [1e-3, 2e-3], "alpha": [1e-3]}
    y.write_text("gpus_per_run: 1\n")
    assert "--gpus-per-run is only used when --ray" in _one_line(run_cli(["sweep", "es", "--config", y, "--grid",
                                                                          "sigma=1e-3"]))


@pytest.mark.parametrize("command", ["study", "sweep"])
def test_seeds_are_parsed_as_one_option(command, seen, files, tmp_path):
    """study --seeds and sweep --seeds: one type, one parser, the same refusals."""
    base = ["study", "tiny"] if command == "study" else ["sweep", "es", "--grid", "sigma=1e-3"]
    for value, message in (("-1", "error: --seeds must be >= 0 (got -1)"), ("0,0", "error: --seeds must be distinct"),
                           ("a", "error: command line: seeds must be an integer (got 'a')")):
        assert _one_line(run_cli([*base, "--seeds", value, "--out", tmp_path / "o"])).startswith(message), value
    assert not seen


def test_old_names_still_work(seen, files, tmp_path):
    """--ks (study), --output (report, render) and a report YAML's `output` key: accepted as the old names of the
    fields k and out (`option(old=...)`), in YAML and in Python too."""
    from deltalens.analysis.options import ReportConfig
    from deltalens.study.config import StudyConfig

    r = run_cli([*_args(BASE_ARGS["study"], files, tmp_path), "--ks", "1,4", "--samples", "4"])
    assert r.exit_code == 0 and seen["run_study"].args[0].k == (1, 4), r.output
    assert StudyConfig.resolve(yaml={"ks": [1, 4]}).k == (1, 4) and ReportConfig.resolve(yaml={"output": "d"}).out == "d"
    assert StudyConfig.field("k").metadata["old"] == "ks" and ReportConfig.field("out").metadata["old"] == "output"
    r = run_cli(["report", "tiny", "tiny", "--output", tmp_path / "rep"])
    assert r.exit_code == 0 and (tmp_path / "rep" / "report.html").is_file(), r.output
    r = run_cli(["render", files["analysis"], "--output", tmp_path / "r.html"])
    assert r.exit_code == 0 and seen["render_file"].args[1] == tmp_path / "r.html", r.output
    for key in ("out", "output"):
        y = tmp_path / f"{key}.yaml"
        y.write_text(f"{key}: {tmp_path / key}\n")
        r = run_cli(["report", "tiny", "tiny", "--config", y])
        assert r.exit_code == 0 and (tmp_path / key / "report.html").is_file(), r.output


def test_command_line_overrides_the_config_file(seen, files, tmp_path):
    y = tmp_path / "e.yaml"
    y.write_text("samples: 5\nk: '1,5'\nseed: 3\n")
    r = run_cli(["eval", "tiny", "--config", y, "--seed", "4"])
    assert r.exit_code == 0, r.output
    assert (seen.kw(EM, "samples"), seen.kw(EM, "ks"), seen.kw(EM, "seed")) == (5, [1, 5], 4)
    y.write_text("seed: -1\n")
    r = run_cli(["eval", "tiny", "--config", y])
    assert r.exit_code == 2 and "seed must be >= 0" in r.output, r.output


# ------------------------------------------------------------------ generated commands


class Routed(DeltalensError):
    """Raised by the fakes of the generated commands once the options arrived (no training starts)."""


def _value(tp) -> tuple[list[str], object]:
    """(command-line words, the value typer hands on) for a field of type `tp`."""
    args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    if bool in args:
        return [], True
    if int in args and len(args) == 1:
        return ["3"], 3
    if float in args and len(args) == 1:
        return ["0.5"], 0.5
    return ["x1"], "x1"  # str, tuples and float | str (budget): handed on as the text given


def _cls(name: str):
    from deltalens.study.config import StudyConfig
    from deltalens.training.chain import ChainConfig
    from deltalens.training.es.config import ESConfig
    from deltalens.training.grpo.config import GRPOConfig

    return {c.__name__: c for c in (ESConfig, GRPOConfig, ChainConfig, StudyConfig)}[name]


def _generated() -> list[tuple[str, str, str]]:
    """(command, parameter name, config class name) of every option generated from a training or study config:
    a chain's stage options too (parameter es_sigma: --es-sigma)."""
    from deltalens.cli import options as o

    from deltalens.study.config import StudyConfig
    from deltalens.training.chain import CHAIN_OWNED, ChainConfig
    from deltalens.training.es.config import ESConfig
    from deltalens.training.grpo.config import GRPOConfig

    out = []
    for cmd, cls, prefix in (("train es", ESConfig, ""), ("train grpo", GRPOConfig, ""), ("train chain", ChainConfig, ""),
                             ("train chain", ESConfig, "es_"), ("train chain", GRPOConfig, "grpo_"),
                             ("sweep es", ESConfig, ""), ("sweep grpo", GRPOConfig, ""), ("study", StudyConfig, "")):
        for p in o.config_params(cls, prefix=prefix, exclude=CHAIN_OWNED if prefix else ()):
            if _flag(p.name, cls.__name__) in TREE.get(cmd, {}):
                out.append((cmd, p.name, cls.__name__))
    return out


def _split(name: str, cls: str) -> tuple[str, str]:
    """(stage prefix, field name) of a generated parameter: es_sigma of ESConfig on a chain -> ("es_", "sigma")."""
    stage = {"ESConfig": "es_", "GRPOConfig": "grpo_"}.get(cls, "")
    field = name[len(stage):] if stage and name.startswith(stage) and name[len(stage):] in _fields(cls) else name
    return name[:len(name) - len(field)], field


def _fields(cls: str) -> set[str]:
    return {f.name for f in dataclasses.fields(_cls(cls))}


def _flag(name: str, cls: str) -> str:
    """The main flag of a generated parameter: its field's name, stage-prefixed."""
    prefix, field = _split(name, cls)
    return flag_name(field, prefix)


GEN = _generated()


@pytest.mark.parametrize("command,name,cls", GEN, ids=[f"{c} --{n}" for c, n, _ in GEN])
def test_generated_options_are_routed(command, name, cls, monkeypatch, tmp_path):
    """Every option generated from a config field reaches the options the command hands on, by field name (a chain
    stage's under its stage: given["es"]["sigma"])."""
    from deltalens.cli import options as o

    import deltalens.study.sweep
    import deltalens.training.launch
    from deltalens.study.config import StudyConfig

    got = {}

    def start(method, *, given, **kw):
        got.update(given)
        raise Routed("routed")

    def run_sweep(method, grid, given, out, **kw):
        got.update(given)
        raise Routed("routed")

    def resolve(cls_, *, given=None, **kw):
        got.update(given or {})
        raise Routed("routed")

    monkeypatch.setattr(deltalens.training.launch, "start", start)
    monkeypatch.setattr(deltalens.study.sweep, "run_sweep", run_sweep)
    monkeypatch.setattr(StudyConfig, "resolve", classmethod(resolve))
    prefix, field_name = _split(name, cls)
    p = TREE[command][_flag(name, cls)]
    field = next(q for q in o.config_params(_cls(cls), prefix=prefix) if q.name == name)
    words, want = _value(typing.get_args(field.annotation)[0])
    head = {"study": ["study", "tiny"], "sweep es": ["sweep", "es", "--grid", "sigma=1e-3"],
            "sweep grpo": ["sweep", "grpo", "--grid", "lr=1e-6"]}.get(command, command.split())
    r = run_cli([*head, "--out", tmp_path / "o", p.opts[0], *words])
    assert "error: routed" in r.output, r.output
    arrived = got.get(prefix[:-1], {}).get(field_name) if prefix else got.get(name)
    assert arrived == want, (name, got)
