"""lab/block_accept: the teacher-forced accept length of a DSpark head on the target's own greedy
text is what greedy speculative decoding accepts, round by round."""

import json

import mlx.core as mx
import pytest

from conftest import PROMPTS
from dspark_lab import greedy_generate, load_pair, speculative_generate
from dspark_lab.engine.text import encode_prompt
from dspark_lab.lab.block_accept import (accepted_at, decode_path, decode_rounds, mean_accept, on_path_anchors, path_mean_accept,
                                         row_accept, row_accepts)
from dspark_lab.lab.distill import DistillConfig, distill

CAP = 4


@pytest.fixture(scope="module")
def head(tiny_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("block-accept") / "head"
    distill(DistillConfig(model=str(tiny_dirs["qwen3"]), out=str(out), block=5, layers=1, markov_rank=32, tokens=300,
                          max_new_tokens=30, steps=30, anchors=8, eval_every=100, checkpoint_every=100, held_out=1, lr=3e-3,
                          warmup=3, prompts="code,math"), progress=False, say=lambda m: None)
    return out


@pytest.mark.parametrize("kind", ["distilled", "repeat"])
def test_each_rounds_accepted_drafts_are_the_teacher_forced_count_at_its_anchor(tiny_dirs, head, heads, kind):
    """Decode greedily with a head (float32 on the CPU: no ties), then at exactly the anchors the
    decode's rounds started from, count the teacher-forced accepts on the decoded text: the same
    number, round by round. Both heads have a Markov term (rank 32; the vocabulary); the one that
    favours repeating the last token gets partial accepts at every depth on this looping target."""
    target, tok, drafter, _ = load_pair(tiny_dirs["qwen3"], head if kind == "distilled" else heads[kind], drafter_bits=16,
                                        max_draft_tokens=CAP)
    compared, depths = 0, set()
    for p in PROMPTS[:6]:
        rounds, counted, row = decode_rounds(target, tok, drafter, p, CAP, 48)
        assert counted == rounds, p
        # the decoded text as a row: measured teacher-forced, its path is the decode's rounds
        assert row["ids"][: row["prompt_len"]] == encode_prompt(tok, p) and len(row["ids"]) == row["prompt_len"] + 48
        assert row_accept(target, drafter, row, CAP).path[: len(rounds)] == rounds, p
        compared += len(rounds)
        depths |= set(rounds)
    assert compared >= 30
    if kind == "repeat":
        assert {0, CAP} <= depths and depths & {1, 2, 3}  # none, all and some of a round's drafts accepted, each matched


def test_a_rows_answer_is_measured_at_every_anchor_on_the_targets_path(tiny_dirs, head, monkeypatch):
    target, tok, drafter, _ = load_pair(tiny_dirs["qwen3"], head, drafter_bits=16, max_draft_tokens=CAP)
    prompt = encode_prompt(tok, PROMPTS[0])
    answer = greedy_generate(target, tok, PROMPTS[0], max_new_tokens=40).token_ids
    row = {"ids": prompt + answer, "prompt_len": len(prompt), "set": "code", "prompt_id": "code-x"}
    r = row_accept(target, drafter, row, CAP)
    assert r.anchors == len(answer) - CAP + 1  # every answer position with CAP labels after it: all on the path
    assert r.through == sorted(r.through, reverse=True) and r.accepted == sum(r.through)
    assert 1 < r.mean_accept <= 1 + CAP and mean_accept([r, r]) == pytest.approx(r.mean_accept)
    # The decode's path along the row: the rounds speculative_generate runs on this prompt, round by
    # round, up to the last that drafts CAP tokens with CAP labels after it (the row's end).
    decoded = speculative_generate(target, tok, drafter, prompt, max_new_tokens=40, max_draft_tokens=CAP, lookup_drafts=False)
    assert decoded.token_ids == answer
    rounds = [a - 1 for a in decoded.accept_lengths]
    assert len(r.path) >= len(rounds) - CAP and r.path == rounds[: len(r.path)]
    assert r.path_mean_accept == pytest.approx(1 + sum(r.path) / len(r.path)) and path_mean_accept([r, r]) == pytest.approx(r.path_mean_accept)
    # Text the target did not write: anchors whose next tokens leave its path are skipped.
    bent = dict(row, ids=row["ids"][:-20] + [(t + 1) % target.vocab_size for t in row["ids"][-20:]])
    assert row_accept(target, drafter, bent, CAP).anchors < r.anchors
    # Several heads from one forward: each the same as measured alone.
    _, _, other, _ = load_pair(tiny_dirs["qwen3"], head, drafter_bits=4, max_draft_tokens=CAP)
    both = row_accepts(target, [drafter, other], row, CAP)
    assert both[0] == r and both[1] == row_accept(target, other, row, CAP)
    # A row measured in several passes of anchors (the head's fusion made once) gives the same.
    import dspark_lab.lab.block_accept as block_accept

    monkeypatch.setattr(block_accept, "ANCHORS_PER_PASS", 7)
    assert row_accepts(target, [drafter, other], row, CAP) == both


def test_the_decode_path_steps_by_each_rounds_commit_and_resumes_past_skipped_anchors():
    assert decode_path([5, 6, 7, 8, 9, 10, 11], [2, 0, 0, 1, 0, 0, 0]) == [2, 1, 0, 0]  # anchors 5, 8, 10, 11
    assert decode_path([5, 6, 7, 10, 11, 12], [1, 0, 0, 0, 3, 0]) == [1, 0, 0, 3]  # 5, 7, (8, 9 off the path) 10, 11
    assert decode_path([], []) == []


def test_on_path_anchors_skip_only_what_cannot_be_checked():
    ids = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    labels = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # the text is the greedy path
    assert on_path_anchors(ids, labels, 2, 3) == [2, 3, 4, 5, 6, 7]  # a + 2 <= 9
    off = labels[:5] + [0] + labels[6:]  # after position 5 the text leaves the path
    # anchor a needs ids[a+1..a+2] on the path, i.e. no off position in a..a+1
    assert on_path_anchors(ids, off, 2, 3) == [2, 3, 6, 7]


def test_a_causal_head_is_refused_by_name(tiny_dirs, head):
    target, _, drafter, _ = load_pair(tiny_dirs["qwen3"], head, drafter_bits=16)
    drafter.config.causal = True
    try:
        with pytest.raises(Exception, match="causal block"):
            accepted_at(target, drafter, [1, 2, 3, 4, 5, 6, 7, 8], [2], CAP)
    finally:
        drafter.config.causal = False


def test_the_benchmark_compares_heads_on_the_same_anchors(tiny_dirs, head, heads, tmp_path):
    """benchmarks/block_accept.py: each head's mean over every anchor of the rows, per set and per
    draft position, and the second head's paired difference from the first."""
    import gzip

    from scripts import load_script

    target, tok, drafter, _ = load_pair(tiny_dirs["qwen3"], head, drafter_bits=16)
    rows = []
    for i, p in enumerate(PROMPTS[:6]):
        prompt = encode_prompt(tok, p)
        rows.append({"ids": prompt + greedy_generate(target, tok, p, max_new_tokens=32).token_ids, "prompt_len": len(prompt),
                     "set": "code" if i % 2 else "chat", "prompt_id": f"p{i}"})
    data = tmp_path / "held.jsonl.gz"
    with gzip.open(data, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    mod = load_script("block_accept")
    out = mod.main(["--model", str(tiny_dirs["qwen3"]), "--head", str(heads["repeat"]), "--head", str(head), "--data", str(data),
                    "--cap", str(CAP), "--drafter-bits", "16", "--first", "12", "--json", str(tmp_path / "r.json"),
                    "--anchors-out", str(tmp_path / "anchors.jsonl.gz")])
    first, second = (out["heads"][str(h)] for h in (heads["repeat"], head))
    assert first["rows"] == 6 and first["anchors"] == second["anchors"] > 100
    assert set(first["by_set"]) == {"code", "chat"} and len(first["per_position"]) == CAP
    for s in (first, second):
        assert s["ci"][0] <= s["mean_accept"] <= s["ci"][1] and 1 <= s["mean_accept"] <= 1 + CAP
    d = out["differences"][str(head)]
    assert d["difference"] == pytest.approx(second["mean_accept"] - first["mean_accept"]) and d["ci"][0] <= d["difference"] <= d["ci"][1]
    assert json.loads((tmp_path / "r.json").read_text()) == json.loads(json.dumps(out))
    for s in (first, second):  # the decode's path along the rows: fewer rounds than anchors, a mean no higher
        assert s["path"]["rounds"] < s["anchors"] and 1 <= s["path"]["mean_accept"] <= s["mean_accept"] + 0.5
        assert s["path"]["ci"][0] <= s["path"]["mean_accept"] <= s["path"]["ci"][1] and set(s["path"]["by_set"]) == {"code", "chat"}
    # --anchors-out: each row's anchors per head, which give back its sums and path
    with gzip.open(tmp_path / "anchors.jsonl.gz", "rt") as f:
        dumped = [json.loads(line) for line in f]
    assert [(d["head"], d["prompt_id"]) for d in dumped] == [(str(h), r["prompt_id"]) for r in rows for h in (heads["repeat"], head)]
    for s in (first, second):
        mine = [d for d in dumped if d["head"] == str(heads["repeat"] if s is first else head)]
        assert [[d["prompt_id"], len(d["offsets"]), sum(d["accepted"])] for d in mine] == s["per_row"]
        assert all(d["offsets"][0] == 0 and d["path"][0] == d["accepted"][0] for d in mine)
    # --answer-tokens: each row's first 12 answer tokens only, so at most 12 - CAP + 1 anchors a row
    short = mod.main(["--model", str(tiny_dirs["qwen3"]), "--head", str(head), "--data", str(data), "--cap", str(CAP),
                      "--drafter-bits", "16", "--answer-tokens", "12"])["heads"][str(head)]
    assert 0 < max(r[1] for r in short["per_row"]) <= 12 - CAP + 1
    # --first 12: the same cut from the whole rows' forwards, equal to measuring the cut rows
    assert set(second["first"]) == {"12"}
    cut = second["first"]["12"]
    for key in ("mean_accept", "anchors", "per_position", "by_set", "path"):
        assert cut[key] == short[key], key
    assert cut["anchors"] < second["anchors"]
    for bad in (["--answer-tokens", "-1"], ["--cache-gb", "0"], ["--first", "0"]):  # refused by name, before any model loads
        with pytest.raises(SystemExit):
            mod.main(["--model", str(tiny_dirs["qwen3"]), "--head", str(head), "--data", str(data), *bad])
    # --compare: two runs' JSON, the last head of each, paired row by row without loading a model
    alone = tmp_path / "alone.json"
    # (target and head cast to float32, the target's layers dequantized: the tiny float32 pair measures the same)
    mod.main(["--model", str(tiny_dirs["qwen3"]), "--head", str(heads["repeat"]), "--data", str(data), "--cap", str(CAP),
              "--drafter-bits", "16", "--dtype", "float32", "--dequantize", "--json", str(alone)])
    assert json.loads(alone.read_text())["heads"][str(heads["repeat"])]["per_row"] == first["per_row"]
    again = mod.main(["--compare", str(alone), str(tmp_path / "r.json")])
    assert again["difference"] == pytest.approx(d["difference"]) and again["ci"] == pytest.approx(d["ci"])
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"heads": {"x": dict(first, per_row=first["per_row"][1:])}}))
    with pytest.raises(SystemExit, match="different rows or anchors"):
        mod.main(["--compare", str(alone), str(other)])
    with pytest.raises(SystemExit):
        mod.main(["--model", str(tiny_dirs["qwen3"]), "--head", str(head), "--data", str(tmp_path / "none.jsonl")])


