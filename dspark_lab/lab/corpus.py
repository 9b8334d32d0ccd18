"""Whole conversations as distillation data: text the target reads instead of writes.

Generating a head's data costs the target a decode step per token; reading a conversation costs
one forward pass for all of its tokens, so a corpus gives many times more training positions per
second of the machine. The head still learns the target's own behaviour: with
`--labels target` (distill's default) every position's label is the target's greedy prediction
from that same forward, not the corpus's next token. For the first draft slot that label is
exactly the token greedy decoding would emit there.

    sharegpt:PATH   ShareGPT JSON ([{"id", "conversations": [{"from", "value"}, ...]}, ...]);
                    a truncated file ends the corpus cleanly
    code:DIR        the Python source files under DIR (a Python installation's standard library
                    is one every machine has), each cut into parts at blank lines, each part the
                    answer to a request for that file's code. Chat corpora hold little code (the
                    Qwen coder's heads accepted far more on chat than on code prompts after
                    ShareGPT alone; for SmolLM2, 2.9 M tokens of these did not raise acceptance on
                    the built-in code set: docs/performance.md, sixth round).

Several corpora, comma-separated (`sharegpt:A.json,code:/usr/lib/python3.12`), each give
--corpus-tokens answer tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from ..errors import InputError
from .prompts.public import iter_json_array

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant"}


def sharegpt_conversations(path: Path) -> Iterator[tuple[str, list[dict]]]:
    """(id, chat messages) of each usable conversation: user first, then alternating turns,
    text only. A conversation is cut at its first turn that breaks that pattern."""
    for kind, item in iter_json_array(path, path.name):
        if kind == "truncated":
            return
        if not isinstance(item, dict) or not isinstance(item.get("conversations"), list):
            continue
        messages = []
        for turn in item["conversations"]:
            role = ROLES.get(turn.get("from")) if isinstance(turn, dict) else None
            text = turn.get("value") if role else None
            want = "user" if len(messages) % 2 == 0 else "assistant"
            if role != want or not isinstance(text, str) or not text.strip():
                break
            messages.append({"role": role, "content": text})
        if len(messages) >= 2:
            yield str(item.get("id", "")), messages


CODE_PART_CHARS = 3000  # a part of a source file: a training row's answer, well inside --max-len tokens


def code_conversations(root: Path) -> Iterator[tuple[str, list[dict]]]:
    """(id, chat messages) for each part of each Python file under root, in path order (so a
    budget takes the same parts every time). The id is the file's path under root and the part."""
    for path in sorted(root.rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # unreadable or not UTF-8: not code we can render
        rel = path.relative_to(root).as_posix()
        parts = _split_code(text)
        for i, part in enumerate(parts):
            ask = f"Write the Python code of `{rel}`" + (f", part {i + 1} of {len(parts)}." if len(parts) > 1 else ".")
            yield f"{rel}#{i}", [{"role": "user", "content": ask}, {"role": "assistant", "content": f"```python\n{part}```"}]


def _split_code(text: str) -> list[str]:
    """Cut source text into parts of about CODE_PART_CHARS at blank lines (a part ends where a
    definition usually does); a part with no blank line for longer is cut at a line end."""
    parts, cur = [], ""
    for line in text.splitlines(keepends=True):
        if len(cur) >= CODE_PART_CHARS and (not line.strip() or len(cur) >= 2 * CODE_PART_CHARS):
            parts.append(cur)
            cur = ""
        cur += line
    if cur.strip():
        parts.append(cur)
    return [p for p in parts if p.strip()]


CORPORA = {"sharegpt": (sharegpt_conversations, "a ShareGPT JSON file", Path.is_file),
           "code": (code_conversations, "a directory of Python source files", Path.is_dir)}


def corpus_specs(spec: str) -> list[tuple[str, Path]]:
    """--corpus parsed: (kind, path) per comma-separated corpus (read only where the data still
    needs its rows: corpus_rows checks that the path is there)."""
    out = []
    for one in (s.strip() for s in spec.split(",")):
        kind, _, path = one.partition(":")
        if kind not in CORPORA or not path:
            raise InputError(f"--corpus {one!r}: expected sharegpt:PATH (a ShareGPT JSON file) or code:DIR (Python sources), comma-separated.")
        out.append((kind, Path(path).expanduser()))
    return out


def _ids(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "input_ids") else ids)


def corpus_rows(tokenizer, kind: str, path: Path, budget: int, max_len: int, seen: set) -> Iterator[dict]:
    """Training rows (the layout of distill's data.jsonl) from one corpus (see corpus_specs),
    until `budget` tokens after the first user turn. Each row is the conversation's first
    `max_len` tokens through the chat template; its prompt_len ends at the first answer, where
    drafting starts."""
    _, what, exists = CORPORA[kind]
    if not exists(path):
        raise InputError(f"--corpus: {str(path)!r} is not {what}; pass the path of one.")
    if getattr(tokenizer, "chat_template", None) is None:
        raise InputError("--corpus needs a chat model: this tokenizer has no chat template to render conversations with.")
    made = 0
    for cid, messages in CORPORA[kind][0](path):
        if made >= budget:
            return
        key = (f"corpus:{kind}", cid)
        if not cid or key in seen:
            continue
        prompt_len = len(_ids(tokenizer, messages[:1], True))
        ids = _ids(tokenizer, messages, False)[:max_len]
        if len(ids) - prompt_len < 16:  # too little answer inside the window to learn from
            continue
        seen.add(key)
        made += len(ids) - prompt_len
        yield {"ids": ids, "prompt_len": prompt_len, "set": key[0], "set_version": path.name, "prompt_id": cid,
               "generation": "corpus", "max_new_tokens": 0}
