"""benchmarks/slim_checkout.sh: device calls from a local branch without docs/, tests/ and
fixtures/ (each call carries the tracked files beside its ship part, 64 MiB in all), and back to
the branch it came from with every file restored."""

import shutil
import subprocess

import pytest

from scripts import BENCHMARKS

SCRIPT = BENCHMARKS / "slim_checkout.sh"


def git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    r = tmp_path / "repo"
    for path, text in {"dspark_lab/engine.py": "x = 1\n", "benchmarks/run.sh": "echo\n", "docs/results/rows.jsonl": "big\n" * 1000,
                       "tests/test_x.py": "def test(): pass\n", "fixtures/head/model.safetensors": "w" * 5000, "README.md": "readme\n"}.items():
        (r / path).parent.mkdir(parents=True, exist_ok=True)
        (r / path).write_text(text)
    shutil.copy(SCRIPT, r / "benchmarks" / "slim_checkout.sh")
    git(tmp_path, "init", "-q", "-b", "work", str(r))
    git(r, "add", "-A")
    git(r, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "start")
    return r


def slim(repo, what):
    return subprocess.run(["bash", "benchmarks/slim_checkout.sh", what], cwd=repo, capture_output=True, text=True)


def test_on_leaves_out_what_the_device_never_reads_and_off_restores_it(repo):
    head = git(repo, "rev-parse", "HEAD")
    on = slim(repo, "on")
    assert on.returncode == 0, on.stderr
    assert git(repo, "branch", "--show-current") == "device-slim"
    assert sorted(git(repo, "ls-files").split()) == ["README.md", "benchmarks/run.sh", "benchmarks/slim_checkout.sh", "dspark_lab/engine.py"]
    assert not (repo / "docs").exists() and not (repo / "fixtures").exists() and "kB tracked" in on.stdout
    again = slim(repo, "on")
    assert again.returncode == 1 and "already slim" in again.stderr
    off = slim(repo, "off")
    assert off.returncode == 0, off.stderr
    assert git(repo, "branch", "--show-current") == "work" and git(repo, "rev-parse", "HEAD") == head
    assert (repo / "docs/results/rows.jsonl").read_text() == "big\n" * 1000 and (repo / "fixtures/head/model.safetensors").exists()
    assert "device-slim" not in git(repo, "branch", "--list")


def test_uncommitted_changes_are_refused_not_lost(repo):
    (repo / "dspark_lab/engine.py").write_text("x = 2\n")
    r = slim(repo, "on")
    assert r.returncode == 1 and "uncommitted changes" in r.stderr
    assert git(repo, "branch", "--show-current") == "work" and (repo / "dspark_lab/engine.py").read_text() == "x = 2\n"
    git(repo, "checkout", "--", ".")
    assert slim(repo, "on").returncode == 0
    (repo / "dspark_lab/engine.py").write_text("x = 3\n")  # an edit made while slim would go with the branch
    r = slim(repo, "off")
    assert r.returncode == 1 and "would be lost" in r.stderr and git(repo, "branch", "--show-current") == "device-slim"


def test_off_when_not_slim_says_so(repo):
    r = slim(repo, "off")
    assert r.returncode == 1 and "not slim" in r.stderr
