"""`deltalens eval` output: the table on stdout and logs on stderr, a standard error per Pass@K, Ks fitted
to the samples with a note, every completion in --log-samples, the plan line before any generation,
plain progress lines when stderr is not a terminal (train, study and sweep included), and hub lookups
that fail offline in one line."""

from __future__ import annotations

import importlib
import io
import itertools
import json
import logging
import re
import socket
import statistics
import time

import pytest
from support import run_cli, tiny_spec

from deltalens.errors import DeltalensError
from deltalens.evaluation.passk import fit_ks, pass_at_k, pass_at_k_se, standard_error
from deltalens.tasks import get_task

LIMIT, SAMPLES = 3, 4


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """One `eval -n 4` (default --k 1,16,32) with --json and --log-samples, progress at every update."""
    ev = importlib.import_module("deltalens.evaluation.evaluate")  # the module: the package exports a function so named

    d = tmp_path_factory.mktemp("evalout")
    calls = []
    real = ev.record_rate
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DELTALENS_PROGRESS_EVERY", "0")
        mp.setenv("DELTALENS_CACHE_DIR", str(d / "cache"))
        mp.delenv("DELTALENS_PROGRESS", raising=False)
        mp.setattr(ev, "record_rate", lambda **kw: (calls.append(kw), real(**kw)))
        r = run_cli(["eval", tiny_spec(), "--limit", LIMIT, "-n", SAMPLES, "--json", d / "r.json",
                     "--log-samples", d / "s.jsonl"])
    assert r.exit_code == 0, r
    doc = json.loads((d / "r.json").read_text())
    rows = [json.loads(x) for x in (d / "s.jsonl").read_text().splitlines()]
    return r, doc["evals"][tiny_spec()], rows, calls


def test_table_on_stdout_logs_on_stderr(ran):
    r, _, _, _ = ran
    assert "Pass@1" in r.stdout and "SE@1" in r.stdout and "Pass@4" in r.stdout and "SE@4" in r.stdout
    for log in ("note:", "eval:", "sequences", "wrote"):
        assert log not in r.stdout and log in r.stderr
    assert "SE@1" not in r.stderr and "┃" not in r.stderr


def test_k_fitted_to_the_samples_with_a_note(ran):
    r, ev, _, _ = ran
    assert "note: --k 16,32 exceed --samples 4: reporting Pass@1,4" in r.stderr.splitlines()
    assert list(ev["pass_at_k"]) == ["1", "4"] and list(ev["pass_at_k_se"]) == ["1", "4"]
    assert "Pass@16" not in r.stdout and "Pass@32" not in r.stdout


def test_fit_ks():
    assert fit_ks([1, 16, 32], 8) == ([1, 8], "--k 16,32 exceed --samples 8: reporting Pass@1,8")
    assert fit_ks([1, 16, 32], 16) == ([1, 16], "--k 32 exceeds --samples 16: reporting Pass@1,16")
    assert fit_ks([1, 64], 1) == ([1], "--k 64 exceeds --samples 1: reporting Pass@1")
    with pytest.raises(DeltalensError, match=r"^--k 16,32 exceed --samples 8; raise --samples or lower --k$"):
        fit_ks([16, 32], 8)  # nothing of the request fits
    assert fit_ks([1, 4], 4) == ([1, 4], None)


def test_standard_error_known_counts():
    assert standard_error([0.0, 1.0]) == pytest.approx(0.5)  # sd 0.7071 / sqrt 2
    assert standard_error([0.25, 0.5, 0.75]) == pytest.approx(0.25 / 3 ** 0.5)
    assert standard_error([0.3]) is None
    # (n, c) per problem: pass@1 = c/n = 0.25, 0.5, 0.75; pass@2 = 1 - C(n-c,2)/C(n,2) = 0.5, 5/6, 1
    counts = [(4, 1), (4, 2), (4, 3)]
    assert pass_at_k_se(counts, 1) == pytest.approx(0.25 / 3 ** 0.5)
    assert pass_at_k_se(counts, 2) == pytest.approx(statistics.stdev([0.5, 5 / 6, 1.0]) / 3 ** 0.5)
    assert pass_at_k_se([(4, 0), (4, 4)], 4) == pytest.approx(0.5)


