"""benchmarks/append_train_log.py: a device run's steps appended to a committed head's log under
the run's name, cut at the committed checkpoint, the same bytes for the same rows, and the
mistakes a session can make (appending twice, a partial log, a step past the run) refused."""

import gzip
import json

import pytest

from scripts import load_script


def _run_log(path, steps):
    path.write_text("".join(json.dumps({"step": s, "loss": 2.0 - s / 100, "seconds": s * 0.1}) + "\n" for s in steps))
    return path


def _rows(path):
    return [json.loads(line) for line in gzip.open(path, "rt")]


def test_a_run_is_appended_under_its_name_up_to_the_committed_step(tmp_path):
    script = load_script("append_train_log")
    log = tmp_path / "train_log.jsonl.gz"
    assert script.append(log, _run_log(tmp_path / "a.jsonl", range(1, 6)), "session1") == 5  # a new log
    assert script.append(log, _run_log(tmp_path / "b.jsonl", range(1, 9)), "session2", upto=3) == 3
    rows = _rows(log)
    assert [(r["run"], r["step"]) for r in rows] == [("session1", s) for s in range(1, 6)] + [("session2", s) for s in (1, 2, 3)]
    assert list(rows[0]) == ["run", "step", "loss", "seconds"]
    # The same rows written elsewhere are the same bytes (no name or time in the gzip header).
    other = tmp_path / "elsewhere" / "log.jsonl.gz"
    other.parent.mkdir()
    script.append(other, tmp_path / "a.jsonl", "session1")
    script.append(other, tmp_path / "b.jsonl", "session2", upto=3)
    assert other.read_bytes() == log.read_bytes()


@pytest.mark.parametrize("steps, run, upto, words", [
    (range(1, 4), "session1", None, "already holds run 'session1'"),
    ([1, 2, 4], "session2", None, "do not run 1, 2, 3"),
    ([2, 3], "session2", None, "do not run 1, 2, 3"),
    (range(1, 4), "session2", 9, "--upto 9: the run logged steps 1 to 3"),
])
def test_mistakes_are_refused_and_the_log_is_left_as_it_was(tmp_path, steps, run, upto, words):
    script = load_script("append_train_log")
    log = tmp_path / "train_log.jsonl.gz"
    script.append(log, _run_log(tmp_path / "first.jsonl", range(1, 3)), "session1")
    before = log.read_bytes()
    with pytest.raises(SystemExit, match=words):
        script.append(log, _run_log(tmp_path / "next.jsonl", steps), run, upto)
    assert log.read_bytes() == before
