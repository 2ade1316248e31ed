"""`deltalens probe` records the base's Pass@K curve at each sampling temperature (default 0.6 and 1.0, the
paper's evaluation temperature and GRPO's training one): a `sampled` entry per temperature in the JSON, a
Pass@K row per temperature in the table, both temperatures' generations in the up-front plan line;
`--temperature T` is one temperature as before, and the two options together are refused in one line."""

from __future__ import annotations

import json

import pytest
from support import run_cli, tiny_spec

from deltalens.analysis import probe as probe_mod
from deltalens.analysis.probe import (
    PROBE_TEMPERATURES,
    check_probe_options,
    probe,
    probe_temperatures,
    signal_temperature,
)
from deltalens.errors import DeltalensError
from deltalens.schema import validate
from deltalens.tasks import get_task

SMALL = {"limit": 2, "samples": 2, "group": 2, "es_populations": 0, "max_new_tokens": 8}


def test_which_temperatures_and_which_one_the_signal_is():
    assert probe_temperatures(None, None) == PROBE_TEMPERATURES == (0.6, 1.0)
    assert probe_temperatures(0.7, None) == (0.7,) and probe_temperatures(None, [1.0, 0.3]) == (1.0, 0.3)
    assert signal_temperature((0.6, 1.0)) == 1.0  # GRPO's training temperature when probed
    assert signal_temperature((0.3, 0.8)) == 0.3 and signal_temperature((0.7,)) == 0.7  # else the first


