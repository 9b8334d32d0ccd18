"""benchmarks/borrow_prompts.py: other rounds' request files merged into one for a model to answer
itself: ids made unique by their file's name, requests this model already answered (its rows'
prompt tokens) dropped, the rest shuffled, and the result loadable as a prompt set."""

import gzip
import json

import pytest

from dspark_lab.engine.loading import load_tokenizer
from dspark_lab.engine.text import encode_prompt
from dspark_lab.lab.prompts import load_prompt_set

from scripts import load_script


def _request(i, domain="code"):
    return {"id": f"selfcode-{i:05d}", "domain": domain, "messages": [{"role": "user", "content": f"write function {i}"}]}


def _write(path, records):
    path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in records).encode()))


def test_requests_are_merged_with_unique_ids_less_those_the_model_answered(tiny_dirs, tmp_path):
    model = tiny_dirs["qwen3"]
    tok = load_tokenizer(model)
    # Two rounds both numbered their requests from 1; the second repeats round one's request 2.
    a, b = tmp_path / "self_instruct11_code.jsonl.gz", tmp_path / "self_instruct12_code.jsonl.gz"
    _write(a, [_request(i) for i in range(1, 6)])
    _write(b, [_request(i + 10) for i in range(1, 4)] + [{**_request(2), "id": "selfcode-00004"}])
    chat = tmp_path / "sg_chat16.jsonl.gz"  # plain-text prompts (ShareGPT first turns) too
    _write(chat, [{"id": "QWJh_0", "domain": "chat", "text": "summarize a book"}])
    answered_ids = encode_prompt(tok, _request(2)["messages"])
    rows = [
        # This model answered request 2 (under a set name neither file has): dropped from both files.
        {"ids": answered_ids + [5, 6], "prompt_len": len(answered_ids), "set": "self_code13", "prompt_id": "x", "model": model.name},
        # Another model answered request 3: it stays, this model has not answered it.
        {"ids": encode_prompt(tok, _request(3)["messages"]) + [7], "prompt_len": len(answered_ids), "set": "s",
         "prompt_id": "y", "model": "some-other-model"},
    ]
    answered = tmp_path / "rows.jsonl"
    answered.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "borrowed.jsonl.gz"
    borrow = load_script("borrow_prompts")
    borrow.main([str(a), str(b), str(chat), "--model", str(model), "--answered", str(answered), "--out", str(out), "--seed", "1"])

    merged = [json.loads(line) for line in gzip.open(out, "rt")]
    ids = [r["id"] for r in merged]
    expected = {f"self_instruct11_code/selfcode-{i:05d}" for i in (1, 3, 4, 5)} | \
               {f"self_instruct12_code/selfcode-{i:05d}" for i in (11, 12, 13)} | {"sg_chat16/QWJh_0"}
    assert sorted(ids) == sorted(expected) and len(ids) == len(set(ids))
    assert ids != sorted(ids)  # shuffled, not file after file
    by_id = {r["id"]: r for r in merged}
    assert by_id["self_instruct12_code/selfcode-00011"]["messages"] == _request(11)["messages"]  # fields kept
    assert by_id["sg_chat16/QWJh_0"] == {"id": "sg_chat16/QWJh_0", "domain": "chat", "text": "summarize a book"}
    # Same seed, same order: a session can rebuild the file it shipped.
    again = tmp_path / "again.jsonl.gz"
    borrow.main([str(a), str(b), str(chat), "--model", str(model), "--answered", str(answered), "--out", str(again), "--seed", "1"])
    assert [json.loads(line)["id"] for line in gzip.open(again, "rt")] == ids
    assert len(load_prompt_set(str(out)).prompts) == 8
    # --count: the first N of the same shuffled order
    first = tmp_path / "first.jsonl.gz"
    borrow.main([str(a), str(b), str(chat), "--model", str(model), "--answered", str(answered), "--out", str(first), "--seed", "1",
                 "--count", "3"])
    assert [json.loads(line)["id"] for line in gzip.open(first, "rt")] == ids[:3]
    # --rest: the others, so a held-out sample and the requests to train on split one file disjointly
    rest = tmp_path / "rest.jsonl.gz"
    borrow.main([str(a), str(b), str(chat), "--model", str(model), "--answered", str(answered), "--out", str(first), "--seed", "1",
                 "--count", "3", "--rest", str(rest)])
    assert [json.loads(line)["id"] for line in gzip.open(rest, "rt")] == ids[3:]
    with pytest.raises(SystemExit):
        borrow.main([str(a), "--model", str(model), "--out", str(first), "--rest", str(rest)])  # --rest without --count