def test_the_benchmark_checks_itself_against_decoding(tiny_dirs, heads, tmp_path, monkeypatch):
    """--against-decode: built-in prompts decoded with the head, each round's accepted drafts beside
    the teacher-forced count at its anchor (the tiny target's tokenizer reads any set's text)."""
    from scripts import load_script

    mod = load_script("block_accept")
    out = mod.main(["--model", str(tiny_dirs["qwen3"]), "--head", str(heads["repeat"]), "--drafter-bits", "16", "--cap", str(CAP),
                    "--against-decode", "code,chat", "--limit", "2", "--max-new-tokens", "40", "--json", str(tmp_path / "c.json"),
                    "--rows-out", str(tmp_path / "rows.jsonl.gz")])
    assert [c["prompt"] for c in out["checks"]] == ["code-001", "code-002", "chat-001", "chat-002"]
    import gzip

    with gzip.open(tmp_path / "rows.jsonl.gz", "rt") as f:  # --rows-out: the decoded answers, ready for --data
        rows = [json.loads(line) for line in f]
    assert [(r["set"], r["prompt_id"]) for r in rows] == [("code", "code-001"), ("code", "code-002"), ("chat", "chat-001"), ("chat", "chat-002")]
    measured = mod.main(["--model", str(tiny_dirs["qwen3"]), "--head", str(heads["repeat"]), "--drafter-bits", "16", "--cap", str(CAP),
                         "--data", str(tmp_path / "rows.jsonl.gz"), "--rows", "0"])["heads"][str(heads["repeat"])]
    assert measured["rows"] == 4 and measured["path"]["rounds"] >= sum(len(c["rounds"]) for c in out["checks"])
    assert all(c["equal"] and c["rounds"] for c in out["checks"])
    with pytest.raises(SystemExit):
        mod.main(["--model", str(tiny_dirs["qwen3"]), "--head", str(heads["repeat"])])  # neither --data nor --against-decode
