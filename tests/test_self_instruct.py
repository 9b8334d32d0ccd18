"""benchmarks/self_instruct.py: requests the target writes itself, cleaned, distinct, reproducible,
never a built-in prompt, and loadable as a prompt file for distill."""

import gzip
import json

from dspark_lab import load_target
from dspark_lab.lab.prompts import load_prompt_set

from scripts import load_script

si = load_script("self_instruct")


def test_clean_keeps_only_the_request():
    assert si.clean('Sure! Here is a request:\n"Write a Go function that sums a slice."') == "Write a Go function that sums a slice."
    assert si.clean("Request: Fix this bug in my parser.") == "Fix this bug in my parser."
    assert si.clean("  In Rust, write a tokenizer for arithmetic.\nIt should skip spaces.  ") == \
        "In Rust, write a tokenizer for arithmetic.\nIt should skip spaces."


def test_math_topics_stay_away_from_the_evaluated_prompts_no_template_mirrors():
    # math-003 (a hexagon's angles), math-008 (a committee): the "math without a training twin"
    # figure, which a self-written request on their subject would inflate. Dice and probability
    # (math-007, mirrored by the coin-flip template) stay out as well: see MATH_TOPICS.
    subjects = ("angle", "polygon", "triangle", "hexagon", "dice", "probability", "committee", "arrangement", "counting",
                "combination", "permutation")
    assert not [t for t in si.MATH_TOPICS if any(s in t for s in subjects)]


def test_a_detailed_code_request_asks_for_several_requirements_and_more_than_the_code():
    import random

    brief, detailed = si.meta_prompt("code", random.Random(5)), si.meta_prompt("code", random.Random(5), "detailed")
    # the same topic, language and kind drawn first; the detailed one adds requirements and an extra
    assert brief.split("Topic: ")[1].split(" Be specific")[0] == detailed.split("Topic: ")[1].split(" Give it")[0]
    assert "two to four concrete requirements" in detailed and any(e in detailed for e in si.CODE_EXTRAS)
    assert "requirements" not in brief  # the brief wording is every earlier round's, unchanged
    assert si.meta_prompt("math", random.Random(5), "detailed") == si.meta_prompt("math", random.Random(5))


def test_requests_are_distinct_reproducible_and_load_as_prompts(tiny_dirs, tmp_path):
    target, tok = load_target(tiny_dirs["qwen3"])
    said = []
    rows = si.self_instruct(target, tok, "code", 12, seed=3, batch=8, max_tokens=40, keep_unfinished=True, say=said.append)
    again = si.self_instruct(target, tok, "code", 12, seed=3, batch=8, max_tokens=40, keep_unfinished=True, say=lambda m: None)
    assert rows and rows == again and said
    texts = [r["messages"][0]["content"] for r in rows]
    assert len(set(texts)) == len(texts) and all(30 <= len(t) <= 1500 for t in texts)
    assert len({r["id"] for r in rows}) == len(rows)
    # What is excluded never comes back (the CLI excludes the built-in set's texts this way).
    kept = si.self_instruct(target, tok, "code", 12, seed=3, batch=8, max_tokens=40, exclude=set(texts[:3]), keep_unfinished=True,
                          say=lambda m: None)
    assert not set(texts[:3]) & {r["messages"][0]["content"] for r in kept}
    out = tmp_path / "self_code.jsonl.gz"
    written = si.main(["--model", str(tiny_dirs["qwen3"]), "--kind", "math", "--n", "5", "--batch", "8", "--max-tokens", "40",
                       "--keep-unfinished", "--out", str(out)])
    lines = gzip.open(out, "rt").read().splitlines()
    assert [json.loads(line) for line in lines] == written
    ps = load_prompt_set(str(out))
    assert len(ps.prompts) == len(written) and {p.domain for p in ps.prompts} == {"math"}


def test_requests_cut_off_by_max_tokens_are_dropped(tiny_dirs, monkeypatch):
    """A request the target was still writing when max_tokens ran out is not kept."""
    import importlib
    from types import SimpleNamespace

    target, tok = load_target(tiny_dirs["qwen3"])
    texts = ["Write a Go function that parses a duration string and returns seconds.",
             "In Python, write a class for a bank account with deposit and withdraw methods, and"]

    def fake(model, tokenizer, prompts, max_tokens, **kw):
        assert kw["return_token_ids"]
        return SimpleNamespace(texts=texts * (len(prompts) // 2), token_ids=[[1] * 12, [1] * max_tokens] * (len(prompts) // 2))

    # The module, not mlx_lm's `generate` function of the same name.
    monkeypatch.setattr(importlib.import_module("mlx_lm.generate"), "batch_generate", fake)
    rows = si.self_instruct(target, tok, "code", 5, batch=4, max_tokens=40, say=lambda m: None)
    assert [r["messages"][0]["content"] for r in rows] == texts[:1]  # the finished one, once (then duplicates)


def test_detailed_requests_are_named_so_and_an_unknown_style_is_refused(tiny_dirs):
    import pytest

    target, tok = load_target(tiny_dirs["qwen3"])
    rows = si.self_instruct(target, tok, "code", 3, seed=1, batch=4, max_tokens=40, keep_unfinished=True, style="detailed",
                            say=lambda m: None)
    assert rows and all(r["id"].startswith("selfcode-detailed-") and r["domain"] == "code" for r in rows)
    with pytest.raises(SystemExit, match="--style must be one of brief, detailed"):
        si.self_instruct(target, tok, "code", 3, style="long", say=lambda m: None)


def test_dtype_writes_with_a_dequantized_copy_in_that_dtype(tiny_bf16_dir, tmp_path, monkeypatch, capsys):
    """--dtype float32 (a Linux CPU's fast dtype, with benchmarks/cpu_blas.sh) writes with a float32
    copy of a bfloat16 model; without it the model writes as loaded."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    seen = []

    def fake(target, tokenizer, kind, n, **kw):
        seen.append({p.dtype for _, p in tree_flatten(target.model.parameters())})
        return [{"id": "selfcode-00001", "domain": kind, "messages": [{"role": "user", "content": "Write a Go function that sums a slice."}]}]

    monkeypatch.setattr(si, "self_instruct", fake)
    args = ["--model", str(tiny_bf16_dir), "--kind", "code", "--n", "1", "--out", str(tmp_path / "r.jsonl.gz")]
    si.main(args + ["--dtype", "float32"])
    assert "a dequantized float32 copy" in capsys.readouterr().out
    si.main(args + ["--target-weights", "as-loaded"])
    assert seen == [{mx.float32}, {mx.bfloat16}]
