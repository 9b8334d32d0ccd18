"""benchmarks/prompt_twins.py: the training prompt most like each held-out one, and which are twins."""

import json

from dspark_lab.lab.prompts import load_prompt_set

from scripts import load_script

pt = load_script("prompt_twins")


def test_a_reworded_copy_is_flagged_and_unrelated_requests_are_not(tmp_path, capsys):
    held = load_prompt_set("math", limit=8).prompts
    copied = pt.prompt_text(next(p for p in held if p.id == "math-008")).replace("10", "12")
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(json.dumps(r) for r in [
        {"id": "t1", "domain": "math", "text": copied},
        {"id": "t2", "domain": "code", "text": "Write a Go HTTP handler that streams server-sent events to the browser."},
    ]) + "\n")
    rows = pt.main(["--sets", "math", "--limit", "8", str(train)])
    by_id = {r["prompt"]: r for r in rows}
    assert len(rows) == 8 and by_id["math-008"]["nearest"] == "t1" and by_id["math-008"]["likeness"] >= 0.8
    assert all(r["likeness"] < 0.5 for r in rows if r["prompt"] != "math-008")
    out = capsys.readouterr().out
    assert "TWIN math-008" in out and "1 of 8 held-out prompts" in out


def test_jaccard_of_word_sets():
    assert pt.jaccard(pt.words("Sort a list"), pt.words("sort A LIST")) == 1.0
    assert pt.jaccard(pt.words("sort a list"), pt.words("merge two dicts")) == 0.0
    assert pt.jaccard(frozenset(), frozenset()) == 0.0
