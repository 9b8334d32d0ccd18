"""Whole conversations as distillation data: text the target reads instead of writes.

Generating a head's data costs the target a decode step per token; reading a conversation costs
one forward pass for all of its tokens, so a corpus gives many times more training positions per
second of the machine. The head still learns the target's own behaviour: with
`--labels target` (distill's default) every position's label is the target's greedy prediction
from that same forward, not the corpus's next token. For the first draft slot that label is
exactly the token greedy decoding would emit there.

    sharegpt:PATH   ShareGPT JSON ([{"id", "conversations": [{"from", "value"}, ...]}, ...]);
                    a truncated file ends the corpus cleanly
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


def _ids(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "input_ids") else ids)


def corpus_rows(tokenizer, spec: str, budget: int, max_len: int, seen: set) -> Iterator[dict]:
    """Training rows (the layout of distill's data.jsonl) from a corpus, until `budget` tokens
    after the first user turn. Each row is the conversation's first `max_len` tokens through the
    chat template; its prompt_len ends at the first answer, where drafting starts."""
    kind, _, path = spec.partition(":")
    if kind != "sharegpt" or not path:
        raise InputError(f"--corpus {spec!r}: expected sharegpt:PATH (a ShareGPT JSON file).")
    p = Path(path).expanduser()
    if not p.is_file():
        raise InputError(f"--corpus: {str(p)!r} does not exist; pass the path of a ShareGPT JSON file.")
    if getattr(tokenizer, "chat_template", None) is None:
        raise InputError("--corpus needs a chat model: this tokenizer has no chat template to render conversations with.")
    made = 0
    for cid, messages in sharegpt_conversations(p):
        if made >= budget:
            return
        key = ("corpus:sharegpt", cid)
        if not cid or key in seen:
            continue
        prompt_len = len(_ids(tokenizer, messages[:1], True))
        ids = _ids(tokenizer, messages, False)[:max_len]
        if len(ids) - prompt_len < 16:  # too little answer inside the window to learn from
            continue
        seen.add(key)
        made += len(ids) - prompt_len
        yield {"ids": ids, "prompt_len": prompt_len, "set": "corpus:sharegpt", "set_version": p.name, "prompt_id": cid,
               "generation": "corpus", "max_new_tokens": 0}
