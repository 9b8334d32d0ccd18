"""Typed records the lab stores and exchanges: calibration curves, runs, trials, result JSON,
registry entries. SQLModel tables double as pydantic models for validation."""

from .records import SCHEMA_VERSION, CalibrationRecord, ProbeRecord, Run, SchemaInfo, Trial

__all__ = ["SCHEMA_VERSION", "CalibrationRecord", "ProbeRecord", "Run", "SchemaInfo", "Trial"]
