"""benchmarks/sharegpt_requests.py: ShareGPT opening turns as chat requests, only a conversation's
first part, within the length bounds, each text once, none a given file already holds, shuffled by
seed, and loadable as a prompt set; with --follow-ups, the later user turns with the talk before
them, as chat messages."""

import gzip
import json

import pytest

from dspark_lab.lab.prompts import load_prompt_set

from scripts import load_script


def _conversation(cid, opening, answer="Sure."):
    return {"id": cid, "conversations": [{"from": "human", "value": opening}, {"from": "gpt", "value": answer}]}


def test_opening_turns_are_filtered_deduplicated_and_shuffled(tmp_path):
    sg = tmp_path / "sg.json"
    sg.write_text(json.dumps([
        _conversation("a_0", "How do I sort a list in Python?"),
        _conversation("a_1", "And in reverse order, please?"),  # a later part: the middle of a talk
        _conversation("b", "Plan a three-day trip to Lisbon."),  # never split: its own first part
        _conversation("c_0", "x" * 300),  # past --max-chars
        _conversation("d_0", "  How do I sort a   list in Python?\n"),  # a: repeated, whitespace aside
        _conversation("e_0", "Explain recursion to a child."),  # in the skip file by text
        _conversation("f_0", "Write a haiku about rain."),  # in the skip file by id
        _conversation("g_0", "hi"),  # under --min-chars
        {"id": "h_0", "conversations": [{"from": "gpt", "value": "I speak first"}]},  # not a user's opening
    ] + [_conversation(f"n{i}_0", f"Question number {i} about databases?") for i in range(6)]))
    skip = tmp_path / "old.jsonl.gz"
    skip.write_bytes(gzip.compress((json.dumps({"id": "zzz_0", "domain": "chat", "text": "Explain recursion to a child."}) + "\n"
                                    + json.dumps({"id": "f_0", "domain": "chat", "text": "something else"}) + "\n").encode()))
    script = load_script("sharegpt_requests")
    kept = script.opening_turns(sg, min_chars=10, max_chars=200, skip=[json.loads(line) for line in gzip.open(skip, "rt")])
    assert [r["id"] for r in kept] == ["a_0", "b"] + [f"n{i}_0" for i in range(6)]
    assert kept[0] == {"id": "a_0", "domain": "chat", "text": "How do I sort a list in Python?"}

    out = tmp_path / "new.jsonl.gz"
    script.main([str(sg), "--count", "5", "--out", str(out), "--skip", str(skip), "--max-chars", "200", "--seed", "3"])
    first = [json.loads(line) for line in gzip.open(out, "rt")]
    assert len(first) == 5 and {r["id"] for r in first} <= {r["id"] for r in kept}
    assert [r["id"] for r in first] != [r["id"] for r in kept][:5]  # shuffled, not file order
    again = tmp_path / "again.jsonl.gz"
    script.main([str(sg), "--count", "5", "--out", str(again), "--skip", str(skip), "--max-chars", "200", "--seed", "3"])
    assert [json.loads(line) for line in gzip.open(again, "rt")] == first  # the seed decides
    pset = load_prompt_set(str(out))
    assert len(pset.prompts) == 5 and {p.domain for p in pset.prompts} == {"chat"}


def test_asking_for_more_than_there_is_writes_what_there_is(tmp_path, capsys):
    sg = tmp_path / "sg.json"
    sg.write_text(json.dumps([_conversation("a_0", "How do I sort a list in Python?")]))
    out = tmp_path / "out.jsonl"
    load_script("sharegpt_requests").main([str(sg), "--count", "10", "--out", str(out)])
    assert "only 1 usable opening turns (asked for 10)" in capsys.readouterr().out
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["a_0"]


def test_a_missing_file_or_a_count_under_one_is_refused_by_name(tmp_path):
    script = load_script("sharegpt_requests")
    out = tmp_path / "out.jsonl"
    with pytest.raises(SystemExit, match="nope.json: no such file .*ShareGPT JSON"):
        script.main([str(tmp_path / "nope.json"), "--count", "5", "--out", str(out)])
    sg = tmp_path / "sg.json"
    sg.write_text(json.dumps([_conversation("a_0", "How do I sort a list in Python?")]))
    with pytest.raises(SystemExit, match="--count must be at least 1, got 0"):
        script.main([str(sg), "--count", "0", "--out", str(out)])
    assert not out.exists()


