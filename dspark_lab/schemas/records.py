"""Database tables. Floats are DOUBLE (SQLAlchemy's Float would be a 32-bit FLOAT in DuckDB);
structured fields (device stamps, curves, options) are JSON text, parsed by the code that
owns them, so the tables stay portable across DuckDB versions."""

from __future__ import annotations

from datetime import datetime, timezone

from sqlmodel import Field, SQLModel

# Bump when a table changes; dspark_lab/db/migrations.py says how to get from each version to the next.
SCHEMA_VERSION = 1


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class SchemaInfo(SQLModel, table=True):
    __tablename__ = "schema_info"
    version: int = Field(primary_key=True, sa_column_kwargs={"autoincrement": False})
    written_by: str  # dspark-lab version that created or last migrated the file


class CalibrationRecord(SQLModel, table=True):
    """Cost curves of one pair on one machine, reusable while the key matches."""

    __tablename__ = "calibration"
    id: str = Field(primary_key=True)
    key: str  # hash of everything that changes cost: device, model, drafter, mode, bits, options, versions
    device_key: str
    machine: str
    device_stamp: str  # JSON
    model_id: str
    drafter_id: str | None = None
    mode: str
    target_bits: int | None = None
    drafter_bits: int | None = None
    options: str  # JSON: engine options that change cost
    curves: str  # JSON: CostCurves.to_dict()
    created_at: datetime = Field(default_factory=utcnow)
