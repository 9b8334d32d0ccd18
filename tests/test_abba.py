"""benchmarks/abba.py: each arm's processes in mirrored order, each arm with its own root and
environment, every process's rows folded into one summary (a stand-in script records what it was
run with)."""

from __future__ import annotations

import json

import pytest
from scripts import load_script

abba = load_script("abba")

STAND_IN = """
import json, os, sys
from pathlib import Path
out = sys.argv[sys.argv.index("--json") + 1]
arm = Path(__file__).resolve().parents[1].name
slow = float(os.environ.get("SLOWER", "1"))
rows = [{"prompt": "code-001", "cap": 7, "nodes": n, "round_ms": 3.0 * slow, "build_ms": 2.5, "launch_ms": 2.0, "read_ms": 0.1,
         "greedy_ms_per_token": 2.0, "greedy_launch_ms": 1.5, "over_greedy": 1.9, "accept": 2.8} for n in (0, 15)]
Path(out).write_text(json.dumps({"rows": rows, "primitives": {"greedy": {"Add": 3}}}))
with open(os.environ["CALLS"], "a") as f:
    f.write(f"{arm} {os.environ.get('SLOWER', '-')} {' '.join(sys.argv[1:sys.argv.index('--json')])}\\n")
"""


@pytest.fixture
def roots(tmp_path):
    for name in ("old", "new"):
        (tmp_path / name / "benchmarks").mkdir(parents=True)
        (tmp_path / name / "benchmarks" / "round_host_time.py").write_text(STAND_IN)
    return tmp_path


def test_arms_run_in_mirrored_order_with_their_roots_and_environments(roots, monkeypatch):
    monkeypatch.setenv("CALLS", str(roots / "calls.txt"))  # where each stand-in process says what it ran with
    out = roots / "out"
    summary = abba.main(["--out", str(out), "--arm", f"old={roots / 'old'}", "--arm", f"new={roots / 'new'}",
                         "--arm", f"slow={roots / 'new'}", "--env", "slow:SLOWER=2", "--", "--model", "m"])
    calls = (roots / "calls.txt").read_text().split("\n")[:-1]
    assert calls == ["old - --model m", "new - --model m", "new 2 --model m", "new 2 --model m", "new - --model m", "old - --model m"]
    assert summary["new"]["arms"]["cap 7 chain"]["round_ms"] == 3.0 and summary["slow"]["arms"]["cap 7 tree 15"]["round_ms"] == 6.0
    assert summary["old"]["primitives"] == {"greedy": 3}
    saved = json.loads((out / "summary.json").read_text())
    assert [p["arm"] for p in saved["processes"]] == ["old", "new", "slow", "slow", "new", "old"]
    assert saved["env"] == {"slow": {"SLOWER": "2"}} and sorted(p.name for p in out.iterdir()) == ["abba.log", "summary.json"]


def test_an_arm_without_the_script_or_an_env_for_no_arm_is_refused(roots, capsys):
    with pytest.raises(SystemExit):
        abba.main(["--out", str(roots / "o"), "--arm", f"x={roots / 'nowhere'}", "--", "--model", "m"])
    assert "a checkout root holding benchmarks/round_host_time.py" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        abba.main(["--out", str(roots / "o"), "--arm", f"old={roots / 'old'}", "--env", "other:A=1", "--", "--model", "m"])
    assert "ARM:VAR=VALUE for one of the arms ['old']" in capsys.readouterr().err


def test_order_mirrors_the_arms():
    assert abba.order(["a", "b", "c"]) == ["a", "b", "c", "c", "b", "a"]