def _talk(cid, *turns):
    roles = ("human", "gpt")
    return {"id": cid, "conversations": [{"from": roles[i % 2], "value": t} for i, t in enumerate(turns)]}


def test_follow_ups_are_later_turns_with_the_talk_before_them(tmp_path):
    sg = tmp_path / "sg.json"
    sg.write_text(json.dumps([
        _talk("a_0", "Write a python function to reverse a list.", "def rev(x): return x[::-1]",
              "Now make it work on tuples too.", "def rev(x): return type(x)(reversed(x))",
              "ok", "Glad to help.",  # under --min-chars
              "And add type hints to it, please.", "Done."),
        _talk("b_1", "Opening of a later part", "Answer.", "A later part's follow-up turn."),  # not a first part
        _talk("c_0", "Plan a trip.", "x" * 300, "Make the plan shorter please."),  # the talk before it is too long
        _talk("d_0", "Write a python function to reverse a list.", "def rev(x): return x[::-1]",
              "Now make it work on tuples too."),  # the same talk as a_0's first follow-up: kept once
        _talk("e_0", "Only an opening here.", "And its answer."),
        _talk("f_0", "Tell me a joke.", "Why did the chicken...", "Tell me another one now."),  # in the skip file by id
    ]))
    script = load_script("sharegpt_requests")
    kept = script.follow_up_turns(sg, min_chars=10, max_chars=200, max_context_chars=200, skip=[{"id": "sg_follow/f_0/turn1"}])
    assert [r["id"] for r in kept] == ["a_0/turn1", "a_0/turn3"]
    assert kept[0] == {"id": "a_0/turn1", "domain": "chat", "messages": [
        {"role": "user", "content": "Write a python function to reverse a list."},
        {"role": "assistant", "content": "def rev(x): return x[::-1]"},
        {"role": "user", "content": "Now make it work on tuples too."}]}
    assert [m["role"] for m in kept[1]["messages"]] == ["user", "assistant"] * 3 + ["user"]
    assert script.follow_up_turns(sg, min_chars=10, max_chars=200, max_context_chars=200, skip=[],
                                  skip_conversations={"a_0", "d_0"}) == [{"id": "f_0/turn1", "domain": "chat", "messages": [
        {"role": "user", "content": "Tell me a joke."}, {"role": "assistant", "content": "Why did the chicken..."},
        {"role": "user", "content": "Tell me another one now."}]}]
    assert [script.conversation_of(i) for i in ("a_0", "sg_chat29/a_0", "sg_follow/a_0/turn3")] == ["a_0"] * 3
    assert kept[1]["messages"][-1]["content"] == "And add type hints to it, please."

    out = tmp_path / "follow.jsonl.gz"
    held = tmp_path / "held.jsonl.gz"
    held.write_bytes(gzip.compress((json.dumps({"id": "sg_chat29/f_0", "domain": "chat", "text": "Tell me a joke."}) + "\n").encode()))
    script.main([str(sg), "--count", "5", "--out", str(out), "--follow-ups", "--max-chars", "200", "--max-context-chars", "200"])
    pset = load_prompt_set(str(out))
    assert sorted(p.id for p in pset.prompts) == ["a_0/turn1", "a_0/turn3", "f_0/turn1"]
    script.main([str(sg), "--count", "5", "--out", str(out), "--follow-ups", "--max-chars", "200", "--max-context-chars", "200",
                 "--skip-conversations", str(held)])
    assert sorted(p.id for p in load_prompt_set(str(out)).prompts) == ["a_0/turn1", "a_0/turn3"]  # f_0's talk is held out
    assert all(p.messages[-1]["role"] == "user" and p.text is None for p in pset.prompts)


def test_follow_up_options_without_follow_ups_are_refused(tmp_path):
    sg = tmp_path / "sg.json"
    sg.write_text(json.dumps([_conversation("a_0", "How do I sort a list in Python?")]))
    out = tmp_path / "out.jsonl"
    for extra in (["--skip-conversations", str(tmp_path / "held.jsonl")], ["--max-context-chars", "100"]):
        with pytest.raises(SystemExit, match="choose follow-up turns: add --follow-ups"):
            load_script("sharegpt_requests").main([str(sg), "--count", "1", "--out", str(out)] + extra)
    for bad in ("0", "-5"):
        with pytest.raises(SystemExit, match="--max-context-chars must be at least 1"):
            load_script("sharegpt_requests").main([str(sg), "--count", "1", "--out", str(out), "--follow-ups", "--max-context-chars", bad])
    assert not out.exists()
