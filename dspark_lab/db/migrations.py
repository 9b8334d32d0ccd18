"""Schema migrations: MIGRATIONS[v](engine) takes a database from version v to v + 1.

Version 1 is the first schema; later versions add their step here."""

MIGRATIONS: dict = {}
