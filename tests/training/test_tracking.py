"""--report-to tensorboard|wandb|none: ES and GRPO log the same scalar names at the run's steps (TensorBoard
event files, a W&B offline run), a resume shows every step once, and bad values or missing packages are
refused in one line before anything is written."""

from __future__ import annotations

import glob
import importlib.util
import json
import struct
from pathlib import Path

import pytest
from support import run_cli, tiny_spec

from deltalens.errors import DeltalensError
from deltalens.training import tracking
from deltalens.training.es.config import ESConfig

# the names ES and GRPO share (deltalens.training.tracking)
SHARED = {"train/reward", "train/reward_std", "train/reward_min", "train/reward_max", "train/units",
          "eval/pass_at_1", "eval/mean_reward", "time/iteration_s", "time/eval_s"}
# a tiny ES run: about a second an iteration on one core
TINY_ES = {"population": 2, "prompts_per_iteration": 2, "sigma": 0.01, "alpha": 0.005, "eval_every": 2,
           "eval_limit": 2, "checkpoint_every": 1, "max_new_tokens": 16}


def _needs(name: str) -> None:
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} is not installed (pip install 'deltalens[{name}]')")


def _events(run_dir: Path):
    """The run's TensorBoard events as TensorBoard itself reads them (purged steps hidden)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def _steps(acc, tag: str) -> list[int]:
    return [e.step for e in acc.Scalars(tag)]


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _wandb_history(path: Path) -> list[dict]:
    """The history rows of a W&B transaction log (run-*.wandb: a W&B header, then LevelDB-log records of
    `wandb_internal_pb2.Record`), as {key: value} with "_step"."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, part, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a record header is padding
            pos += block - pos % block
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind == 0:
            break
        part = chunk if kind in (1, 2) else part + chunk
        if kind not in (1, 4):
            continue
        rec = pb.Record()
        rec.ParseFromString(part)
        if rec.WhichOneof("record_type") == "history":
            out.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
    return out


# ------------------------------------------------------------------------------------------ values


def test_report_to_values_are_checked_and_normalized():
    assert ESConfig(report_to=" TensorBoard, wandb,tensorboard").report_to == "tensorboard,wandb"
    assert ESConfig().report_to == "none"
    for bad in ("nope", "", "none,wandb", "all"):
        with pytest.raises(DeltalensError, match="--report-to must be none, tensorboard, wandb"):
            ESConfig(report_to=bad)
    assert "report_to" not in ESConfig.trajectory_fields()  # a resume may turn tracking on or off
    from deltalens.training.grpo.config import GRPOConfig

    assert GRPOConfig(report_to="wandb").report_to == "wandb" and "report_to" not in GRPOConfig.trajectory_fields()


def test_report_to_nope_is_refused_by_the_cli_before_anything_is_written(tmp_path):
    for args in (["train", "es", "--model", "tiny", "--report-to", "nope", "--out", tmp_path / "run"],
                 ["train", "chain", "--report-to", "nope", "--out", tmp_path / "run"],
                 ["sweep", "es", "--grid", "sigma=1e-3,2e-3", "--report-to", "nope", "--out", tmp_path / "run"],
                 ["study", "tiny", "--report-to", "nope", "--out", tmp_path / "run"]):
        r = run_cli(args)
        assert r.exit_code == 2, (args, r.output)
        want = "error: --report-to must be none, tensorboard, wandb or tensorboard,wandb (got 'nope')"
        assert r.output.strip().splitlines() == [want], r.output
        assert not (tmp_path / "run").exists()


def test_a_missing_tracker_package_is_one_line_before_any_work(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name in ("tensorboard", "wandb") else real(name, *a, **k))
    from deltalens.training.es.train import train_es

    with pytest.raises(DeltalensError) as e:
        train_es(ESConfig(model=tiny_spec(), report_to="tensorboard", **TINY_ES), tmp_path / "es")
    assert str(e.value) == "--report-to tensorboard needs `pip install 'deltalens[tensorboard]'`"
    assert not (tmp_path / "es").exists()
    r = run_cli(["train", "grpo", "--model", "tiny", "--report-to", "wandb", "--out", tmp_path / "grpo"])
    assert r.exit_code == 2 and r.output.strip() == "error: --report-to wandb needs `pip install 'deltalens[wandb]'`"
    assert not (tmp_path / "grpo").exists()
    r = run_cli(["train", "chain", "--report-to", "tensorboard", "--out", tmp_path / "chain"])
    assert r.exit_code == 2 and "needs `pip install 'deltalens[tensorboard]'`" in r.output
    assert not (tmp_path / "chain").exists()


def test_chain_study_and_sweep_hand_report_to_to_every_run(tmp_path):
    from deltalens.study.config import StudyConfig
    from deltalens.study.run import run_plan
    from deltalens.study.sweep import parse_grid
    from deltalens.training.chain import ChainConfig

    stages = ChainConfig(report_to="tensorboard").stage_presets("tiny")
    assert {m: c.report_to for m, c in stages.items()} == {"es": "tensorboard", "grpo": "tensorboard"}
    with pytest.raises(DeltalensError, match="the chain sets report_to of its es stage itself"):
        ChainConfig(stage_options={"es": {"report_to": "wandb"}})
    # a chain run's config.json records it in its stages; rebuilt from that file (train chain --config), it is kept
    stored = {"method": "es-grpo", "deltalens_version": "0", "methods": ["es", "grpo"], "model": "tiny",
              "task": "arith", "stages": [{"method": m, "dir": m, "config": c.to_dict(in_use=True)}
                                          for m, c in stages.items()]}
    rebuilt = ChainConfig.resolve(yaml=ChainConfig.run_options(stored))
    assert rebuilt.report_to == "tensorboard" and {c.report_to for c in rebuilt.stage_presets("paper").values()} \
        == {"tensorboard"}
    plan = run_plan(StudyConfig(model="tiny", seeds=(0,), report_to="wandb"), tmp_path)
    assert {c.report_to for r in plan for c in r["configs"].values()} == {"wandb"}
    with pytest.raises(DeltalensError, match="fixed for a whole sweep"):
        parse_grid("es", ["report_to=none,tensorboard"])


