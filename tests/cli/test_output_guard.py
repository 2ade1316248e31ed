"""Every output of every command goes through the output guard (issue #36, items 1 and 3).

The guard (`deltalens.io.outputs.check_outputs`) refuses an output that would overwrite or write into an
input. These tests walk the CLI's command tree, find every option that names an output path, and point
each one at the inputs of its command in turn: a model directory's weights and config.json, a run's
metrics.jsonl and state.json (or its checkpoints/ for a directory output), a `--data` jsonl file. Each
must be refused with exit 2 and one `error:` line, before any work, leaving every input byte-identical
and nothing new on disk. An output-looking option missing from `OUTPUTS` fails
`test_every_output_option_is_known`, so a new command or option cannot skip the guard unnoticed.

`probe` (which wrote over its inputs before) and its numeric options (`--group 0` was a
ZeroDivisionError) are tested on their own below.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import cli_commands, run_cli, tiny_spec

from deltalens.tiny import MODEL_DIR

ES_FAST = ["--population", "2", "--prompts", "2", "--max-new-tokens", "8", "--eval-every", "0"]

# the messages of the guard's refusals (deltalens.io.outputs._clash): a refusal for another reason (a bad
# suffix, a usage error) does not count as the guard's
GUARD = ("would overwrite the input", "lies inside the input model", "would write into the run", "holds the input")


@dataclass(frozen=True)
class Case:
    """How to run a command with one output option: `model(spec)` gives the arguments with that model as the
    command's input; `data(model_dir, file)`, if the command reads a `--data` file, the arguments with it.
    `directory`: the output is a directory (a run, a study) rather than a file. `skip`: input entries not
    aimed at (with the reason in OUTPUTS)."""

    model: Callable[[str], list] | None
    data: Callable[[str, str], list] | None = None
    directory: bool = False
    skip: tuple[str, ...] = ()


def _plain(cmd: str) -> Case:
    return Case(lambda m: [cmd, m], lambda d, f: [cmd, d, "--task", "jsonl", "--data", f])


def _train(method: str) -> Case:
    return Case(lambda m: ["train", method, "--model", m],
                lambda d, f: ["train", method, "--model", d, "--task", "jsonl", "--data", f], directory=True)


def _sweep(method: str, grid: str) -> Case:
    return Case(lambda m: ["sweep", method, "--model", m, "--grid", grid],
                lambda d, f: ["sweep", method, "--model", d, "--task", "jsonl", "--data", f, "--grid", grid],
                directory=True)


# (command path, output option) -> how to run it; every output option of the CLI must be here
OUTPUTS: dict[tuple[str, str], Case] = {
    ("demo", "--out"): Case(None, directory=True),  # no inputs but the bundled tiny model: test_demo_out
    ("study scale", "--json"): Case(None),  # its inputs are studies' analysis.json: test_study_scale_json
    ("study verify", "--json"): Case(None),  # its input is a study's analysis.json: test_study_verify_json
    ("study merge", "--out"): Case(None),  # its inputs are studies' analysis.json: tests/study/test_merge.py
    ("eval", "--json"): _plain("eval"),
    ("eval", "--log-samples"): _plain("eval"),
    ("probe", "--json"): _plain("probe"),
    ("diversity", "--json"): _plain("diversity"),
    ("diff", "--json"): Case(lambda m: ["diff", "tiny", m]),
    ("diff", "--csv"): Case(lambda m: ["diff", "tiny", m]),
    ("sparsify", "--json"): Case(lambda m: ["sparsify", m, "--base", "tiny"]),
    ("sparsify", "--out"): Case(lambda m: ["sparsify", m, "--base", "tiny"], directory=True),
    # aimed at the inputs' non-.json files only: while -o names the HTML file, a .json name is refused for its
    # suffix (the analysis JSON would go there) before the guard looks
    ("report", "-o"): Case(lambda m: ["report", "tiny", m],
                           lambda d, f: ["report", "tiny", d, "--task", "jsonl", "--data", f],
                           skip=("config.json", "state.json")),
    ("render", "-o"): Case(None),  # its one input is an analysis.json: test_render_output
    ("study", "--out"): Case(lambda m: ["study", m, "--seeds", "0"], directory=True),
    ("train es", "--out"): _train("es"),
    ("train grpo", "--out"): _train("grpo"),
    ("train chain", "--out"): _train("chain"),
    ("sweep es", "--out"): _sweep("es", "sigma=1e-3,2e-3"),
    ("sweep grpo", "--out"): _sweep("grpo", "lr=1e-6,2e-6"),
}
# options still to come (another change adds them): tested once they exist, not required before
PENDING = {("eval", "--log-samples")}
# options that look like outputs by name or help but take no path to write (reason)
NOT_OUTPUTS = {
    ("study", "--held-out"): "task names",
    ("report", "--held-out"): "task names",
    # a choice of logger (none|tensorboard|wandb); what it writes goes inside the run directory the guard checks
    ("study", "--report-to"): "a logger choice",
    ("train chain", "--report-to"): "a logger choice",
    ("train es", "--report-to"): "a logger choice",
    ("train grpo", "--report-to"): "a logger choice",
    ("sweep es", "--report-to"): "a logger choice",
    ("sweep grpo", "--report-to"): "a logger choice",
}

_NAME = re.compile(r"^(-o|--(out|output|json|csv|log|save|write|dump|export)([-_].*)?"
                   r"|--.*[-_](out|output|file|dir|path|json|csv|log))$")
_HELP = re.compile(r"\b(writes?|written|saves?|output|create|dump|export|log(s|ged)?)\b", re.IGNORECASE)
_NUMERIC = {"int", "integer", "float", "bool", "boolean", "integer range", "float range"}


def _type_name(p) -> str:
    t = getattr(p, "type", None)  # click's own parameters
    if t is not None:
        return str(getattr(t, "name", t)).lower()
    bare = getattr(p, "bare_type", None)  # typer's vendored click
    return str(bare() if callable(bare) else bare).lower()


def output_options() -> dict[tuple[str, str], list[str]]:
    """(command, its first option name) -> all its names, for every option that looks like an output path:
    a name like --json/--csv/-o/--out/--log-..., or help that says it writes, saves or creates; flags and
    numbers name no path."""

    found = {}
    for name, cmd in cli_commands():
        for p in cmd.params:
            if p.param_type_name != "option" or p.is_flag or _type_name(p) in _NUMERIC:
                continue
            opts = [*p.opts, *p.secondary_opts]
            if any(_NAME.match(o) for o in opts) or _HELP.search(p.help or ""):
                key = next(((name, o) for o in opts if (name, o) in OUTPUTS or (name, o) in NOT_OUTPUTS),
                           (name, opts[0]))
                found[key] = opts
    return found


FOUND = output_options()


def test_every_output_option_is_known():
    """A new output option (or command) must be added to OUTPUTS, so the tests below aim it at the inputs."""
    unknown = sorted(k for k in FOUND if k not in OUTPUTS and k not in NOT_OUTPUTS)
    assert not unknown, f"output options not in OUTPUTS (add them, and make the command call check_outputs): " \
                        f"{unknown}"
    gone = sorted(k for k in OUTPUTS if k not in FOUND and k not in PENDING)
    assert not gone, f"OUTPUTS lists options the CLI does not have: {gone}"
    assert ("probe", "--json") in FOUND and ("train es", "--out") in FOUND and ("report", "-o") in FOUND


# ------------------------------------------------------------------ inputs


def tree(root: Path) -> dict[str, str]:
    """Every file (its sha256) and directory under `root`: a change, a new file or a new folder shows."""
    out = {}
    for p in sorted(root.rglob("*")):
        out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    return out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """One folder of inputs: `model` (a copy of tiny), `run` (a finished 1-iteration ES run), `data` (a
    jsonl task file), `analysis` (an analysis.json), `config` (a YAML file of train options)."""
    tiny_spec()
    root = tmp_path_factory.mktemp("inputs")
    run = root / "run"
    r = run_cli(["train", "es", "--model", "tiny", "--out", run, "--iterations", "1", *ES_FAST])
    assert r.exit_code == 0, r.output
    model = Path(shutil.copytree(MODEL_DIR, root / "model"))
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(40)))
    analysis = root / "analysis.json"
    analysis.write_text(json.dumps({"schema_version": 1}))
    config = root / "train.yaml"
    config.write_text("population: 2\n")
    return {"root": root, "model": model, "run": run, "data": data, "analysis": analysis, "config": config}


def refused(args, root: Path, *, match=GUARD) -> str:
    """Run the CLI; assert exit 2, exactly one line of output (`error: ...` with one of `match`), no
    traceback, and nothing under `root` changed, added or removed. Returns the line."""
    before = tree(root)
    r = run_cli(args)
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2, r
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    assert "Traceback" not in r.output, r.output
    assert any(m in lines[0] for m in ([match] if isinstance(match, str) else match)), lines[0]
    assert tree(root) == before, "an input was modified or something was left behind"
    return lines[0]


def _targets(case: Case, inp: dict[str, Path]) -> list[tuple[list, Path]]:
    """(arguments before the output option, the output path) for each input the output is aimed at."""
    model, run, data = inp["model"], inp["run"], inp["data"]
    if case.directory:
        on_model = [model / "out", model / "config.json"]
        on_run = [run, run / "checkpoints", run / "checkpoints" / "final"]
    else:
        on_model = [model / "model.safetensors", model / "config.json"]
        on_run = [run / "metrics.jsonl", run / "state.json"]
    out = [(case.model(str(model)), p) for p in on_model if p.name not in case.skip]
    out += [(case.model(str(run)), p) for p in on_run if p.name not in case.skip]
    if case.data is not None:
        out.append((case.data(str(model), str(data)), data))
    return out


TARGETED = sorted(k for k in FOUND if k in OUTPUTS and OUTPUTS[k].model is not None)


@pytest.mark.parametrize("command,option", TARGETED, ids=[f"{c} {o}" for c, o in TARGETED])
def test_every_output_refuses_every_input(inputs, command, option):
    """The output option aimed at each input of its command: refused by the guard, nothing touched."""
    case = OUTPUTS[(command, option)]
    targets = _targets(case, inputs)
    assert len(targets) >= 3
    for args, target in targets:
        line = refused([*args, option, target], inputs["root"])
        assert option in line or (option == "-o" and "--output" in line) or str(target) in line, line


def test_demo_out(inputs):
    """`demo` reads only the bundled tiny model: its --out inside that model is refused."""
    tiny_spec()
    before = tree(MODEL_DIR)
    refused(["demo", "--out", MODEL_DIR / "demo"], inputs["root"], match="lies inside the input model")
    assert tree(MODEL_DIR) == before


def test_render_output(inputs):
    a = inputs["analysis"]
    refused(["render", a, "-o", a], inputs["root"], match="would overwrite the input")


def test_train_out_onto_its_yaml_config(inputs):
    y = inputs["config"]
    refused(["train", "es", "--config", y, "--out", y], inputs["root"], match="would overwrite the input")


# ------------------------------------------------------------------ probe (issue #36 items 1 and 3)


def test_probe_json_never_overwrites_its_inputs(inputs):
    m, run, data, root = inputs["model"], inputs["run"], inputs["data"], inputs["root"]
    line = refused(["probe", m, "--json", m / "model.safetensors"], root, match="lies inside the input model")
    assert line == f"error: --json {m / 'model.safetensors'} lies inside the input model {m}; choose a path " \
                   "outside it"
    refused(["probe", m, "--json", m / "config.json"], root, match="lies inside the input model")
    refused(["probe", m, "--task", "jsonl", "--data", data, "--json", data], root,
            match=f"--json {data} would overwrite the input {data}")
    refused(["probe", run, "--json", run / "metrics.jsonl"], root, match="would write into the run")
    refused(["probe", run, "--json", run / "state.json"], root, match="would write into the run")
    # a bare weight file and the config.json beside it are inputs too
    w = m / "model.safetensors"
    refused(["probe", w, "--json", w], root, match="would overwrite the input")


@pytest.mark.parametrize("args,message", [
    (["--group", "0"], "error: --group must be >= 2 (got 0): a group of one has no spread"),
    (["--group", "1"], "error: --group must be >= 2 (got 1): a group of one has no spread"),
    (["--group", "-3"], "error: --group must be >= 2 (got -3): a group of one has no spread"),
    (["--group", "99", "--samples", "8"], ("error: --group 99 exceeds --samples 8 (groups are cut from each "
                                          "prompt's samples); raise --samples or lower --group")),
    (["--group", "3", "--samples", "8"], ("error: --samples 8 must be a multiple of --group 3 (groups are cut "
                                         "from each prompt's samples)")),
    (["--samples", "0"], "error: --samples must be >= 1 (got 0)"),
    (["--limit", "0"], "error: --limit must be >= 1 (got 0)"),
    (["--temperature", "-1"], "error: --temperature must be a finite number >= 0 (got -1.0); 0 is greedy"),
    (["--temperature", "nan"], "error: --temperature must be a finite number >= 0 (got nan); 0 is greedy"),
    (["--max-new-tokens", "0"], "error: --max-new-tokens must be >= 1 (got 0)"),
    (["--seed", "-1"], ("error: Invalid value for '--seed': Input should be greater than or equal to 0 "
                        "(see `deltalens probe --help`)")),
    (["--chat-template", "maybe"], "error: --chat-template must be auto, on or off (got 'maybe')"),
    (["--backend", "nope"], "error: unknown backend 'nope'; choose one of hf, vllm"),
    (["--es-populations", "-1"], "error: --es-populations must be >= 0 (got -1); 0 skips ES"),
    (["--es-members", "1"], "error: --es-members must be >= 2 (got 1): a population of one has no spread"),
    (["--es-prompts", "0"], "error: --es-prompts must be >= 1 (got 0)"),
    (["--es-sigma", "0"], "error: --es-sigma must be a finite number > 0 (got 0.0); omit it for the preset's"),
    (["--es-sigma", "-1e-3"], ("error: --es-sigma must be a finite number > 0 (got -0.001); omit it for the "
                              "preset's")),
    (["--es-sigma", "inf"], "error: --es-sigma must be a finite number > 0 (got inf); omit it for the preset's"),
])
def test_probe_refuses_bad_numbers_before_any_work(tmp_path, monkeypatch, args, message):
    """One line, exit 2, no traceback, before the task's data is read or a model loads: the --json file is
    never written and the run touches nothing."""
    tiny_spec()
    import deltalens.analysis.probe as probe_mod

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr(probe_mod, "backend_for_spec", no_load)
    monkeypatch.setattr(probe_mod, "load_model", no_load)
    assert refused(["probe", "tiny", "--json", tmp_path / "p.json", *args], tmp_path, match=message) == message


def test_probe_es_options_unused_without_populations(tmp_path, monkeypatch):
    """--es-populations 0 skips ES: its other settings are not checked (and the probe goes on to work)."""
    tiny_spec()
    import deltalens.analysis.probe as probe_mod

    class Stop(Exception):
        pass

    def stop(*a, **k):
        raise Stop

    monkeypatch.setattr(probe_mod, "backend_for_spec", stop)
    with pytest.raises(Stop):
        run_cli(["probe", "tiny", "--es-populations", "0", "--es-members", "1", "--limit", "2", "--samples", "2",
                 "--group", "2"])


def test_study_scale_json(inputs, tmp_path):
    """`study scale` reads each study's analysis.json: --json aimed at one is refused, nothing touched."""
    study = tmp_path / "study"
    study.mkdir()
    (study / "analysis.json").write_text(inputs["analysis"].read_text())
    for target in (study / "analysis.json", inputs["analysis"]):
        before = tree(tmp_path)
        r = run_cli(["study", "scale", str(study), str(inputs["analysis"]), "--json", str(target)])
        lines = [ln for ln in r.output.splitlines() if ln.strip()]
        assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.output
        assert any(m in lines[0] for m in GUARD), lines[0]  # the guard's refusal, not the analysis's
        assert tree(tmp_path) == before


def test_study_verify_json(inputs, tmp_path):
    """`study verify` reads a study's analysis.json: --json aimed at it is refused, nothing touched."""
    study = tmp_path / "study"
    study.mkdir()
    (study / "analysis.json").write_text(inputs["analysis"].read_text())
    for arg in (study, study / "analysis.json"):
        before = tree(tmp_path)
        r = run_cli(["study", "verify", str(arg), "--json", str(study / "analysis.json")])
        lines = [ln for ln in r.output.splitlines() if ln.strip()]
        assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.output
        assert any(m in lines[0] for m in GUARD), lines[0]
        assert tree(tmp_path) == before
