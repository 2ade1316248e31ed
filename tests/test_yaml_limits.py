"""`--config` YAML is read within limits (size, depth, values, integer length, no aliases) before any
coercion, and every refusal is one bounded line: hostile documents through the CLI (exit 2, one line, no
traceback, nothing written, the file untouched), then hypothesis-generated documents through the config
resolution (`make_config`): each either gives a config or one short DeltalensError, quickly.

Deterministic (derandomized hypothesis, fixed example counts) and a few seconds long.
"""

from __future__ import annotations

import hashlib
import time
import tracemalloc

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import run_cli

from deltalens.config import MAX_YAML_BYTES, MAX_YAML_DEPTH, brief, coerce, load_yaml
from deltalens.errors import DeltalensError
from deltalens.training.launch import make_config

FUZZ = settings(max_examples=200, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
MAX_LINE = 800  # the longest refusal: an unknown option followed by the list of known ones (grows with ESConfig)


def _laughs(levels: int = 9, width: int = 9, key: str = "task") -> str:
    """The billion-laughs document: each level an anchored list of `width` aliases of the previous one."""
    lines = ["l0: &l0 [" + ", ".join(["lol"] * width) + "]"]
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "\n".join(lines) + f"\n{key}: *l{levels - 1}\n"


HOSTILE = {
    "long-int": ("task: " + "1" * 5000 + "\n", "an integer of 5000 characters"),
    "nested-lists": ("task: " + "[" * 5000 + "\n", f"nested more than {MAX_YAML_DEPTH} levels deep"),
    "nested-maps": ("task: " + "{a: " * 5000 + "\n", f"nested more than {MAX_YAML_DEPTH} levels deep"),
    "laughs-known-key-only": ("task: &a [" + ", ".join(["x"] * 5) + "]\nsigma: *a\n", "YAML aliases"),
    "self-alias": ("task: &a [*a]\n", "YAML aliases"),
    "huge": ("task: arith\n" + "# padding\n" * (MAX_YAML_BYTES // 5), f"larger than {MAX_YAML_BYTES // 1024} KiB"),
    "many-values": ("task: [" + ", ".join(["1"] * 10_001) + "]\n", "more than 10000 values"),
    "sexagesimal": ("iterations: " + ":".join(["59"] * 300) + "\n", "an integer of"),
    "bad-tag-int": ("iterations: !!int twelve\n", "'twelve' is not a valid int"),
    "bad-tag-bool": ("antithetic: !!bool maybe\n", "'maybe' is not a valid bool"),
    "bad-timestamp": ("task: !!timestamp soon\n", "'soon' is not a valid timestamp"),
    "python-tag": ("task: !!python/object/apply:os.system [echo hi]\n", "could not determine a constructor"),
    "wrong-type": ("task: [" + ", ".join(["averyveryverylongword"] * 2000) + "]\n", "task must be a string (got ["),
    "preset-list": ("preset: [1, 2]\n", "unknown ES preset [1, 2]"),
    "method-list": ("method: [" + ", ".join(["x"] * 3000) + "]\n", "method must be one of"),
    "many-unknown": ("".join(f"k{i}{'z' * 200}: 1\n" for i in range(50)), "and 45 more"),
    "not-utf8": (b"task: \xff\xfe\n", "not UTF-8 text"),
}


def _snap(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def warm():
    run_cli(["train", "es", "--help"])  # import the CLI once, so the timings below are the refusal's own


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_config_is_refused_in_one_line(tmp_path, warm, case):
    text, match = HOSTILE[case]
    cfg = tmp_path / "bad.yaml"
    cfg.write_bytes(text if isinstance(text, bytes) else text.encode())
    before = _snap(cfg)
    out = tmp_path / "X"
    t0 = time.perf_counter()
    r = run_cli(["train", "es", "--config", cfg, "--out", out])
    seconds = time.perf_counter() - t0
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2, r
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.output, r.output[:2000]
    assert match in lines[0], lines[0]
    assert len(lines[0]) <= MAX_LINE, lines[0]
    assert seconds < 5, f"{case} took {seconds:.1f} s"
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]
    assert _snap(cfg) == before


def test_billion_laughs_is_refused_at_once_in_little_memory(tmp_path, warm):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(_laughs())  # 9**9 leaves under a known key: it ran 139 s and grew to 6.4 GB
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        r = run_cli(["train", "es", "--config", cfg, "--out", tmp_path / "X"])
        seconds, peak = time.perf_counter() - t0, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "YAML aliases" in r.output, r
    assert seconds < 2 and peak < 16 << 20, (seconds, peak)
    assert not (tmp_path / "X").exists()


def test_bomb_under_chain_stage_is_refused(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(_laughs().replace("task: *l8", "es:\n  task: *l8"))
    r = run_cli(["train", "chain", "--config", cfg, "--out", tmp_path / "X"])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "YAML aliases" in r.output, r
    assert not (tmp_path / "X").exists()


def test_anchor_without_alias_and_ordinary_config_still_load(tmp_path):
    cfg = tmp_path / "ok.yaml"
    cfg.write_text("task: &t arith\nsigma: 0.01\npopulation: 8\nkeys: !!binary aGk=\n")
    assert load_yaml(cfg) == {"task": "arith", "sigma": 0.01, "population": 8, "keys": b"hi"}
    cfg.write_text("es: {sigma: 0.02}\ngrpo: {learning_rate: 3.0e-5}\nmethods: [es, grpo]\n")
    config, _ = make_config("chain", yaml_path=cfg)
    assert config.stage_options["es"] == {"sigma": 0.02} and config.methods == ("es", "grpo")


def test_coerce_messages_are_bounded_and_built_only_when_bad():
    class Loud(list):  # a value whose repr would be huge and slow: only a bounded part is ever walked
        def __repr__(self):
            raise AssertionError("coerce walked the whole value")

    shared = [1] * 10
    for _ in range(30):  # 10**30 leaves reached through shared references
        shared = [shared] * 10
    with pytest.raises(DeltalensError) as e:
        coerce(shared, str, "task", "cfg.yaml")
    assert str(e.value).startswith("cfg.yaml: task must be a string (got [[[") and len(str(e.value)) < 200
    assert coerce(("a", "b"), tuple[str, ...], "x", "s") == ("a", "b")
    assert coerce("3", int, "x", "s") == 3
    for bad in ("²", "1" * 5000):  # isdigit() accepts both; int() refuses "²" and the 5000 digits
        with pytest.raises(DeltalensError, match="x must be an integer"):
            coerce(bad, int, "x", "s")
    with pytest.raises(DeltalensError, match="x must be a number"):
        coerce(10 ** 400, float, "x", "s")
    assert len(brief("y" * 10_000)) <= 80 and len(brief(Loud([1]))) <= 80


# ---- hypothesis: documents made of YAML's syntax, and dumped random values, under known and unknown keys

KEYS = st.sampled_from(["task", "sigma", "population", "model", "preset", "method", "es", "grpo", "methods",
                        "fractions", "budget", "antithetic", "nokey"])
TOKENS = st.sampled_from(["[", "]", "{", "}", ", ", ": ", "- ", "\n", "\n  ", "&a ", "*a", "&b ", "*b", "!!int ",
                          "!!float ", "!!bool ", "!!str ", "!!timestamp ", "!!binary ", "!!set ", "!!omap ",
                          "!!python/object:os.system ", "? ", "<<: ", "'", '"', "#", "|", ">", "~", "null",
                          "true", "0x1F", "0o17", "1_000", "1:30", "-.inf", ".nan", "3e-3", "2001-12-14",
                          "2001-02-30", "x", "é", "\t", "%YAML 1.1\n", "---\n", "...\n", "9" * 120])
VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                      lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=5), kids, max_size=4),
                      max_leaves=30)


def _check(path, method):
    t0 = time.perf_counter()
    try:
        make_config(method, yaml_path=path)
    except DeltalensError as e:
        msg = str(e)
        assert "\n" not in msg and 0 < len(msg) <= MAX_LINE, msg
    assert time.perf_counter() - t0 < 2


@FUZZ
@given(key=KEYS, body=st.lists(TOKENS, max_size=40), method=st.sampled_from(["es", "grpo", "chain"]))
def test_syntax_soup_gives_a_config_or_one_line(tmp_path, key, body, method):
    path = tmp_path / "c.yaml"
    path.write_text(f"{key}: " + "".join(body), encoding="utf-8")
    _check(path, method)


@FUZZ
@given(doc=st.dictionaries(KEYS, VALUES, max_size=5), method=st.sampled_from(["es", "grpo", "chain"]),
       depth=st.integers(0, 40))
def test_dumped_values_give_a_config_or_one_line(tmp_path, doc, method, depth):
    for _ in range(depth % 8 if depth < 35 else depth):  # now and then deeper than the limit
        doc = {"task": [doc]}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True), encoding="utf-8")
    _check(path, method)