def test_se_in_json_and_table(ran):
    r, ev, _, _ = ran
    counts = [(p["n"], p["correct"]) for p in ev["per_problem"]]
    row = next(x for x in r.stdout.splitlines() if x.strip("│ ").startswith(tiny_spec()))
    cells = [x.strip() for x in row.strip("│ ").split("│")]
    for i, k in enumerate(("1", "4")):
        values = [pass_at_k(n, c, int(k)) for n, c in counts]
        assert ev["pass_at_k_se"][k] == pytest.approx(statistics.stdev(values) / LIMIT ** 0.5)
        assert cells[1 + 2 * i] == f"{ev['pass_at_k'][k]:.3f}" and cells[2 + 2 * i] == f"{ev['pass_at_k_se'][k]:.3f}"


def test_log_samples_holds_every_completion(ran):
    r, ev, rows, _ = ran
    assert len(rows) == LIMIT * SAMPLES
    assert [(x["problem"], x["sample"]) for x in rows] == list(itertools.product(range(LIMIT), range(SAMPLES)))
    assert {x["model"] for x in rows} == {tiny_spec()}
    assert set(rows[0]) == {"model", "problem", "sample", "prompt", "answer", "completion", "extracted", "reward",
                            "correct"}
    for i, p in enumerate(ev["per_problem"]):
        mine = [x for x in rows if x["problem"] == i]
        assert all(x["prompt"] == p["prompt"] and x["answer"] == p["answer"] for x in mine)
        assert sum(x["correct"] for x in mine) == p["correct"]
        assert all(x["correct"] == (x["reward"] == 1.0) for x in mine)
        assert p["completions"] == [x["completion"] for x in mine[:2]]  # the report's sample completions
    assert f"wrote {r.stderr.split('wrote ')[1].split(' (')[0]} ({LIMIT * SAMPLES} completions)" in r.stderr


def test_plan_line_comes_before_generation(ran):
    r, _, _, calls = ran
    lines = r.stderr.splitlines()
    dev = "" if _device() == "cpu" else "/cuda"
    plan = (f"eval: 1 model x {LIMIT} problems x {SAMPLES} samples = {LIMIT * SAMPLES} generations (<= "
            f"{get_task('arith').max_new_tokens} new tokens each); no rate measured yet on this machine for "
            f"tiny/hf{dev}: the progress line gives an ETA")
    first_progress = next(i for i, x in enumerate(lines) if x.startswith("eval tiny: "))
    assert lines.index(plan) < first_progress
    # evaluate() reports its measured rate for the next plan line
    assert len(calls) == 1 and calls[0]["model"] == tiny_spec() and calls[0]["sequences"] == LIMIT * SAMPLES
    assert calls[0]["backend"] == "hf" and calls[0]["dtype"] == "fp32" and calls[0]["seconds"] > 0


def test_progress_lines_when_not_a_terminal(ran):
    r, _, _, _ = ran
    total = LIMIT * SAMPLES
    lines = [x for x in r.stderr.splitlines() if x.startswith("eval tiny: ")]
    assert lines[0] == f"eval tiny: 0/{total} sequences (0%), 0 s elapsed"
    assert re.fullmatch(rf"eval tiny: {total}/{total} sequences \(100%\), \d+ s elapsed, done", lines[-1])
    assert all(re.fullmatch(rf"eval tiny: \d+/{total} sequences \(\d+%\), \d+ s elapsed(, ~\d+ s left|, done)?", x)
               for x in lines)


