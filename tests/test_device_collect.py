"""benchmarks/h200_collect.sh, the copy that brings a device run's results back in every polling
call (a lent machine given back loses everything on it): within a call's return limits (8 files,
16 MiB each), the weights whole or in parts that join to the original, and the card, logs and the
data's generated rows (not the read corpus rows) in one archive."""

import json
import os
import shutil
import subprocess
import tarfile
import uuid
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "h200_collect.sh"


@pytest.fixture
def run_dir():
    name = f"dspark-collect-test-{uuid.uuid4().hex[:8]}"  # the script reads /tmp/NAME, as on the device
    run = Path("/tmp") / name
    run.mkdir()
    yield name, run
    shutil.rmtree(run, ignore_errors=True)


def collect(name, out, **env):
    return subprocess.run(["bash", str(SCRIPT), name], env={**os.environ, "OUT": str(out), **env},
                          capture_output=True, text=True, check=True).stdout


def test_collect_returns_head_logs_and_generated_rows(run_dir, tmp_path):
    name, run = run_dir
    (run / "config.json").write_text('{"block_size": 5}')
    weights = os.urandom(20_000_000)  # over the 16 MB a returned file may be: comes back in parts
    (run / "model.safetensors").write_bytes(weights)
    (run / "README.md").write_text("card")
    (run / "distill.log").write_text("log")
    rows = [{"ids": [1, 2], "prompt_len": 1, "generation": "greedy-batched"},
            {"ids": [3, 4], "prompt_len": 1, "generation": "corpus"},
            {"ids": [5, 6], "prompt_len": 1, "generation": "greedy"}]
    (run / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    out.mkdir()
    collect(name, out)
    returned = sorted(p.name for p in out.iterdir())
    assert len(returned) <= 8 and all(p.stat().st_size <= 16 * 2**20 for p in out.iterdir())
    parts = sorted(p for p in out.iterdir() if p.name.startswith("model.safetensors.part"))
    assert len(parts) == 2 and b"".join(p.read_bytes() for p in parts) == weights
    assert json.loads((out / "config.json").read_text()) == {"block_size": 5}
    with tarfile.open(out / "results.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["README.md", "distill.log", "generated.jsonl"]
        generated = [json.loads(line) for line in tar.extractfile("generated.jsonl").read().decode().splitlines()]
    assert [r["ids"] for r in generated] == [[1, 2], [5, 6]]


def test_collect_before_anything_exists_returns_nothing_and_succeeds(run_dir, tmp_path):
    name, _ = run_dir
    collect(name, tmp_path)
    assert list(tmp_path.iterdir()) == []
