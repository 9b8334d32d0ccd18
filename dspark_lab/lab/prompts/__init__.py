"""Prompt sets for the lab: four built-in sets, the user's own JSONL files, and public suites.

    load_prompt_set("code")                 # built-in: code, math, chat, copy
    load_prompt_set("my_prompts.jsonl")     # validated; errors name the file, line and field
    load_prompt_set("gsm8k:test.jsonl", limit=50)
    load_prompt_sets("code,math,chat,my.jsonl")

Every set carries a `version` (a hash of its prompts), so a result can say exactly which
prompts it measured. The built-in sets were written for this project; see core.py for the
file format.
"""

from __future__ import annotations

import gzip
from importlib import resources
from pathlib import Path

from ...errors import InputError
from .core import DOMAINS, Prompt, PromptSet, check_limit, content_version, make_set, parse_jsonl
from .public import load_gsm8k, load_humaneval, load_mtbench, load_sharegpt, open_text

BUILTIN_SETS = ("code", "math", "chat", "copy")
PUBLIC_SUITES = ("humaneval", "gsm8k", "sharegpt", "mtbench")

__all__ = [
    "BUILTIN_SETS", "DOMAINS", "PUBLIC_SUITES", "Prompt", "PromptSet", "content_version", "load_prompt_set",
    "load_prompt_sets",
]

_SPEC_HELP = (
    f"Use a built-in set ({', '.join(BUILTIN_SETS)}), a path to a .jsonl (or .jsonl.gz) file, or a public suite: "
    "humaneval[:PATH], gsm8k:PATH, sharegpt:PATH, mtbench:PATH."
)


def _read_text(path: Path, label: str) -> str:
    try:
        with open_text(path) as f:  # plain (a BOM from Windows editors tolerated) or gzip-compressed
            return f.read()
    except UnicodeDecodeError as e:
        raise InputError(f"{label} is not UTF-8 text (byte {e.start}); save it as UTF-8.") from None
    except (EOFError, gzip.BadGzipFile) as e:  # before OSError: BadGzipFile is one
        raise InputError(f"{label} is a damaged gzip file ({e}); compress it again or pass the plain .jsonl.") from None
    except OSError as e:
        raise InputError(f"{label} could not be read: {e.strerror or e}.") from None


def _load_builtin(name: str, limit: int | None) -> PromptSet:
    label = f"{name}.jsonl (built-in)"
    text = resources.files(__name__).joinpath(f"{name}.jsonl").read_text(encoding="utf-8")
    return make_set(name, parse_jsonl(text, label), source="built-in", limit=limit)


def _load_file(spec: str, limit: int | None) -> PromptSet:
    path = Path(spec).expanduser()
    if path.is_dir():
        raise InputError(f"prompt set {spec!r} is a directory; pass a .jsonl file.")
    if not path.is_file():
        if path.suffix in (".jsonl", ".gz") or "/" in spec or "\\" in spec:
            raise InputError(f"prompt file {spec!r} not found. {_SPEC_HELP}")
        raise InputError(f"unknown prompt set {spec!r}. {_SPEC_HELP}")
    text = _read_text(path, path.name)
    if not text.strip():
        raise InputError(f"{path.name} is empty; write one JSON object per line (id, domain, messages or text).")
    name = Path(path.name.removesuffix(".gz")).stem  # my.jsonl and my.jsonl.gz are both "my"
    return make_set(name, parse_jsonl(text, path.name), source=str(path), limit=limit)


def load_prompt_set(spec: str, limit: int | None = None) -> PromptSet:
    """One prompt set: a built-in name, a path to a JSONL file, or `suite:PATH` for a public suite.
    `limit` keeps the first N prompts (and the version says so: it hashes only those)."""
    check_limit(limit)
    if not isinstance(spec, str) or not spec.strip():
        raise InputError(f"the prompt set is empty. {_SPEC_HELP}")
    spec = spec.strip()
    if spec in BUILTIN_SETS:
        return _load_builtin(spec, limit)
    suite, sep, path = spec.partition(":")
    if suite in PUBLIC_SUITES and (sep or suite == "humaneval"):
        if suite == "humaneval":
            return load_humaneval(path or None, limit)
        return {"gsm8k": load_gsm8k, "sharegpt": load_sharegpt, "mtbench": load_mtbench}[suite](path, limit)
    if suite in PUBLIC_SUITES:
        raise InputError(f"{suite} needs a path: {suite}:PATH.")
    return _load_file(spec, limit)


def load_prompt_sets(specs: str | list[str], limit: int | None = None) -> list[PromptSet]:
    """Several sets from a list or a comma-separated string ("code,math,my.jsonl"). Set names
    must differ, since results are grouped by them."""
    if isinstance(specs, str):
        specs = specs.split(",")
    specs = [s.strip() for s in specs if isinstance(s, str) and s.strip()]
    if not specs:
        raise InputError(f"no prompt sets given. {_SPEC_HELP}")
    sets: list[PromptSet] = []
    for spec in specs:
        ps = load_prompt_set(spec, limit)
        clash = next((s for s in sets if s.name == ps.name), None)
        if clash is not None:
            raise InputError(
                f"two prompt sets are named {ps.name!r} ({clash.source} and {ps.source}); results are "
                "grouped by set name, so list each set once and rename a file that clashes with another set."
            )
        sets.append(ps)
    return sets