def test_a_model_argument_that_is_not_a_model_folder_is_refused(tmp_path, capsys):
    borrow = load_script("borrow_prompts")
    f = tmp_path / "p.jsonl.gz"
    _write(f, [_request(1)])
    with pytest.raises(SystemExit) as e:  # a missing model folder is refused
        borrow.main([str(f), "--model", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o.jsonl.gz")])
    assert e.value.code == 2
    assert "not a model folder" in capsys.readouterr().err


def test_a_negative_count_is_refused(tmp_path, capsys):
    borrow = load_script("borrow_prompts")
    f = tmp_path / "p.jsonl.gz"
    _write(f, [_request(1)])
    with pytest.raises(SystemExit):
        borrow.main([str(f), "--model", str(tmp_path), "--out", str(tmp_path / "o.jsonl.gz"), "--count", "-1"])
    assert "--count must be >= 0" in capsys.readouterr().err


def test_asks_for_code_keeps_the_code_requests_or_the_others(tiny_dirs, tmp_path):
    """--asks-for code: a code set's requests and the chat requests about code; --asks-for other:
    the rest. The words count whole: "trust" is not Rust, "description" not a script."""
    sg = load_script("sharegpt_requests")
    for text in ("Write a simple exponential backoff in Typescript", "can you debug my code ?", "```\nx = 1\n```\nwhy?",
                 "make a golang cli that lists playbooks", "Full code of a C# .Net 7 program", "what does c++ templates do"):
        assert sg.asks_for_code(text), text
    for text in ("I trust you with the description of this film", "What is AI", "Write a tweet about feral pigs",
                 "a reaction to the classic novel"):
        assert not sg.asks_for_code(text), text

    model = tiny_dirs["qwen3"]
    code, chat = tmp_path / "self_code.jsonl.gz", tmp_path / "sg_chat.jsonl.gz"
    _write(code, [_request(1)])
    _write(chat, [{"id": "a_0", "domain": "chat", "text": "how do I read a CSV file in python?"},
                  {"id": "b_0", "domain": "chat", "text": "summarize a book"},
                  {"id": "c_0", "domain": "chat", "messages": [{"role": "user", "content": "fix this SQL query: SELECT 1"}]},
                  # a follow-up is about code when the talk it follows is, though its own words are not
                  {"id": "d_0/turn1", "domain": "chat", "messages": [
                      {"role": "user", "content": "write a python function that reverses a string"},
                      {"role": "assistant", "content": "def rev(s): return s[::-1]"},
                      {"role": "user", "content": "now make it faster please"}]},
                  {"id": "e_0/turn1", "domain": "chat", "messages": [
                      {"role": "user", "content": "plan a trip to Lisbon"}, {"role": "assistant", "content": "Day one: Alfama."},
                      {"role": "user", "content": "now make it shorter please"}]}])
    borrow = load_script("borrow_prompts")
    kept = {}
    for kind in ("code", "other"):
        out = tmp_path / f"{kind}.jsonl.gz"
        borrow.main([str(code), str(chat), "--model", str(model), "--out", str(out), "--asks-for", kind])
        kept[kind] = sorted(json.loads(line)["id"] for line in gzip.open(out, "rt"))
    assert kept == {"code": ["self_code/selfcode-00001", "sg_chat/a_0", "sg_chat/c_0", "sg_chat/d_0/turn1"],
                    "other": ["sg_chat/b_0", "sg_chat/e_0/turn1"]}


def test_drop_twins_leaves_near_copies_of_held_out_requests_out_of_the_rest(tmp_path, capsys):
    """--drop-twins: a request to train on whose words are that alike to a held-out one's is left
    out (ShareGPT repeats openings with small changes), the others stay in order."""
    borrow = load_script("borrow_prompts")
    held = [{"id": "a_0", "domain": "chat", "text": "Write a program to count the sum of first 100 numbers in python"}]
    rest = [{"id": "b_0", "domain": "chat", "text": "write a program to count the sum of first 100 number in phyton"},
            {"id": "c_0", "domain": "chat", "messages": [{"role": "user", "content": "summarize a book about rivers"}]},
            {"id": "d_0", "domain": "chat", "text": "Write a hello world program in Go"}]
    assert [r["id"] for r in borrow.drop_twins(rest, held, 0.5)] == ["c_0", "d_0"]
    assert [r["id"] for r in borrow.drop_twins(rest, held, 1.01)] == ["b_0", "c_0", "d_0"]  # nothing is that alike
    f = tmp_path / "p.jsonl.gz"
    _write(f, held)
    with pytest.raises(SystemExit):
        borrow.main([str(f), "--model", str(tmp_path), "--out", str(tmp_path / "o.jsonl.gz"), "--drop-twins", "0.5"])
    assert "--drop-twins leaves requests out of --rest" in capsys.readouterr().err
