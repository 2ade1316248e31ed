"""A refused command leaves nothing that changes how the next one behaves (issue #36, item 5).

`study` pins its settings in DIR/study.json and `sweep` in DIR/sweep-settings.json; a rerun with other
settings is refused ("a study with other settings"). Pinning before validation made every refused study
block its own corrected retry. Here each refusal must leave no --out at all, and the retry with the right
arguments in the same --out must get past validation: training is replaced by a stub that stops the
command with a marker (the tests stay fast), so reaching the marker proves the retry was accepted.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
from pathlib import Path

import pytest
from support import run_cli, tiny_spec

from deltalens.errors import DeltalensError
from deltalens.tiny import MODEL_DIR

REACHED = "reached training"
ES_FAST = ["--population", "2", "--prompts", "2", "--max-new-tokens", "8", "--eval-every", "0"]


class _Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def _stop(*args, **kwargs):
    raise DeltalensError(REACHED)


def _refusal(r, match: str) -> None:
    """Exit 2, one `error:` line (the last; a command may print its cost estimate first) containing `match`."""
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2, r
    assert lines and lines[-1].startswith("error: ") and match in lines[-1], r.output
    assert sum(ln.startswith("error") for ln in lines) == 1 and "Traceback" not in r.output, r.output


def _digest(d: Path) -> dict[str, str]:
    return {str(f): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.rglob("*")) if f.is_file()}


@pytest.fixture
def bad_models(tmp_path) -> dict[str, tuple[str, str]]:
    """name -> (model spec, a piece of the refusal): missing, corrupt, evil pickle, a tensor missing."""
    tiny_spec()
    corrupt = Path(shutil.copytree(MODEL_DIR, tmp_path / "corrupt"))
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file" * 4)
    evil_dir = Path(shutil.copytree(MODEL_DIR, tmp_path / "evil"))  # its config.json names the architecture
    with open(evil_dir / "evil.pt", "wb") as f:
        pickle.dump({"w": _Evil()}, f, protocol=4)
    lacking = Path(shutil.copytree(MODEL_DIR, tmp_path / "lacking"))
    from safetensors.torch import load_file, save_file

    sd = load_file(lacking / "model.safetensors")
    sd.pop("model.norm.weight")
    save_file(sd, lacking / "model.safetensors", metadata={"format": "pt"})
    return {"missing": (str(tmp_path / "no-such-model"), "no such file or directory"),
            "corrupt": (str(corrupt), "could not load a model from"),
            "evil": (str(evil_dir / "evil.pt"), "weights_only load refused it"),
            "lacking": (str(lacking), "missing model.norm.weight")}


STUDY = ["--methods", "es", "--seeds", "0", "--preset", "tiny", "--budget", "4096"]


def test_refused_studies_leave_nothing_and_their_retry_proceeds(tmp_path, bad_models, monkeypatch):
    import deltalens.study.run as study_run

    monkeypatch.setattr(study_run, "train_runs", _stop)
    inputs = {name: _digest(Path(spec).parent if spec.endswith(".pt") else Path(spec))
              for name, (spec, _) in bad_models.items() if Path(spec).exists()}
    cases = [(["tiny", "--task", "nope"], "unknown task 'nope'"),
             (["tiny", "--preset", "nope"], "unknown ES preset 'nope'"),
             (["tiny", "--chat-template", "on"], "this tokenizer has no chat template"),
             (["tiny", "--held-out", "nope"], "unknown task 'nope'"),
             *(([spec], match) for spec, match in bad_models.values())]
    for i, ([model, *args], match) in enumerate(cases):
        out = tmp_path / f"study-{i}"
        _refusal(run_cli(["study", model, "--out", out, *STUDY, *args]), match)  # the later option wins
        assert not out.exists(), (args, sorted(out.rglob("*")))
        retry = run_cli(["study", "tiny", "--out", out, *STUDY])
        _refusal(retry, REACHED)  # past every check, study.json pinned with the retry's own settings
        assert json.loads((out / "study.json").read_text())["task"] == "arith", args
    for name, before in inputs.items():
        spec = bad_models[name][0]
        assert _digest(Path(spec).parent if spec.endswith(".pt") else Path(spec)) == before, name


def test_a_refused_study_in_an_existing_study_changes_nothing(tmp_path, monkeypatch):
    """A study DIR that exists already: a refused rerun leaves study.json (and everything) as it was."""
    import deltalens.study.run as study_run

    monkeypatch.setattr(study_run, "train_runs", _stop)
    out = tmp_path / "s"
    _refusal(run_cli(["study", tiny_spec(), "--out", out, *STUDY]), REACHED)
    before = _digest(out)
    _refusal(run_cli(["study", "tiny", "--out", out, *STUDY, "--task", "arith-3"]),
             "is a study with other settings (task: 'arith' vs 'arith-3')")
    _refusal(run_cli(["study", "tiny", "--out", out, *STUDY, "--held-out", "nope"]), "unknown task 'nope'")
    assert _digest(out) == before


def test_refused_sweeps_leave_nothing_and_their_retry_proceeds(tmp_path, bad_models, monkeypatch):
    from deltalens.study import sweep

    monkeypatch.setattr(sweep, "train_unless_finished", _stop)
    grid = ["--grid", "sigma=1e-3,2e-3", "--iterations", "1", *ES_FAST, "--val-limit", "2"]
    cases = [(["--model", "tiny", "--task", "nope"], "unknown task 'nope'"),
             (["--model", "tiny", "--preset", "nope"], "unknown ES preset 'nope'"),
             (["--model", "tiny", "--chat-template", "on"], "this tokenizer has no chat template"),
             *((["--model", spec], match) for spec, match in bad_models.values())]
    for i, (args, match) in enumerate(cases):
        out = tmp_path / f"sweep-{i}"
        _refusal(run_cli(["sweep", "es", *grid, *args, "--out", out]), match)
        assert not out.exists(), (args, sorted(out.rglob("*")))
        _refusal(run_cli(["sweep", "es", "--model", "tiny", *grid, "--out", out]), REACHED)
        assert json.loads((out / "sweep-settings.json").read_text())["model"] == "tiny"


@pytest.mark.parametrize("method", ["es", "grpo", "chain"])
def test_refused_trainings_leave_no_run_dir_and_their_retry_proceeds(method, tmp_path, bad_models, monkeypatch):
    """Among others `train grpo --chat-template on` (refused once the run directory existed) and a chain
    whose model cannot be loaded (refused by its first stage, inside the chain's directory)."""
    if method == "grpo":
        pytest.importorskip("trl")
        import deltalens.training.grpo.train as grpo

        monkeypatch.setattr(grpo, "_train", _stop)  # what runs under the writer lock, after every check
    elif method == "es":
        import deltalens.training.es.train as es

        monkeypatch.setattr(es, "_train", _stop)
    else:
        from deltalens.training import chain

        monkeypatch.setattr(chain, "_train_chain", _stop)
    chat = {"chain": "--es-chat-template"}.get(method, "--chat-template")
    cases = [(["--task", "nope"], "unknown task 'nope'"),
             ([chat, "on"], "this tokenizer has no chat template"),
             *((["--model", bad_models[k][0]], bad_models[k][1]) for k in ("corrupt", "lacking"))]
    for i, (args, match) in enumerate(cases):
        out = tmp_path / f"{method}-{i}"
        _refusal(run_cli(["train", method, "--out", out, *args]), match)
        assert not out.exists(), (args, sorted(out.rglob("*")))
        _refusal(run_cli(["train", method, "--out", out]), REACHED)