def test_the_library_fits_ks_too(tmp_path, monkeypatch):
    from deltalens.evaluation import evaluate_models

    monkeypatch.setenv("DELTALENS_CACHE_DIR", str(tmp_path / "cache"))
    notes = []
    doc = evaluate_models([tiny_spec()], get_task("arith"), samples=2, limit=2, log=notes.append)
    ev = doc["evals"][tiny_spec()]
    assert notes == ["--k 16,32 exceed --samples 2: reporting Pass@1,2"] and list(ev["pass_at_k"]) == ["1", "2"]
    assert [len(p["completions"]) for p in ev["per_problem"]] == [2, 2]  # kept for the report by default
    with pytest.raises(DeltalensError, match=r"^--k 16,32 exceed --samples 2; raise --samples or lower --k$"):
        evaluate_models([tiny_spec()], get_task("arith"), samples=2, ks=(16, 32), limit=2)


@pytest.mark.parametrize("where", ["data", "json", "model"])
def test_log_samples_never_overwrites_an_input(where, tmp_path):
    from deltalens.tiny import MODEL_DIR

    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "1+1?", "answer": "2"}\n')
    before = data.read_bytes()
    target = {"data": data, "json": tmp_path / "r.json", "model": MODEL_DIR / "log.jsonl"}[where]
    r = run_cli(["eval", tiny_spec(), "--task", "jsonl", "--data", data, "--json", tmp_path / "r.json",
                 "--log-samples", target])
    expect = {"data": f"--log-samples {data} would overwrite the input {data}; choose another path",
              "json": f"--log-samples {target} and --json {target} name the same path; give each output its own",
              "model": f"--log-samples {target} lies inside the input model tiny; choose a path outside it"}[where]
    assert r.exit_code == 2 and r.output == f"error: {expect}\n", r
    assert data.read_bytes() == before and not (MODEL_DIR / "log.jsonl").exists()


def test_a_failed_eval_leaves_the_old_log_alone(tmp_path, monkeypatch):
    ev = importlib.import_module("deltalens.evaluation.evaluate")  # the module: the package exports a function so named

    def boom(*a, **kw):
        raise DeltalensError("scoring failed")

    monkeypatch.setattr(ev, "summarize", boom)  # fails after the completions reached the log
    monkeypatch.setenv("DELTALENS_CACHE_DIR", str(tmp_path / "cache"))
    log = tmp_path / "out" / "s.jsonl"
    log.parent.mkdir()
    log.write_text("old\n")
    r = run_cli(["eval", tiny_spec(), "--limit", "1", "-n", "1", "--k", "1", "--log-samples", log])
    assert r.exit_code == 2 and r.output.splitlines()[-1] == "error: scoring failed", r
    assert log.read_text() == "old\n" and [p.name for p in log.parent.iterdir()] == ["s.jsonl"]  # no temporary


# ------------------------------------------------------------------------------------------ progress


@pytest.fixture
def plain(monkeypatch, capsys):
    """Progress as a non-terminal gets it (capsys's stderr is no terminal): plain(every) -> a fresh reporter;
    plain.lines() -> every line printed on stderr so far."""
    import deltalens.cli.common as c

    err = io.StringIO()
    monkeypatch.delenv("DELTALENS_PROGRESS", raising=False)

    def make(every: str):
        monkeypatch.setenv("DELTALENS_PROGRESS_EVERY", every)
        bar = c.progress_bar()
        assert isinstance(bar, c.PlainProgress)
        return bar

    def lines():
        err.write(capsys.readouterr().err)
        return err.getvalue().splitlines()

    make.lines = lines
    return make


def test_periodic_lines_without_updates(plain):
    with plain("0.1") as bar:
        tid = bar.add_task("eval base", total=10, unit="sequences")
        time.sleep(0.5)  # no update: the heartbeat still reports
        bar.update(tid, completed=10)
    out = plain.lines()
    start = "eval base: 0/10 sequences (0%), 0 s elapsed"
    assert out[0] == start and len(out) >= 4 and all(x == start for x in out[1:-1])
    assert re.fullmatch(r"eval base: 10/10 sequences \(100%\), [01] s elapsed, done", out[-1])


def test_start_and_end_only_within_the_period(plain):
    from deltalens.cli.common import bar_factory

    with plain("30") as bar:
        progress = bar_factory(bar)("validation es-s0", 8)
        for done in range(1, 9):
            progress(done)
    assert plain.lines() == ["validation es-s0: 0/8 sequences (0%), 0 s elapsed",
                             "validation es-s0: 8/8 sequences (100%), 0 s elapsed, done"]


