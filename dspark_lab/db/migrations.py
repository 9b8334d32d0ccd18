"""Schema migrations: MIGRATIONS[v](engine) takes a database from version v to v + 1.

Version 1 is the first schema; later versions add their step here."""

from sqlalchemy import Engine, text


def _v1_to_v2(engine: Engine) -> None:
    """Trials learn whether a mismatch sits on a numerical tie (mismatch_gap, mismatch_tie).
    Trials stored before stay NULL there: unknown, never guessed."""
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE trials ADD COLUMN mismatch_gap DOUBLE"))
        conn.execute(text("ALTER TABLE trials ADD COLUMN mismatch_tie BOOLEAN"))


def _v2_to_v3(engine: Engine) -> None:
    """Trials learn which version of the drafter's weights ran (drafter_digest). Trials stored
    before stay NULL: unknown."""
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE trials ADD COLUMN drafter_digest VARCHAR"))


def _v3_to_v4(engine: Engine) -> None:
    """Trials learn their prompt's own digest (prompt_digest), so one prompt run from sets of
    different --prompt-limit counts once. Trials stored before stay NULL here: the db layer cannot
    rebuild a prompt set; lab/prompt_identity.backfill_prompt_digests fills those it can."""
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE trials ADD COLUMN prompt_digest VARCHAR"))


MIGRATIONS: dict = {1: _v1_to_v2, 2: _v2_to_v3, 3: _v3_to_v4}
