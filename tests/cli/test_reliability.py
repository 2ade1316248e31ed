"""Reliability through the CLI (issue #17): no command destroys an input, a lying file is refused, bad values
are refused before any work, every failure is one line with exit 2, and nothing is half-written.

Each refusal test checks the exit code, that the output is a single `error: ...` line, and that every
input file is byte-identical afterwards (`snapshot`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import shutil
import signal
from pathlib import Path

import pytest
import torch
from support import hold_lock, run_cli, tiny_spec

from deltalens.io.atomic import save_state_dict
from deltalens.io.runs import RunDir
from deltalens.tiny import MODEL_DIR

ES_FAST = ["--population", "2", "--prompts", "2", "--max-new-tokens", "8", "--eval-every", "0"]


def snapshot(*paths) -> dict[str, str]:
    """sha256 of every file under `paths` (files or directories)."""
    out = {}
    for p in map(Path, paths):
        for f in sorted([p] if p.is_file() else p.rglob("*")):
            if f.is_file():
                out[str(f)] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def refused(args, *, match: str, inputs=(), alone: bool = True) -> str:
    """Run the CLI; assert exit 2, one `error:` line containing `match` (the whole output when `alone`, else
    the last line after the command's normal output), inputs unchanged. Returns the error line."""
    before = snapshot(*inputs)
    r = run_cli(args)
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2, r
    assert lines and lines[-1].startswith("error: ") and (len(lines) == 1 or not alone), r.output
    assert sum(ln.startswith("error") for ln in lines) == 1 and "Traceback" not in r.output, r.output
    assert match in lines[-1], lines[-1]
    assert snapshot(*inputs) == before, "an input was modified"
    return lines[-1]


@pytest.fixture
def ckpt(tmp_path) -> Path:
    """A bare weight file (a copy of tiny's weights)."""
    tiny_spec()
    return Path(shutil.copy(MODEL_DIR / "model.safetensors", tmp_path / "X.safetensors"))


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """An HF model directory (a copy of tiny)."""
    tiny_spec()
    return Path(shutil.copytree(MODEL_DIR, tmp_path / "base"))


@pytest.fixture(scope="module")
def es_run(tmp_path_factory) -> Path:
    """A finished 1-iteration ES run on tiny (copy it before changing it)."""
    out = tmp_path_factory.mktemp("es") / "run"
    r = run_cli(["train", "es", "--model", tiny_spec(), "--out", out, "--iterations", "1", *ES_FAST])
    assert r.exit_code == 0, r.output
    return out


def _copy_run(es_run, tmp_path) -> Path:
    return Path(shutil.copytree(es_run, tmp_path / "run"))


# ------------------------------------------------------------------ 1. outputs never overwrite inputs


def test_outputs_that_are_inputs_are_refused(ckpt, model_dir, tmp_path):
    X, D = str(ckpt), str(model_dir)
    refused(["report", "tiny", X, "-o", X], match="would overwrite the input", inputs=[ckpt])
    refused(["diff", "tiny", X, "--json", X], match="--json", inputs=[ckpt])
    refused(["diff", "tiny", X, "--csv", X], match="--csv", inputs=[ckpt])
    refused(["eval", D, "--json", f"{D}/model.safetensors"], match="lies inside the input model", inputs=[model_dir])
    refused(["sparsify", X, "--base", "tiny", "--json", X], match="would overwrite the input", inputs=[ckpt])
    refused(["diversity", D, "--json", f"{D}/model.safetensors"], match="inside the input", inputs=[model_dir])
    refused(["report", D, X, "-o", f"{D}/config.html"], match="lies inside the input model",
            inputs=[model_dir, ckpt])
    refused(["eval", X, "--arch", D, "--json", f"{D}/tokenizer.json"], match="inside the input model",
            inputs=[model_dir, ckpt])
    refused(["eval", "tiny", "--json", str(MODEL_DIR / "x.json")], match="inside the input model",
            inputs=[MODEL_DIR])
    assert not list(tmp_path.glob("*.cache")) and sorted(p.name for p in tmp_path.iterdir()) == ["X.safetensors",
                                                                                               "base"]


def test_outputs_that_collide_or_cannot_be_files_are_refused(ckpt, tmp_path):
    X = str(ckpt)
    refused(["report", "tiny", X, "-o", tmp_path / "r.json"], match="-o names the report's directory", inputs=[ckpt])
    refused(["diff", "tiny", X, "--json", tmp_path / "a", "--csv", tmp_path / "a"], match="name the same path",
            inputs=[ckpt])
    refused(["diff", "tiny", X, "--json", tmp_path], match="is a directory", inputs=[ckpt])
    refused(["diff", "tiny", X, "--json", f"{X}/a.json"], match="is a file, not a directory", inputs=[ckpt])
    analysis = tmp_path / "a.json"
    analysis.write_text(json.dumps({"schema_version": 1}))
    refused(["render", analysis, "-o", analysis], match="would overwrite the input", inputs=[analysis])
    assert not (tmp_path / "r.cache").exists() and not (tmp_path / "r.json").exists()


def test_training_never_writes_into_or_over_its_inputs(es_run, model_dir, tmp_path):
    run = _copy_run(es_run, tmp_path)
    refused(["train", "es", "--model", model_dir, "--out", model_dir / "run"], match="lies inside the input model",
            inputs=[model_dir])
    refused(["train", "es", "--model", run, "--out", run, "--overwrite"], match="would write into the run",
            inputs=[run])
    refused(["train", "es", "--model", run / "checkpoints" / "final", "--out", run, "--overwrite"],
            match="holds the input", inputs=[run])
    (tmp_path / "file").write_text("x")
    refused(["train", "es", "--out", tmp_path / "file"], match="exists and is not a directory",
            inputs=[tmp_path / "file"])


def test_a_report_beside_a_run_is_fine(es_run, tmp_path, monkeypatch):
    run = _copy_run(es_run, tmp_path)
    before = snapshot(run)
    monkeypatch.chdir(tmp_path)
    r = run_cli(["report", "tiny", run])  # default output: ./deltalens-report/{report.html,analysis.json,cache/}
    assert r.exit_code == 0, r.output
    out = tmp_path / "deltalens-report"
    assert (out / "report.html").is_file() and (out / "analysis.json").is_file()
    assert snapshot(run) == before  # never inside the input run
    r = run_cli(["report", "tiny", run, "-o", run / "report"])  # beside the run's own files: fine
    assert r.exit_code == 0, r.output
    assert (run / "report" / "report.html").is_file()
    assert {k: v for k, v in snapshot(run).items() if "/report/" not in k} == before


# ------------------------------------------------------------------ 2. a lying file is refused


def _lie(src: Path, dst: Path, edit) -> Path:
    raw = src.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    dst.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    return dst


def test_lying_safetensors_are_refused_by_every_command(ckpt, tmp_path):
    first = next(k for k in json.loads(ckpt.read_bytes()[8:8 + int.from_bytes(ckpt.read_bytes()[:8], "little")])
                 if k != "__metadata__")

    def shift(h):
        for k, e in h.items():
            if k != "__metadata__":
                e["data_offsets"] = [e["data_offsets"][0] + 4, e["data_offsets"][1] + 4]

    def negative(h):
        h[first]["data_offsets"] = [h[first]["data_offsets"][0] - 64, h[first]["data_offsets"][1] - 64]

    cases = {"shift": shift, "negative": negative,
             "string": lambda h: h[first].update(data_offsets="0,4"),
             "single": lambda h: h[first].update(data_offsets=[0]),
             "negshape": lambda h: h[first].update(shape=[-1, 4])}
    for name, edit in cases.items():
        bad = _lie(ckpt, tmp_path / f"{name}.safetensors", edit)
        line = refused(["diff", "tiny", bad], match=str(bad), inputs=[bad])
        assert name == "shift" or first in line
    bad = tmp_path / "negative.safetensors"
    refused(["eval", bad, "--arch", "tiny", "--limit", "1", "-n", "1", "--k", "1"], match=first, inputs=[bad])


# ------------------------------------------------------------------ 3. non-finite weights


def test_nonfinite_weights_are_named_and_refused_but_diff_works(ckpt, tmp_path):
    from safetensors.torch import load_file

    sd = load_file(str(ckpt))
    name = sorted(sd)[3]
    sd[name].view(-1)[0] = float("nan")
    bad = save_state_dict(sd, tmp_path / "nan.safetensors")
    fast = ["--limit", "1", "-n", "1", "--k", "1"]
    refused(["eval", bad, "--arch", "tiny", *fast], match=f"non-finite weights (NaN/Inf) in {name}", inputs=[bad])
    refused(["sparsify", bad, "--base", "tiny", *fast], match=name, inputs=[bad])
    torch.save(sd, tmp_path / "nan.pt")
    refused(["eval", tmp_path / "nan.pt", "--arch", "tiny", *fast], match=name, inputs=[tmp_path / "nan.pt"])
    r = run_cli(["diff", "tiny", bad])
    assert r.exit_code == 0 and "NaN/Inf" in r.output


# ------------------------------------------------------------------ 4. write failures


def _enospc(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_disk_full_during_diff_json_is_one_line_and_writes_nothing(ckpt, tmp_path, monkeypatch):
    import deltalens.analysis.delta  # noqa: F401 - imported before os.fsync is patched below
    from deltalens.io import atomic

    monkeypatch.setattr(atomic.os, "fsync", _enospc)
    refused(["diff", "tiny", ckpt, "--json", tmp_path / "d.json"], match="no space left on device", inputs=[ckpt],
            alone=False)  # the tables were printed; the write failed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["X.safetensors"]


def test_unwritable_output_is_one_line(ckpt, tmp_path, monkeypatch):
    import deltalens.analysis.delta  # noqa: F401 - imported before os.replace is patched below
    from deltalens.io import atomic, outputs

    monkeypatch.setattr(outputs, "_may_write", lambda directory: False)
    refused(["diff", "tiny", ckpt, "--json", tmp_path / "d.json"], match="no permission to write", inputs=[ckpt])
    monkeypatch.undo()

    def denied(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(atomic.os, "replace", denied)
    refused(["diff", "tiny", ckpt, "--json", tmp_path / "d.json"], match="permission denied", inputs=[ckpt],
            alone=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["X.safetensors"]


def test_disk_full_during_a_training_checkpoint(tmp_path, monkeypatch):
    from transformers import PreTrainedModel

    real = PreTrainedModel.save_pretrained

    def half_then_full(self, directory, *a, **k):
        (Path(directory) / "model.safetensors").write_bytes(b"half a checkpoint")
        _enospc()

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", half_then_full)
    out = tmp_path / "run"
    args = ["train", "es", "--model", tiny_spec(), "--out", out, "--iterations", "1", *ES_FAST]
    refused(args, match="checkpoints/final: no space left on device", alone=False)  # after its progress line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == []  # no final, no final.tmp-*
    assert RunDir(out).state() is None
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", real)
    r = run_cli(["train", "resume", out])  # the space is back: the run completes
    assert r.exit_code == 0, r.output
    assert RunDir(out).state()["checkpoint"] == "final"


# ------------------------------------------------------------------ 5. one writer per run


def test_a_second_writer_is_refused_and_a_dead_ones_lock_is_not_in_the_way(es_run, tmp_path):
    run = _copy_run(es_run, tmp_path)
    holder = hold_lock(run)
    try:
        refused(["train", "resume", run, "--iterations", "2"], match=f"(pid {holder.pid})", inputs=[run])
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    r = run_cli(["train", "resume", run, "--iterations", "2"])  # the killed holder's lock file stays: no matter
    assert r.exit_code == 0, r.output
    rows = [row["iteration"] for row in RunDir(run).metrics()]
    assert rows == [1, 2]


# ------------------------------------------------------------------ 6. a failed start leaves no run


@pytest.mark.parametrize("bad", [["--task", "nope"], ["--task", "jsonl", "--data", "missing.jsonl"],
                                 ["--model", "missing-dir/model.safetensors"], ["--params", "nothing.*"]])
def test_a_refused_start_leaves_no_run_directory(tmp_path, bad):
    out = tmp_path / "o"
    refused(["train", "es", "--out", out, "--iterations", "1", *ES_FAST, *bad], match="")
    assert not out.exists()


def test_refused_grpo_and_chain_starts_leave_nothing(tmp_path):
    pytest.importorskip("trl")
    refused(["train", "grpo", "--out", tmp_path / "g", "--task", "nope"], match="unknown task")
    refused(["train", "chain", "--out", tmp_path / "c", "--task", "nope"], match="unknown task")
    refused(["train", "grpo", "--out", tmp_path / "g", "--prompts", "3", "-G", "2", "--micro-batch", "4"],
            match="micro_batch_size (4) must divide")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ 7. corrupt run files


@pytest.mark.parametrize("name", ["state.json", "config.json"])
def test_corrupt_run_files_are_one_line_naming_the_file(es_run, tmp_path, name):
    run = _copy_run(es_run, tmp_path)
    (run / name).write_text((run / name).read_text()[:20])
    refused(["train", "resume", run, "--iterations", "2"], match=f"{name} is corrupt", inputs=[run])


# ------------------------------------------------------------------ 9. late or missing validation


def test_bad_values_are_refused_before_any_work(ckpt, tmp_path):
    X = str(ckpt)
    j = ["--json", tmp_path / "out.json"]
    refused(["eval", "tiny", "--temperature", "nan", *j], match="temperature must be a finite number")
    refused(["eval", "tiny", "--temperature", "inf", *j], match="temperature must be a finite number")
    refused(["eval", "tiny", "--limit=-1", *j], match="--limit must be >= 1")
    refused(["diff", "tiny", X, "--tol", "nan", *j], match="--tol must be a finite number", inputs=[ckpt])
    refused(["diversity", "tiny", "--members", "0", *j], match="--members must be >= 2")
    refused(["diversity", "tiny", "--temperature", "nan", *j], match="--temperature")
    for tau in ("-1e-4", "nan"):
        refused(["sparsify", X, "--base", "tiny", "--thresholds", tau, *j], match="must be a finite number >= 0",
                inputs=[ckpt])
    refused(["sparsify", X, "--base", "tiny", "--task", "nope", *j], match="unknown task", inputs=[ckpt])
    refused(["report", "tiny", X, "--task", "nope", "-o", tmp_path / "r"], match="unknown task", inputs=[ckpt])
    refused(["report", "tiny", X, "--task", "arith", "--sparsify", "nan", "-o", tmp_path / "r"],
            match="must be a finite number", inputs=[ckpt])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["X.safetensors"]  # no r.cache/, no out.json


# ------------------------------------------------------------------ 10. messages


def test_diversity_messages_name_its_own_options(ckpt, tmp_path):
    line = refused(["diversity", ckpt, "--prompts", "1", "--samples", "1"], match="pass --arch", inputs=[ckpt])
    assert "--arch" in run_cli(["diversity", "--help"]).output
    refused(["diversity", "tiny", "--members", "1"], match="--members must be >= 2")
    # --config was an old name of --arch; it is now a YAML file of options, and an architecture there is refused
    refused(["diversity", ckpt, "--config", "tiny"], match="use --arch for an architecture", inputs=[ckpt])
    r = run_cli(["diversity", ckpt, "--arch", "tiny", "--members", "2", "--prompts", "1", "--samples", "1",
                 "--max-new-tokens", "4", "--json", tmp_path / "d.json"])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "d.json").read_text())["diversity"]
    assert line


def test_a_refused_pickle_is_one_clean_line(tmp_path):
    import pickle

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    with open(tmp_path / "evil.pt", "wb") as f:  # plain pickle (protocol 4): torch also warns about it
        pickle.dump({"w": Evil()}, f, protocol=4)
    line = refused(["diff", "tiny", tmp_path / "evil.pt"], match="weights_only load refused it",
                   inputs=[tmp_path / "evil.pt"])
    assert "Re-running" not in line and "pwned" not in line


def test_gguf_conversion_bar_is_silenced(capsys):
    from deltalens.io.quiet import quiet_transformers

    gguf_utils = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    with quiet_transformers(gguf=True):
        list(gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."))
    assert "de-quantizing" not in capsys.readouterr().err


# ------------------------------------------------------------------ 11. hostile analysis.json, stale temporaries


def test_render_refuses_hostile_json_in_one_line(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    refused(["render", deep, "-o", tmp_path / "d.html"], match="nested too deeply", inputs=[deep])
    big = tmp_path / "big.json"
    doc = json.loads((Path(__file__).parents[1] / "fixtures" / "analysis_full.json").read_text())
    doc["huge"] = 10**400
    big.write_text(json.dumps(doc))
    refused(["render", big, "-o", tmp_path / "b.html"], match="out of range", inputs=[big])
    assert not (tmp_path / "d.html").exists() and not (tmp_path / "b.html").exists()


def test_render_reads_a_published_gzipped_analysis(tmp_path, monkeypatch):
    """A published study's analysis.json.gz renders as its .json does (default output: analysis.html beside it);
    a broken or oversized gzip stream is refused in one line."""
    import gzip

    from deltalens import schema

    src = Path(__file__).parents[1] / "fixtures" / "analysis_full.json"
    gz = tmp_path / "pub" / "analysis.json.gz"
    gz.parent.mkdir()
    gz.write_bytes(gzip.compress(src.read_bytes()))
    shutil.copy(src, tmp_path / "analysis.json")
    for args in (["render", gz], ["render", tmp_path / "analysis.json", "-o", tmp_path / "plain.html"]):
        r = run_cli(args)
        assert r.exit_code == 0, r.output
    html = (tmp_path / "pub" / "analysis.html").read_text()
    assert len(html) > 10_000 and html == (tmp_path / "plain.html").read_text()
    bad = tmp_path / "bad.json.gz"
    bad.write_bytes(b"not gzip at all")
    refused(["render", bad, "-o", tmp_path / "x.html"], match="not a readable gzip file", inputs=[bad])
    monkeypatch.setattr(schema, "MAX_UNPACKED", 1000)
    refused(["render", gz, "-o", tmp_path / "y.html"], match="unpacks to more than 1,000 bytes", inputs=[gz])
    assert not (tmp_path / "x.html").exists() and not (tmp_path / "y.html").exists()


def test_resume_cleans_temporaries_of_a_killed_writer(es_run, tmp_path):
    run = _copy_run(es_run, tmp_path)
    (run / "checkpoints" / "final.tmp-0123abcd").mkdir()
    (run / "checkpoints" / "final.tmp-0123abcd" / "model.safetensors").write_bytes(b"half")
    (run / "checkpoints" / "final.old-89abcdef").mkdir()
    (run / ".state.tmp-0123abcd.json").write_text("{")
    r = run_cli(["train", "resume", run])  # finished: nothing to train, but the directory is opened for writing
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["final"]
    assert not list(run.glob(".*.tmp-*"))


def test_negative_seeds_are_refused_in_one_line(tmp_path):
    """A negative seed reached numpy's seeding (a ValueError traceback) in eval and training (issue #36 review)."""
    refused(["eval", "tiny", "--seed", "-1", "--limit", "2", "-n", "2", "--k", "1"], match="--seed")
    refused(["train", "es", "--model", "tiny", "--seed", "-1", "--out", tmp_path / "r"], match="seed must be >= 0")
    refused(["train", "grpo", "--model", "tiny", "--seed", "-1", "--out", tmp_path / "r"], match="seed must be >= 0")
    refused(["study", "tiny", "--seeds", "0,-1", "--out", tmp_path / "s"], match="--seeds must be >= 0")
    assert not (tmp_path / "r").exists() and not (tmp_path / "s").exists()