def test_training_reports_progress_lines(plain, monkeypatch):
    """train (cli/train.py's callback) and study/sweep (bar_factory, through train_unless_finished)."""
    from deltalens.cli.common import bar_factory
    from deltalens.cli.train import _progress_bar

    monkeypatch.setenv("DELTALENS_PROGRESS_EVERY", "0")
    bar, progress = _progress_bar("es")
    row = {"reward_mean": 0.5, "reward_max": 0.75, "timing": {"iteration_s": 1.0}}
    with bar:
        progress(0, 2, None)
        progress(1, 2, row)
        progress(2, 2, row)
    out = plain.lines()
    assert len(out) == 3 and out[0] == "es it 0/2: 0/2 (0%), 0 s elapsed"
    assert out[-1] == "es it 2/2  reward 0.500 (max 0.750)  1.0 s/it: 2/2 (100%), 0 s elapsed, done"
    with plain("0") as bar:
        step = bar_factory(bar)("train es-s0", 3)
        step(1)
    assert plain.lines()[3:] == ["train es-s0: 0/3 (0%), 0 s elapsed", "train es-s0: 1/3 (33%), 0 s elapsed, ~0 s left"]


def test_a_resumed_training_estimates_time_left_from_this_runs_pace(plain, tmp_path):
    """A study resuming a run at step 2 of 4: nothing while the model loads (not "0, 1 s elapsed"), then its
    bar starts at 2/4, and after one step in 100 s the time left is one step at 100 s, not one at (100 s / 3
    steps)."""
    from deltalens.cli.common import bar_factory

    from deltalens.training.launch import train_unless_finished

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")  # a started run: resumed
    said, resumed = [], []

    def train(resume, progress):
        resumed.append(resume)
        time.sleep(0.5)  # loading the model: the heartbeat (every 0.1 s) must not report the bar yet
        progress(2, 4)  # the training's first call: where it starts
        next(iter(bar._tasks.values())).start_time -= 100  # 100 s into this run
        progress(3, 4)

    with plain("0.1") as bar:
        train_unless_finished(run, 4, "es-s0", train, log=said.append, progress_factory=bar_factory(bar))
    assert said == ["es-s0: resuming (4 iterations/steps)"] and resumed == [True]
    lines = plain.lines()  # elapsed counts from the bar's creation, the model's load included
    assert re.fullmatch(r"train es-s0: 2/4 \(50%\), [01] s elapsed", lines[0]), lines
    assert re.fullmatch(r"train es-s0: 3/4 \(75%\), 10[01] s elapsed, ~10[01] s left", lines[-1]), lines
    assert all(x.startswith(("train es-s0: 2/4", "train es-s0: 3/4")) for x in lines)


def test_the_live_bar_estimates_time_left_when_steps_are_minutes_apart(monkeypatch):
    """rich's own window (30 s) drops every sample when steps are 2 min apart: no ETA for a GRPO run on
    Qwen2.5. The live bar keeps an hour of them; a resumed run's jump to its first step is not a speed."""
    import deltalens.cli.common as c

    monkeypatch.setenv("DELTALENS_PROGRESS", "1")
    now = [0.0]
    bar = c.progress_bar()
    bar.get_time = lambda: now[0]  # the clock rich reads its samples from
    tid = bar.add_task("grpo", total=None)
    bar.update(tid, completed=20, total=40)  # resumed at step 20
    for step in (21, 22):
        now[0] += 120
        bar.update(tid, completed=step)
    task = bar.tasks[0]
    assert task.speed == pytest.approx(1 / 120) and task.time_remaining == 18 * 120


def test_progress_off(plain, monkeypatch):
    import deltalens.cli.common as c

    monkeypatch.setenv("DELTALENS_PROGRESS", "0")
    with c.progress_bar() as bar:
        bar.update(bar.add_task("eval base", total=2), completed=2)
    assert plain.lines() == []


