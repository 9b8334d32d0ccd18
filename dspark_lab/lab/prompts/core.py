"""Prompt and PromptSet, and the validating reader for prompt JSONL files.

One JSON object per line:

    {"id": "code-001", "domain": "code", "messages": [{"role": "user", "content": "..."}]}
    {"id": "math-001", "domain": "math", "text": "...", "reference": "42"}

`id` (unique string), `domain` (a string: code, math, chat, copy or your own label), exactly one
of `messages` (a chat list of {role, content}) or `text`, and an optional `reference` answer.
Unknown fields are refused rather than ignored, so a misspelt `refrence` is not silently lost.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from ...errors import InputError

DOMAINS = ("code", "math", "chat", "copy")
FIELDS = ("id", "domain", "messages", "text", "reference")


@dataclass(frozen=True)
class Prompt:
    id: str
    domain: str
    messages: list[dict] | None = None
    text: str | None = None
    reference: str | None = None

    def as_input(self) -> list[dict] | str:
        """What generation takes: the chat messages, or the plain text."""
        return self.messages if self.messages is not None else self.text

    @property
    def digest(self) -> str:
        """This prompt's own identity across runs: the version a set holding only this prompt
        would have. A set's version changes with which prompts a limit keeps; this does not, so
        runs that kept different numbers of a set's prompts still agree on each prompt."""
        return content_version([self])

    def to_dict(self) -> dict:
        """The record as it is written in a prompt file (absent fields left out)."""
        d: dict = {"id": self.id, "domain": self.domain}
        if self.messages is not None:
            d["messages"] = self.messages
        else:
            d["text"] = self.text
        if self.reference is not None:
            d["reference"] = self.reference
        return d


@dataclass(frozen=True)
class PromptSet:
    name: str
    version: str  # first 12 hex chars of sha256 over the canonical content of `prompts`
    prompts: list[Prompt]
    source: str = ""  # where it came from: "built-in", a path, "humaneval:<path>", ...
    notes: tuple[str, ...] = field(default=())  # e.g. that a file was truncated

    def __len__(self) -> int:
        return len(self.prompts)

    def __iter__(self):
        return iter(self.prompts)


def content_version(prompts: list[Prompt]) -> str:
    """Hash of the prompts themselves, not of the file's bytes: reformatting a file or reordering
    keys keeps the version, changing any prompt (or which prompts a limit keeps) changes it."""
    lines = (json.dumps(p.to_dict(), sort_keys=True, ensure_ascii=False, separators=(",", ":")) for p in prompts)
    # Prompt.digest is this over one prompt, so a set's version and a prompt's digest are one rule.
    return hashlib.sha256("\n".join(lines).encode("utf-8")).hexdigest()[:12]


def make_set(name: str, prompts: list[Prompt], *, source: str, limit: int | None = None, notes=()) -> PromptSet:
    if limit is not None:
        prompts = prompts[:limit]
    return PromptSet(name=name, version=content_version(prompts), prompts=prompts, source=source, notes=tuple(notes))


def check_limit(limit) -> None:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise InputError(f"limit must be a positive integer or None, got {limit!r}.")


def _type_name(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number" if isinstance(value, (int, float)) else type(value).__name__
    )


def parse_record(obj, where: str) -> Prompt:
    """One prompt from a decoded JSON line; `where` ("file.jsonl line 7") starts every error."""
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object with 'id', 'domain' and 'messages' or 'text', got {_type_name(obj)}.")
    unknown = [k for k in obj if k not in FIELDS]
    if unknown:
        raise InputError(f"{where}: field {unknown[0]!r} is not known; the fields are {', '.join(FIELDS)}.")
    for name in ("id", "domain"):
        if name not in obj:
            hint = " (a unique string, e.g. \"code-001\")" if name == "id" else f" (one of {', '.join(DOMAINS)} or your own label)"
            raise InputError(f"{where}: field {name!r} is missing; give it{hint}.")
        if not isinstance(obj[name], str) or not obj[name].strip():
            raise InputError(f"{where}: field {name!r} must be a non-empty string, got {obj[name]!r}.")
    has_messages, has_text = "messages" in obj, "text" in obj
    if has_messages == has_text:
        what = "both" if has_messages else "neither"
        raise InputError(f"{where}: give exactly one of field 'messages' (a chat list) or field 'text', not {what}.")
    messages = text = None
    if has_text:
        text = obj["text"]
        if not isinstance(text, str):
            raise InputError(f"{where}: field 'text' must be a string, got {_type_name(text)}.")
        if not text.strip():
            raise InputError(f"{where}: field 'text' is empty; give the prompt text.")
    else:
        messages = _check_messages(obj["messages"], where)
    reference = obj.get("reference")
    if reference is not None and not isinstance(reference, str):
        raise InputError(f"{where}: field 'reference' must be a string, got {_type_name(reference)}.")
    return Prompt(id=obj["id"], domain=obj["domain"], messages=messages, text=text, reference=reference)


def _check_messages(messages, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        got = "an empty list" if messages == [] else _type_name(messages)
        raise InputError(f"{where}: field 'messages' must be a non-empty list of {{\"role\", \"content\"}} objects, got {got}.")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            got = f"keys {sorted(m)}" if isinstance(m, dict) else _type_name(m)
            raise InputError(f"{where}: field 'messages' item {i} must be an object with exactly 'role' and 'content', got {got}.")
        for key in ("role", "content"):
            if not isinstance(m[key], str):
                raise InputError(f"{where}: field 'messages' item {i}: {key!r} must be a string, got {_type_name(m[key])}.")
        if not m["role"].strip():
            raise InputError(f"{where}: field 'messages' item {i}: 'role' is empty; use system, user or assistant.")
    if not any(m["content"].strip() for m in messages):
        raise InputError(f"{where}: field 'messages' has no text: every 'content' is empty.")
    return [dict(m) for m in messages]


def parse_jsonl(text: str, label: str) -> list[Prompt]:
    """Every prompt in a JSONL document, validated; `label` names the file in errors."""
    prompts: list[Prompt] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{label} line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); each line must be one JSON object.") from None
        prompt = parse_record(obj, where)
        if prompt.id in seen:
            raise InputError(f"{where}: id {prompt.id!r} is already used on line {seen[prompt.id]}; ids must be unique.")
        seen[prompt.id] = lineno
        prompts.append(prompt)
    if not prompts:
        raise InputError(f"{label} has no prompts; write one JSON object per line.")
    return prompts