# ------------------------------------------------------------------------------------------ runs


def test_es_logs_to_tensorboard_and_wandb_offline(tmp_path, monkeypatch):
    _needs("tensorboard")
    _needs("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline by default
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    from deltalens.training.es.train import train_es

    out = tmp_path / "es"
    train_es(ESConfig(model=tiny_spec(), iterations=2, report_to="tensorboard,wandb", **TINY_ES), out)
    rows = [r for r in _rows(out) if "reward_mean" in r]

    acc = _events(out)
    scalars = set(acc.Tags()["scalars"])
    assert SHARED | {"train/update_rms", "train/update_norm", "time/generation_s"} <= scalars
    assert _steps(acc, "train/reward") == [1, 2] and _steps(acc, "eval/pass_at_1") == [0, 2]
    assert [e.value for e in acc.Scalars("train/reward")] == pytest.approx([r["reward_mean"] for r in rows])
    assert [e.value for e in acc.Scalars("train/update_rms")] == pytest.approx([r["update_rms"] for r in rows])
    hist = acc.Histograms("train/rewards")  # the members' rewards
    assert [h.step for h in hist] == [1, 2] and all(h.histogram_value.num == 2 for h in hist)

    (log,) = glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))
    history = _wandb_history(Path(log))
    train = [h for h in history if "train/reward" in h]
    assert [h["_step"] for h in train] == [1, 2]
    assert [h["train/reward"] for h in train] == pytest.approx([r["reward_mean"] for r in rows])
    assert SHARED <= {k for h in history for k in h}
    assert train[0]["train/rewards/_type"] == "histogram"

    # the trackers' directories are the run's own: no command may write into them
    from deltalens.io.outputs import Output, check_outputs

    for d in ("tensorboard", "wandb"):
        with pytest.raises(DeltalensError, match="would write into the run"):
            check_outputs([Output(out / d / "x.json", "--json")], models=[str(out)])


def test_grpo_logs_the_same_names_as_es_and_trls_own(tmp_path):
    _needs("tensorboard")
    pytest.importorskip("trl")
    from deltalens.training.grpo.config import GRPOConfig
    from deltalens.training.grpo.train import train_grpo

    out = tmp_path / "grpo"
    cfg = GRPOConfig(model=tiny_spec(), prompts_per_step=2, num_generations=2, learning_rate=1e-3, steps=2,
                     eval_every=2, eval_limit=2, save_every=1, max_new_tokens=16, report_to="tensorboard")
    train_grpo(cfg, out)
    rows = [r for r in _rows(out) if "reward_mean" in r]
    acc = _events(out)
    scalars = set(acc.Tags()["scalars"])
    # the shared names, and TRL's numbers under the names TRL's own report_to gives them
    assert SHARED | {"train/kl", "train/loss", "train/grad_norm", "train/learning_rate", "train/entropy",
                     "train/completions/mean_length"} <= scalars
    assert _steps(acc, "train/reward") == [1, 2] and _steps(acc, "eval/pass_at_1") == [0, 2]
    assert [e.value for e in acc.Scalars("train/kl")] == pytest.approx([r["kl"] for r in rows])
    assert [e.value for e in acc.Scalars("train/reward")] == pytest.approx([r["reward_mean"] for r in rows])
    hist = acc.Histograms("train/rewards")  # one reward per completion: P x G
    assert [h.step for h in hist] == [1, 2] and all(h.histogram_value.num == 4 for h in hist)
    assert not (out / ".trl").exists()


def test_a_resumed_es_run_shows_every_step_once(tmp_path):
    _needs("tensorboard")
    from deltalens.training.es.train import train_es

    cfg = ESConfig(model=tiny_spec(), iterations=4, report_to="tensorboard",
                   **{**TINY_ES, "checkpoint_every": 2, "eval_every": 0})

    def kill_at_3(done, total, row):
        if done == 3:
            raise KeyboardInterrupt  # after iteration 3 was logged, before any checkpoint of it

    out = tmp_path / "es"
    with pytest.raises(KeyboardInterrupt):
        train_es(cfg, out, progress=kill_at_3)
    assert _steps(_events(out), "train/reward") == [1, 2, 3]
    train_es(cfg, out, resume=True)  # redoes iteration 3 from the checkpoint at 2, then 4
    assert len(list((out / "tensorboard").iterdir())) == 2  # one event file per process
    acc = _events(out)
    rows = [r for r in _rows(out) if "reward_mean" in r]
    assert _steps(acc, "train/reward") == [1, 2, 3, 4]  # iteration 3 once: the killed run's is purged
    assert [e.value for e in acc.Scalars("train/reward")] == pytest.approx([r["reward_mean"] for r in rows])


def test_wandb_mode_of_the_user_is_respected(tmp_path, monkeypatch):
    _needs("wandb")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    with tracking.Tracker(tmp_path, "wandb") as t:
        t.log(1, {"train/reward": 0.5})
    assert not glob.glob(str(tmp_path / "wandb" / "offline-run-*"))  # disabled: W&B wrote no run