def test_progress_every_is_checked(monkeypatch):
    from deltalens.cli.common import progress_every

    monkeypatch.setenv("DELTALENS_PROGRESS_EVERY", "soon")
    with pytest.raises(DeltalensError, match=r"^DELTALENS_PROGRESS_EVERY must be a number of seconds \(got 'soon'\)$"):
        progress_every()
    monkeypatch.delenv("DELTALENS_PROGRESS_EVERY")
    assert progress_every() == 30


# ------------------------------------------------------------------------------------ cost up front


def test_diversity_states_its_cost_before_its_table(tmp_path, monkeypatch):
    monkeypatch.setenv("DELTALENS_CACHE_DIR", str(tmp_path / "cache"))
    r = run_cli(["diversity", tiny_spec(), "--task", "arith", "--members", "3", "--prompts", "2", "--samples", "2"])
    assert r.exit_code == 0, r.output
    n = get_task("arith").max_new_tokens
    first = r.stderr.splitlines()[0]
    assert first.startswith("diversity (N=3 members and the centre): 4 models x 2 problems x 2 samples = 16 "
                            f"generations (<= {n} new tokens each)"), r.stderr
    assert "JS across members" in r.stdout and "JS across members" not in r.stderr


def test_demo_states_its_study_cost(tmp_path):
    """The demo says what the study it runs will train and evaluate (the same lines `deltalens study` prints)."""
    from cli.study import _plan
    from deltalens.demo import demo_config

    cfg = demo_config(limit=100, samples=32)
    lines = _plan(cfg, tmp_path / "demo")
    runs = len(cfg.methods) * len(cfg.seeds)
    assert lines[0].startswith(f"study training: {runs} runs (es, grpo, es-grpo; 1 seed each)"), lines
    assert lines[1].startswith(f"study Pass@K (the base at {cfg.base_seeds} sampling seed, {runs} runs): "
                               f"{cfg.base_seeds + runs} models x 100 problems x 32 samples"), lines


