"""benchmarks/gather_rows.py: a run's data rebuilt from the committed generated rows (heads and
data files do not outlive a session), each token sequence once, read-corpus rows after them."""

import gzip
import json
from pathlib import Path

from scripts import load_script

_mod = load_script("gather_rows")


def _write(path: Path, rows: list[dict], zipped: bool = True) -> Path:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    path.write_bytes(gzip.compress(text.encode()) if zipped else text.encode())
    return path


def test_gather_keeps_each_sequence_once_and_puts_extra_rows_last(tmp_path):
    a = _write(tmp_path / "distill9_generated.jsonl.gz", [{"ids": [1, 2], "set": "code_synth"}, {"ids": [3], "set": "math_synth"}])
    b = _write(tmp_path / "distill10_generated.jsonl.gz", [{"ids": [1, 2], "set": "code_synth_left"}, {"ids": [4], "set": "self_code"}])
    corpus = _write(tmp_path / "data.jsonl", [{"ids": [9], "set": "corpus:sharegpt", "generation": "corpus"}], zipped=False)
    out = tmp_path / "rows.jsonl.gz"
    sets = _mod.gather(out, [a, b], [corpus])
    rows = [json.loads(line) for line in gzip.open(out, "rt")]
    assert [r["ids"] for r in rows] == [[1, 2], [3], [4], [9]]
    assert sets == {"code_synth": 1, "math_synth": 1, "self_code": 1, "corpus:sharegpt": 1}


def test_rows_from_before_the_model_field_are_stamped_with_their_writer(tmp_path):
    # Rounds 9-12 wrote no "model"; the file name says which model wrote them, and a row without
    # one would pass for the training target's own (distill would skip its prompt).
    old = _write(tmp_path / "distill9_qwen05_generated.jsonl.gz", [{"ids": [1], "set": "a"}])
    new = _write(tmp_path / "distill13_qwen05_generated.jsonl.gz", [{"ids": [2], "set": "b", "model": "elsewhere"}])
    read = _write(tmp_path / "data.jsonl", [{"ids": [3], "set": "corpus:sharegpt", "generation": "corpus"}], zipped=False)
    out = tmp_path / "rows.jsonl.gz"
    _mod.gather(out, [old, new], [read])
    assert [r.get("model") for r in map(json.loads, gzip.open(out, "rt"))] == ["qwen2.5-coder-0.5b-q4-bfloat16", "elsewhere", None]


def test_the_committed_rows_are_found():
    # What the next session rebuilds its data from: every Qwen round since the ninth committed its rows.
    assert len(sorted(_mod.RESULTS.glob("distill*_generated.jsonl.gz"))) >= 6
