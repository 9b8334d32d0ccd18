"""A trial's prompt by its own content (Trial.prompt_digest, lab/prompts/core.Prompt.digest),
filled in for trials stored without one wherever that can be done exactly.

Trials stored before schema 4, and result JSON written before it, name their prompt by set, set
version and id only. A set version hashes the set as run, so a set cut by --prompt-limit has a
version of its own. Where a trial's set version is a built-in set's at some limit, that version
fixes every prompt it kept, and the prompt's digest is known, not guessed. Trials of any other set
(a user's file, a public suite, or a built-in set since edited) keep NULL; db/queries then knows
their prompt by its set's version, as it did before digests.

This lives in lab/ because only the lab can rebuild its prompt sets; db/ stays unaware of them.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from sqlalchemy import Engine, select, update

from ..db import open_db
from ..schemas.records import Trial

# (set name, set version) -> {prompt id: digest} of the prompts that set version kept.
DigestsBySetVersion = dict[tuple[str, str], dict[str, str]]


@functools.cache
def builtin_set_digests() -> DigestsBySetVersion:
    """Every built-in set as any --prompt-limit could have cut it (its first n prompts, for each
    n, and the whole set), each version with the digests of the prompts it kept. The sets are
    loaded through load_prompt_set itself, so a limit is cut exactly as a sweep cuts it."""
    from .prompts import BUILTIN_SETS, load_prompt_set

    known: DigestsBySetVersion = {}
    for name in BUILTIN_SETS:
        whole = load_prompt_set(name)
        for limit in [*range(1, len(whole)), None]:
            kept = load_prompt_set(name, limit=limit)
            known[(kept.name, kept.version)] = {p.id: p.digest for p in kept.prompts}
    return known


def known_digest(prompt_set: str, prompt_set_version: str, prompt_id: str) -> str | None:
    """The digest of the prompt a trial names, where its set version is a built-in set's; else None."""
    return builtin_set_digests().get((prompt_set, prompt_set_version), {}).get(prompt_id)


def fill_prompt_digests(trials: Iterable[Trial]) -> int:
    """Give each trial without a digest the one its set version fixes (in memory, before the
    trials are stored); returns how many were filled."""
    filled = 0
    for t in trials:
        if t.prompt_digest is None:
            t.prompt_digest = known_digest(t.prompt_set, t.prompt_set_version, t.prompt_id)
            filled += t.prompt_digest is not None
    return filled


def backfill_prompt_digests(engine: Engine) -> int:
    """Fill prompt_digest for the database's trials stored without one whose prompt a built-in
    set version fixes; returns how many trials were filled. Safe to call on every open: trials
    already filled, and sets it does not know, are left as they are."""
    table = Trial.__table__
    missing = table.c.prompt_digest.is_(None)
    with engine.begin() as conn:
        prompts = conn.execute(select(table.c.prompt_set, table.c.prompt_set_version, table.c.prompt_id)
                               .where(missing).distinct()).all()
        filled = 0
        for prompt_set, version, prompt_id in prompts:
            digest = known_digest(prompt_set, version, prompt_id)
            if digest is None:
                continue
            same_prompt = (table.c.prompt_set == prompt_set) & (table.c.prompt_set_version == version) & (table.c.prompt_id == prompt_id)
            filled += conn.execute(update(table).where(missing & same_prompt).values(prompt_digest=digest)).rowcount
    return filled


def open_with_digests(path) -> Engine:
    """open_db, with the digests of trials stored before schema 4 filled in where a built-in set
    fixes them (backfill_prompt_digests): what a sweep, a report or a registry build reads then
    counts a prompt run at two --prompt-limit values once, as trials measured since do."""
    engine = open_db(path)
    try:
        backfill_prompt_digests(engine)
    except BaseException:
        engine.dispose()
        raise
    return engine
