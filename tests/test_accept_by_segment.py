"""benchmarks/accept_by_segment.py: a head's teacher-forced accept length split by the kind of
text each anchor drafts into (prose, fence lines, code of a fenced block's language), per set."""

import gzip
import json

import pytest

from dspark_lab.engine.loading import load_tokenizer

from scripts import load_script


def test_tokens_take_the_kind_of_the_line_they_start_in():
    seg = load_script("accept_by_segment")
    pieces = ["Here", " is", ":\n\n", "```", "ts", "\n", "const", " x", ";\n", "```", "\n", "Done", ".\n", "```\n", "ls", "\n```"]
    assert seg.token_kinds(pieces) == ["prose"] * 3 + ["fence"] * 3 + ["code:typescript"] * 3 + ["fence"] * 2 + ["prose"] * 2 \
        + ["fence", "code:?", "fence"]
    assert [k for _, k in seg.line_kinds("a\n```Python3 main.py\nx\n```")] == ["prose", "fence", "code:python", "fence"]


def test_anchors_are_counted_under_the_text_they_draft_into(tiny_dirs, tmp_path):
    seg = load_script("accept_by_segment")
    tok = load_tokenizer(tiny_dirs["qwen3"])
    prompt = tok.encode("Write it.")
    answer = tok.encode("Sure:\n```py\nx = 1\ny = 2\n```\nThat sets x and y.")
    kinds = seg.token_kinds([tok.decode([t]) for t in answer])
    assert {"prose", "fence", "code:python"} <= set(kinds)
    rows = tmp_path / "rows.jsonl.gz"
    with gzip.open(rows, "wt") as f:
        f.write(json.dumps({"ids": prompt + answer, "prompt_len": len(prompt), "set": "held30_code", "prompt_id": "q1"}) + "\n")
    offsets = list(range(len(answer) - 1))
    accepted = [3 if kinds[o + 1] == "code:python" else 0 for o in offsets]  # the head drafts code well, prose not at all
    anchors = tmp_path / "anchors.jsonl.gz"
    with gzip.open(anchors, "wt") as f:
        for head in ("/ship/head", "/tmp/other"):
            f.write(json.dumps({"head": head, "prompt_id": "q1", "set": "held30_code", "prompt_len": len(prompt),
                                "offsets": offsets, "accepted": accepted, "path": []}) + "\n")
    table = seg.main(["--model", str(tiny_dirs["qwen3"]), "--rows", str(rows), "--anchors", str(anchors), "--min-share", "0",
                      "--json", str(tmp_path / "t.json")])
    got = {r["kind"]: r for r in table}
    assert {r["set"] for r in table} == {"code"} and sum(r["anchors"] for r in table) == len(offsets)
    assert got["code:python"]["mean_accept"] == 4.0 and got["prose"]["mean_accept"] == 1.0
    assert got["code:python"]["anchors"] == sum(k == "code:python" for k in kinds[1:])
    assert sum(r["path_rounds"] for r in table) < len(offsets)  # rounds skip the anchors a long accept crosses
    assert json.loads((tmp_path / "t.json").read_text())["table"] == table
    folded = seg.main(["--model", str(tiny_dirs["qwen3"]), "--rows", str(rows), "--anchors", str(anchors), "--min-share", "0.99"])
    assert [r["kind"] for r in folded] == ["other"]
    lost = tmp_path / "lost.jsonl.gz"
    with gzip.open(lost, "wt") as f:
        f.write(json.dumps({"ids": prompt, "prompt_len": 1, "set": "held30_code", "prompt_id": "q2"}) + "\n")
    with pytest.raises(SystemExit, match="does not hold"):
        seg.main(["--model", str(tiny_dirs["qwen3"]), "--rows", str(lost), "--anchors", str(anchors)])
