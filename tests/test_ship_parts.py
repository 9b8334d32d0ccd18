"""benchmarks/ship_parts.sh: parts for the GPU machine sized to travel beside the checkout (a call
carries the tracked files and the part, 64 MiB in all), that join and unpack to the files packed,
and a re-cut of existing parts that keeps their sha256."""

import hashlib
import os
import subprocess
import tarfile

from scripts import BENCHMARKS

SCRIPT = BENCHMARKS / "ship_parts.sh"


def _repo(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    (repo / "tracked.bin").write_bytes(os.urandom(1_000_000))
    subprocess.run(["git", "add", "tracked.bin"], cwd=repo, check=True)
    shared = tmp_path / "shared" / "device"
    shared.mkdir(parents=True)
    (shared / "recv.sh").write_text("#!/usr/bin/env bash\necho recv\n")
    return repo, shared


def _ship(repo, shared, *args, part_bytes=None):
    env = {**os.environ, "SHARED_DEVICE": str(shared)}
    if part_bytes:
        env["PART_BYTES"] = str(part_bytes)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=repo, env=env, capture_output=True, text=True, check=True).stdout


def _manifest(part):
    return dict(line.split("=", 1) for line in (part / "manifest").read_text().splitlines())


def test_parts_fit_beside_the_checkout_and_unpack_to_the_files(tmp_path):
    repo, shared = _repo(tmp_path)
    data = tmp_path / "data"
    data.mkdir()
    payload = os.urandom(3_000_000)  # does not compress: three parts at 1 MB
    (data / "weights.bin").write_bytes(payload)
    said = _ship(repo, shared, "weights", "-C", str(data), "weights.bin", part_bytes=1_000_000)
    parts = sorted((repo / ".device" / "weights").iterdir())
    assert [p.name for p in parts] == ["p00", "p01", "p02", "p03"] and "4 part(s)" in said
    assert all((p / f"part.{p.name[1:]}").stat().st_size <= 1_000_000 for p in parts)
    assert {_manifest(p)["parts"] for p in parts} == {"4"} and (parts[0] / "recv.sh").read_text() == (shared / "recv.sh").read_text()
    blob = b"".join((p / f"part.{p.name[1:]}").read_bytes() for p in parts)
    assert hashlib.sha256(blob).hexdigest() == _manifest(parts[0])["sha256"]
    (tmp_path / "blob.tgz").write_bytes(blob)
    with tarfile.open(tmp_path / "blob.tgz") as tar:
        assert tar.extractfile("weights.bin").read() == payload
    # Re-cut to another size: the same blob, so the same sha256, in fewer parts.
    _ship(repo, shared, "--recut", "weights", part_bytes=2_000_000)
    recut = sorted((repo / ".device" / "weights").iterdir())
    assert len(recut) == 2 and _manifest(recut[0])["sha256"] == _manifest(parts[0])["sha256"]
    # The default size leaves room for the tracked files: 60 MiB less them, in whole MB.
    said = _ship(repo, shared, "small", "-C", str(data), "weights.bin")
    assert f"of up to {(60 * 2**20 - 1_000_000) // 1_000_000} MB" in said
