"""Open a results database (a DuckDB file) through SQLModel / duckdb-engine, creating or
migrating its tables, and refuse clearly when another process holds it.

DuckDB lets one process write a file at a time; a second sweep on the same file would fail
deep inside the driver. We turn that into DatabaseBusy, which says which file and what to do.
"""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy import Engine
from sqlmodel import Session, SQLModel, create_engine, select

from ..errors import DsparkError
from ..schemas.records import SCHEMA_VERSION, SchemaInfo


class DatabaseBusy(DsparkError):
    pass


def open_db(path: str | os.PathLike) -> Engine:
    """An engine on `path` (created if missing) whose tables are at SCHEMA_VERSION."""
    path = Path(path).expanduser()
    if path.exists() and path.is_dir():
        raise DsparkError(f"--db {str(path)!r} is a directory; pass a file path such as results.duckdb.")
    path.parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(f"duckdb:///{path}")
    try:
        with engine.connect():
            pass
    except Exception as e:  # the driver's lock and format errors come as several types
        msg = str(e)
        if "lock" in msg.lower():
            raise DatabaseBusy(
                f"database {str(path)!r} is in use by another dspark-lab process ({msg.splitlines()[0]}). "
                "Wait for it to finish, or pass another --db file."
            ) from None
        raise DsparkError(f"cannot open database {str(path)!r}: {msg.splitlines()[0]}. Is it a DuckDB file?") from None
    migrate(engine, path)
    return engine


def migrate(engine: Engine, path: Path) -> None:
    from .. import __version__

    SQLModel.metadata.create_all(engine, tables=[SchemaInfo.__table__])
    with Session(engine) as s:
        info = s.exec(select(SchemaInfo)).first()
        if info is None:
            SQLModel.metadata.create_all(engine)
            s.add(SchemaInfo(version=SCHEMA_VERSION, written_by=__version__))
            s.commit()
            return
        if info.version > SCHEMA_VERSION:
            raise DsparkError(
                f"database {str(path)!r} has schema version {info.version}, written by a newer dspark-lab ({info.written_by}); "
                f"this one reads up to {SCHEMA_VERSION}. Upgrade dspark-lab."
            )
        from .migrations import MIGRATIONS

        for version in range(info.version, SCHEMA_VERSION):
            MIGRATIONS[version](engine)
        if info.version < SCHEMA_VERSION:
            s.delete(info)
            s.add(SchemaInfo(version=SCHEMA_VERSION, written_by=__version__))
            s.commit()
        SQLModel.metadata.create_all(engine)  # tables added since need no migration step