def test_probe_and_study_state_their_cost_first(tmp_path, monkeypatch):
    """Said before the first generation (at the first progress bar or log line), after every up-front check."""
    import deltalens.study.run as study
    from deltalens.analysis import probe

    def stop(*a, **kw):
        raise DeltalensError("stopped before any work")

    monkeypatch.delenv("DELTALENS_PROGRESS_EVERY", raising=False)

    class Engine:  # what backend_for_spec hands the probe, without loading a model
        def close(self):
            pass

    def first_pass(gen, task, problems, samples, *a):
        a[-1]("sampled", len(problems) * samples)  # its progress bar, as the sampled pass opens it
        raise DeltalensError("stopped before any work")

    monkeypatch.setenv("DELTALENS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(probe, "backend_for_spec", lambda *a, **kw: (Engine(), None, None))
    monkeypatch.setattr(probe, "_passes", first_pass)
    r = run_cli(["probe", tiny_spec(), "--limit", "5", "-n", "8", "--es-populations", "0"])
    n = get_task("arith").max_new_tokens
    assert r.exit_code == 2 and r.stderr.splitlines() == [
        (f"probe (sampled at T=0.6, 1): 1 model x 2 temperatures x 5 problems x 8 samples = 80 generations "
         f"(<= {n} new tokens each); no rate measured "
         "yet on this machine for tiny/hf: the progress line gives an ETA"), "sampled: 0/40 (0%), 0 s elapsed",
        "error: stopped before any work"], r
    # the study: a refusal of its own up-front checks stays one line; past them, the plan comes first
    args = ["study", tiny_spec(), "--out", tmp_path / "s", "--limit", "10", "--seeds", "0,1"]
    monkeypatch.setattr(study, "run_study", stop)
    r = run_cli(args)
    assert r.exit_code == 2 and r.output == "error: stopped before any work\n", r

    def first_run(cfg, out, *, log, progress_factory):
        log("es-s0: training (20 iterations/steps)")
        raise DeltalensError("stopped before any work")

    monkeypatch.setattr(study, "run_study", first_run)
    r = run_cli(args)
    tail = " new tokens each); no rate measured yet on this machine for tiny/hf: the progress line gives an ETA"
    lines = r.stderr.splitlines()
    assert r.exit_code == 2 and lines[0].startswith("study training: 6 runs (es, grpo, es-grpo; 2 seeds each) at ")
    assert lines[1:] == [
        f"study Pass@K (the base at 3 sampling seeds, 6 runs): 9 models x 10 problems x 32 samples = 2,880 "
        f"generations (<= {n}" + tail,
        "study sparsity (the base, then es-s0, grpo-s0: the full update and 3 sparsities x threshold, random mask, "
        f"shrink): 21 models x 10 problems x 8 samples = 1,680 generations (<= {n}" + tail,
        "study also: the weight diff of 6 runs, token entropy of 5 models, the population diversity around es-s0",
        "es-s0: training (20 iterations/steps)", "error: stopped before any work"], r


# ------------------------------------------------------------------------------------------ offline hub


@pytest.fixture
def no_hub(tmp_path, monkeypatch):
    """An empty cache, no proxy, no offline switch, and a hub whose name does not resolve (as offline)."""
    from deltalens.io import hub

    monkeypatch.setenv("DELTALENS_CACHE_DIR", str(tmp_path / "cache"))
    for var in (*hub.OFFLINE_VARS, *hub.PROXY_VARS, "HF_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)

    def no_dns(address, timeout=None):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(hub.socket, "create_connection", no_dns)
    hub._probe.cache_clear()
    yield hub
    hub._probe.cache_clear()


GSM8K_OFFLINE = ("error: gsm8k is not cached here and the hub is unreachable ({why}); pass --data PATH to a local "
                 "copy (a jsonl, or a directory with test.jsonl and train.jsonl)\n")


def test_gsm8k_offline_env_fails_in_one_line(no_hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = run_cli(["eval", tiny_spec(), "--task", "gsm8k"])
    assert r.exit_code == 2 and r.output == GSM8K_OFFLINE.format(why="HF_HUB_OFFLINE is set"), r


def test_gsm8k_unreachable_hub_fails_in_one_line_without_asking_it(no_hub, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **kw: pytest.fail("the hub was asked"))
    r = run_cli(["eval", tiny_spec(), "--task", "gsm8k"])
    why = "huggingface.co cannot be reached: Name or service not known"
    assert r.exit_code == 2 and r.output == GSM8K_OFFLINE.format(why=why), r


def test_gsm8k_hub_failure_keeps_the_client_retries_quiet(no_hub, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(no_hub, "unreachable", lambda: None)  # the probe passes; the download then fails
    retries = logging.getLogger("huggingface_hub.utils._http")

    def flaky(*a, **kw):
        for i in range(1, 6):
            retries.warning(f"Retrying in {2 ** (i - 1)}s [Retry {i}/5].")
        raise ConnectionError("no route")

    seen = []
    handler = logging.Handler()
    handler.emit = seen.append  # whatever the hub client would have shown, wherever its handler writes
    retries.addHandler(handler)
    level = logging.getLogger("huggingface_hub").level
    monkeypatch.setattr(datasets, "load_dataset", flaky)
    try:
        r = run_cli(["eval", tiny_spec(), "--task", "gsm8k"])
    finally:
        retries.removeHandler(handler)
    assert r.exit_code == 2 and r.output == "error: could not fetch GSM8K from the hub (ConnectionError); pass " \
                                            "--data PATH to a local copy\n", r
    assert seen == [] and logging.getLogger("huggingface_hub").level == level  # quiet, then restored


def test_hub_model_offline_fails_in_one_line(no_hub):
    r = run_cli(["eval", "deltalens-test/no-such-model"])
    assert r.exit_code == 2 and r.output == (
        "error: cannot fetch deltalens-test/no-such-model from the hub (huggingface.co cannot be reached: Name or "
        "service not known) and it is not in the local cache; download it and pass the local directory\n"), r
