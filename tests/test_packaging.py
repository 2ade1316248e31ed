"""The wheel installs deltalens, deltalens.cli and deltalens.reports, and no generic top-level names."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_layout_and_import(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path / "dist"), str(ROOT)], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("deltalens-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "deltalens/cli/main.py" in names and "deltalens/reports/render.py" in names
    assert "deltalens/tiny/model/model.safetensors" in names and "deltalens/tiny/model/tokenizer.json" in names
    assert any(n.startswith("deltalens/reports/templates/") for n in names)
    # every package of the source tree is in the wheel (a subpackage missing from pyproject's list
    # installs an editable checkout fine and breaks `pip install .`: deltalens.analysis.diversity did)
    sources = {"deltalens": ROOT / "deltalens", "deltalens/cli": ROOT / "cli", "deltalens/reports": ROOT / "reports"}
    for prefix, top in sources.items():
        for init in top.rglob("__init__.py"):
            if "__pycache__" not in init.parts:
                rel = init.relative_to(top).as_posix()
                assert f"{prefix}/{rel}" in names, f"{prefix}/{rel} is not in the wheel: list it in pyproject.toml"
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"deltalens"}, tops  # never a top-level `cli` or `reports`
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "deltalens = deltalens.cli.main:main" in zipfile.ZipFile(wheel).read(entry).decode()
    # install it into a private target dir and import from there, ahead of the editable install
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                        str(wheel)], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    code = ("import deltalens, deltalens.cli.main, deltalens.reports, importlib.util as u;"
            "print(deltalens.__file__); print(deltalens.cli.main.__file__); print(deltalens.reports.__file__);"
            "print(u.find_spec('cli') is None and u.find_spec('reports') is None)")
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.split()
    assert all(line.startswith(str(site)) for line in lines[:3]), lines
    assert lines[3] == "True"


def test_editable_install_maps_cli_and_reports():
    code = ("import deltalens.cli.main, deltalens.reports, importlib.util as u;"
            "print(deltalens.cli.main.__file__); print(deltalens.reports.__file__);"
            "print(u.find_spec('cli') is None and u.find_spec('reports') is None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.split()
    assert lines[0] == str(ROOT / "cli" / "main.py") and lines[1] == str(ROOT / "reports" / "__init__.py")
    assert lines[2] == "True"


def test_console_script():
    exe = Path(sys.executable).parent / "deltalens"
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, check=False)
    assert out.returncode == 0 and "eval" in out.stdout
