"""The safetensors reader never trusts a header: random headers and truncations of a small real file either
give a clean DeltalensError or exactly the values the reference reader (safetensors.safe_open) reads.

Deterministic (derandomized hypothesis, fixed example counts) and a few seconds long.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltalens.errors import DeltalensError
from deltalens.io.atomic import save_state_dict
from deltalens.io.tensors import load_state_dict

safetensors = pytest.importorskip("safetensors")

FUZZ = settings(max_examples=250, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
TENSORS = {
    "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
    "b": torch.tensor([1.5, -2.0, 3.25], dtype=torch.float16),
    "c": torch.arange(4, dtype=torch.int64),
    "d": torch.tensor([True, False, True]),
    "e": torch.zeros(0, 4),                       # no bytes at all
    "f": torch.tensor(7.0),                       # a scalar: shape []
}


@pytest.fixture(scope="module")
def real_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("st") / "real.safetensors"
    save_state_dict(TENSORS, path, metadata={"format": "pt"})
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return raw, json.loads(raw[8:8 + n]), raw[8 + n:]


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _trusted(path) -> dict[str, torch.Tensor] | None:
    """What the reference reader makes of the file (None: it refuses it)."""
    try:
        with safetensors.safe_open(str(path), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a dict
    except Exception:  # noqa: BLE001 - any refusal of the reference reader counts as a refusal
        return None


def check_file(path) -> str:
    """The property: a clean DeltalensError, or the reference reader's values. Returns which."""
    try:
        ours = load_state_dict(path)
    except DeltalensError as e:
        assert "\n" not in str(e), "errors are one line"
        return "refused"
    ref = _trusted(path)
    assert ref is not None, "accepted a file the reference reader refuses"
    assert ours.keys() == ref.keys()
    for k, t in ours.items():
        assert t.dtype == ref[k].dtype and t.shape == ref[k].shape, k
        assert _bytes(t) == _bytes(ref[k]), k
    return "read"


def _write(tmp_path, header, data, pad_to: int | None = None) -> object:
    text = json.dumps(header, separators=(",", ":")).encode()
    if pad_to is not None and pad_to > len(text):
        text += b" " * (pad_to - len(text))
    path = tmp_path / "fuzz.safetensors"
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)
    return path


# values a hostile header may hold where a number, a list or a string belongs
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.integers(-8, 200)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
small_ints = st.integers(-8, 200)


@st.composite
def mutated_headers(draw, header: dict):
    """The real header with a few random edits: fields replaced, offsets nudged, entries dropped or added."""
    h = json.loads(json.dumps(header))
    names = sorted(k for k in h if k != "__metadata__")
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(names))
        what = draw(st.sampled_from(["dtype", "shape", "offsets", "nudge", "drop_key", "drop", "meta", "swap"]))
        entry = h.get(name)
        if not isinstance(entry, dict):
            continue
        if what == "dtype":
            entry["dtype"] = draw(st.sampled_from(["F32", "F16", "BF16", "I64", "I8", "U8", "BOOL", "F64", "X9"])
                                  | json_values)
        elif what == "shape":
            entry["shape"] = draw(st.lists(small_ints, max_size=3) | json_values)
        elif what == "offsets":
            entry["data_offsets"] = draw(st.lists(small_ints, min_size=0, max_size=3) | json_values)
        elif what == "nudge":  # the subtle lie: plausible offsets a few bytes off
            offsets = entry.get("data_offsets")
            if isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets):
                entry["data_offsets"] = [offsets[0] + draw(st.integers(-8, 8)),
                                         offsets[1] + draw(st.integers(-8, 8))]
        elif what == "drop_key":
            entry.pop(draw(st.sampled_from(["dtype", "shape", "data_offsets"])), None)
        elif what == "drop":
            h.pop(name)
        elif what == "meta":
            h["__metadata__"] = draw(json_values | st.dictionaries(st.text(max_size=3), st.text(max_size=3)))
        else:  # swap two tensors' offsets: a consistent file only if their sizes agree
            other = draw(st.sampled_from(names))
            if isinstance(h.get(other), dict):
                entry["data_offsets"], h[other]["data_offsets"] = h[other]["data_offsets"], entry["data_offsets"]
    return h


def test_the_real_file_reads_like_the_reference(real_file, tmp_path):
    raw, _, _ = real_file
    (tmp_path / "ok.safetensors").write_bytes(raw)
    assert check_file(tmp_path / "ok.safetensors") == "read"


@FUZZ
@given(data=st.data())
def test_random_headers_are_refused_or_read_exactly(real_file, tmp_path, data):
    raw, header, body = real_file
    h = data.draw(mutated_headers(header))
    n = int.from_bytes(raw[:8], "little")
    check_file(_write(tmp_path, h, body, pad_to=data.draw(st.sampled_from([None, n]))))


@FUZZ
@given(cut=st.integers(0, 400), extra=st.binary(max_size=16))
def test_truncated_or_extended_files_are_refused_or_read_exactly(real_file, tmp_path, cut, extra):
    raw, _, _ = real_file
    path = tmp_path / "cut.safetensors"
    path.write_bytes(raw[:cut] + (extra if cut >= len(raw) else b""))
    check_file(path)


@FUZZ
@given(flips=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), min_size=1, max_size=4))
def test_byte_flips_in_the_header_are_refused_or_read_exactly(real_file, tmp_path, flips):
    raw, _, _ = real_file
    b = bytearray(raw)
    for pos, value in flips:
        b[pos % (8 + int.from_bytes(raw[:8], "little"))] = value
    path = tmp_path / "flip.safetensors"
    path.write_bytes(bytes(b))
    check_file(path)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda h: h["a"].update(data_offsets=[-8, 16]), "tensor a has data_offsets"),
    (lambda h: h["a"].update(data_offsets="0,24"), "tensor a has data_offsets"),
    (lambda h: h["a"].update(data_offsets=[0]), "tensor a has data_offsets"),
    (lambda h: h["a"].update(shape=[-2, -3]), "tensor a has shape"),
    (lambda h: h["a"].update(dtype="Q4"), "tensor a has unknown dtype"),
    (lambda h: h.update(__metadata__={"format": 1}), "__metadata__"),
])
def test_each_rule_names_the_tensor(real_file, tmp_path, edit, message):
    _, header, body = real_file
    h = json.loads(json.dumps(header))
    edit(h)
    with pytest.raises(DeltalensError, match=message):
        load_state_dict(_write(tmp_path, h, body))


def test_shifted_offsets_are_refused(real_file, tmp_path):
    """Every offset moved by the same amount (data appended so the last tensor still fits): the bytes read
    would be other tensors' and padding. Refused: the data section must be tiled exactly."""
    _, header, body = real_file
    h = json.loads(json.dumps(header))
    for k, e in h.items():
        if k != "__metadata__":
            e["data_offsets"] = [e["data_offsets"][0] + 4, e["data_offsets"][1] + 4]
    with pytest.raises(DeltalensError, match="belong to no tensor"):
        load_state_dict(_write(tmp_path, h, body + b"\0" * 4))