@pytest.mark.parametrize("kw,message", [
    ({"temperatures": (0.6, -1.0)}, "--temperatures must be finite numbers >= 0 (got 0.6,-1); 0 is greedy"),
    ({"temperatures": (float("nan"),)}, "--temperatures must be finite numbers >= 0 (got nan)"),
    ({"temperatures": ()}, "--temperatures must be finite numbers >= 0 (got none)"),
    ({"temperatures": (0.6, 0.6)}, "--temperatures lists a temperature twice (got 0.6,0.6)"),
    ({"temperature": 0.7, "temperatures": (0.6, 1.0)}, "the signal temperature 0.7 must be one of the temperatures"),
    ({"temperature": -1.0}, "--temperature must be a finite number >= 0 (got -1.0); 0 is greedy"),
])
def test_bad_temperatures_are_refused(kw, message):
    with pytest.raises(DeltalensError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        check_probe_options(**kw)
    check_probe_options(temperatures=(0.0, 0.6, 1.0))  # greedy is a temperature too


def test_a_pass_at_k_curve_per_temperature_each_as_if_sampled_alone():
    task = get_task("arith")
    res = probe(tiny_spec(), task, **SMALL)
    assert res["temperatures"] == [0.6, 1.0] and res["temperature"] == 1.0
    assert [s["temperature"] for s in res["sampled"]] == [0.6, 1.0]
    for s in res["sampled"]:
        assert set(s["pass_at_k"]) == {"1", "2"} and s["curve"]["k"] == [1, 2] and len(s["curve"]["pass"]) == 2
        assert s["grpo_groups"] == 2 and "rewards" not in s  # 2 problems x (2 samples / G 2); rewards not kept
    hot = res["sampled"][1]  # the headline numbers, the GRPO signal and the verdict are T=1.0's
    assert (res["pass_at_k"], res["mean_reward"], res["format_rate"]) == (hot["pass_at_k"], hot["mean_reward"],
                                                                         hot["format_rate"])
    assert res["grpo"]["share_with_signal"] == hot["grpo_share_with_signal"] and res["grpo"]["temperature"] == 1.0
    alone = probe(tiny_spec(), task, temperature=1.0, **SMALL)  # one temperature, as before
    assert alone["temperatures"] == [1.0] and len(alone["sampled"]) == 1
    assert alone["pass_at_k"] == hot["pass_at_k"] and alone["examples"] == res["examples"]  # the same seeded draws


def test_cli_table_json_and_plan_line(tmp_path):
    out = tmp_path / "p.json"
    r = run_cli(["probe", tiny_spec(), "--limit", "2", "-n", "2", "-G", "2", "--es-populations", "0",
                 "--max-new-tokens", "8", "--json", out])
    assert r.exit_code == 0, r.output
    assert r.stderr.splitlines()[0].startswith(
        "probe (sampled at T=0.6, 1): 1 model x 2 temperatures x 2 problems x 2 samples = 8 generations "), r.stderr
    for t in ("0.6", "1"):
        assert f"Pass@1 (sampled, T={t})" in r.stdout and f"Pass@2 (sampled, T={t})" in r.stdout
    assert "GRPO groups of 2 with unequal rewards, T=1" in r.stdout
    doc = json.loads(out.read_text())
    validate(doc)
    res = doc["probe"]["model"]
    assert res["temperatures"] == [0.6, 1.0] and [s["temperature"] for s in res["sampled"]] == [0.6, 1.0]
    assert all(set(s["pass_at_k"]) == {"1", "2"} for s in res["sampled"])


@pytest.fixture
def stop_at_first_pass(monkeypatch, tmp_path):
    """The probe stops where its sampled pass opens its progress bar (no model loads): what the CLI says up
    front, and what it hands the probe, without any generation."""
    seen = {}

    class Engine:
        def close(self):
            pass

    def first_pass(gen, task, problems, samples, group, temps, signal_t, *a):
        seen.update(temps=temps, signal=signal_t)
        a[-1]("sampled", len(problems) * samples * len(temps))
        raise DeltalensError("stopped before any work")

    monkeypatch.delenv("DELTALENS_PROGRESS_EVERY", raising=False)
    monkeypatch.setenv("DELTALENS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(probe_mod, "backend_for_spec", lambda *a, **kw: (Engine(), None, None))
    monkeypatch.setattr(probe_mod, "_passes", first_pass)
    return seen


@pytest.mark.parametrize("args,temps,signal,plan", [
    ([], (0.6, 1.0), 1.0, ("probe (sampled at T=0.6, 1): 1 model x 2 temperatures x 5 problems x 8 samples = 80 "
                          "generations")),
    (["--temperature", "0.7"], (0.7,), 0.7, "probe: 1 model x 5 problems x 8 samples = 40 generations"),
    (["--temperatures", "0.2,0.6,1.0"], (0.2, 0.6, 1.0), 1.0,
     "probe (sampled at T=0.2, 0.6, 1): 1 model x 3 temperatures x 5 problems x 8 samples = 120 generations"),
    (["--temperatures", "0.3,0.8"], (0.3, 0.8), 0.3, "x 2 temperatures x 5 problems x 8 samples = 80 generations"),
])
def test_the_plan_line_counts_every_temperature(stop_at_first_pass, args, temps, signal, plan):
    r = run_cli(["probe", tiny_spec(), "--limit", "5", "-n", "8", "--es-populations", "0", *args])
    assert r.exit_code == 2 and plan in r.stderr.splitlines()[0], r.stderr
    assert stop_at_first_pass == {"temps": temps, "signal": signal}


def test_temperatures_from_a_config_file(stop_at_first_pass, tmp_path):
    f = tmp_path / "probe.yaml"
    f.write_text("temperatures: [0.5, 1.0]\n")
    r = run_cli(["probe", tiny_spec(), "--limit", "5", "-n", "8", "--es-populations", "0", "--config", f])
    assert r.exit_code == 2 and stop_at_first_pass == {"temps": (0.5, 1.0), "signal": 1.0}, r.output


@pytest.mark.parametrize("args,message", [
    (["--temperature", "0.6", "--temperatures", "0.6,1.0"], "error: give --temperature or --temperatures, not both"),
    (["--temperatures", "0.6,0.6"], "error: --temperatures lists a temperature twice (got 0.6,0.6)"),
    (["--temperatures", "0.6,-1"], "error: --temperatures must be finite numbers >= 0 (got 0.6,-1); 0 is greedy"),
])
def test_refused_in_one_line_before_any_work(monkeypatch, tmp_path, args, message):
    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr(probe_mod, "backend_for_spec", no_load)
    r = run_cli(["probe", tiny_spec(), "--json", tmp_path / "p.json", *args])
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2 and lines == [message], r.output
    assert not (tmp_path / "p.json").exists()


def test_the_clis_options_and_default_text_come_from_probe_config():
    from deltalens.cli import options as o

    from deltalens.analysis.options import ProbeConfig

    assert ProbeConfig().temperature is None and ProbeConfig().temperatures is None  # neither: the default
    assert probe_mod.PROBE_TEMPERATURES is PROBE_TEMPERATURES  # one constant, torch-free in analysis.options
    params = {p.name: p for p in o.config_params(ProbeConfig)}
    help_text = params["temperatures"].annotation.__metadata__[0].help
    assert help_text.endswith("\\[default: 0.6,1.0]") and "[default" not in params["temperature"].annotation.__metadata__[0].help
    assert ProbeConfig.resolve(yaml={"temperatures": "0.6,1.0"}).temperatures == (0.6, 1.0)
    with pytest.raises(DeltalensError, match="give --temperature or --temperatures, not both"):
        ProbeConfig.resolve(given={"temperature": 0.5, "temperatures": "0.6"})
