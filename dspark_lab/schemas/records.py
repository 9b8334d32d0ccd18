"""Database tables. Floats are DOUBLE (SQLAlchemy's Float would be a 32-bit FLOAT in DuckDB);
structured fields (device stamps, curves, options) are JSON text, parsed by the code that
owns them, so the tables stay portable across DuckDB versions."""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import Double
from sqlmodel import Field, SQLModel

# Bump when a table changes; dspark_lab/db/migrations.py says how to get from each version to the next.
SCHEMA_VERSION = 4


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


class ProbeRecord(SQLModel, table=True):
    """A one-time probe's verdict for one model on one machine (e.g. lab/launch_probe.py),
    reusable while the key matches, as calibration is."""

    __tablename__ = "probes"
    id: str = Field(primary_key=True)
    key: str  # hash of the probe, device, model and options
    probe: str  # which probe: "launch_every"
    device_key: str
    machine: str
    device_stamp: str  # JSON
    model_id: str
    options: str  # JSON
    verdict: str  # JSON
    created_at: datetime = Field(default_factory=utcnow)


class Run(SQLModel, table=True):
    """One sweep (or benchmark) invocation: its grid, where it ran, and how it ended."""

    __tablename__ = "runs"
    id: str = Field(primary_key=True)
    started_at: datetime = Field(default_factory=utcnow)
    finished_at: datetime | None = None
    status: str = "running"  # running | finished | interrupted | failed
    source: str = "local"  # local | ingested:<file name>
    dspark_lab_version: str
    device_key: str
    machine: str
    device_stamp: str  # JSON
    config: str  # JSON: the grid and options as given


class Trial(SQLModel, table=True):
    """One generation of one prompt by one arm (baseline or a speculative mode at a cap).

    `arm_key` names everything but the repeat: a resumed sweep skips (arm_key, trial_index)
    pairs already stored. `lossless` compares the output ids with the baseline's for the same
    prompt and model (greedy); baseline trials have it None."""

    __tablename__ = "trials"
    id: str = Field(primary_key=True)
    run_id: str = Field(index=True)
    arm_key: str
    trial_index: int
    model_id: str
    drafter_id: str | None = None
    mode: str  # baseline | lookup | dspark | dspark-pipe | dflash | draft
    cap: str  # "0" for baseline, a number, or "auto"
    prompt_set: str
    prompt_set_version: str  # the whole set as run: a --prompt-limit changes it
    prompt_id: str
    # The prompt's own content (lab/prompts/core.Prompt.digest; schema version 4): the same prompt
    # run from sets limited to different lengths is one prompt, which the set version cannot say.
    # None for trials stored before version 4 whose set is not one the lab can rebuild (a
    # built-in set, lab/prompt_identity.py).
    prompt_digest: str | None = None
    domain: str
    max_new_tokens: int
    temperature: float = Field(default=0.0, sa_type=Double)
    output_hash: str  # sha256 of the output token ids
    output_ids: str  # JSON list of the output token ids (to locate a mismatch later)
    num_tokens: int
    prompt_tokens: int
    finish_reason: str
    num_rounds: int
    target_forwards: int
    accept_lengths: str  # JSON list, one per round
    draft_lengths: str  # JSON list, one per round
    per_position_acceptance: str  # JSON list d0..dk
    caps_chosen: str | None = None  # JSON list per round when cap == "auto"
    mean_accept_len: float = Field(sa_type=Double)
    prefill_seconds: float = Field(sa_type=Double)
    decode_seconds: float = Field(sa_type=Double)
    tokens_per_sec: float = Field(sa_type=Double)
    decode_tokens_per_sec: float = Field(sa_type=Double)
    lossless: bool | None = None
    mismatch_index: int | None = None  # first differing token when not lossless
    # At that token: the logit gap of the two competing tokens (a fresh prefill of the common
    # prefix, in the model's logit dtype) and whether it is a numerical tie that low-precision
    # kernels may break either way: within one rounding step of that dtype plus how far the
    # target's own forwards of other widths move the gap (lab/lossless.py; schema version 2).
    mismatch_gap: float | None = Field(default=None, sa_type=Double)
    mismatch_tie: bool | None = None
    # Which version of the drafter's weights ran (engine/loading.weights_digest; schema version 3):
    # a head continued and stored again at the same path is another head. None for arms without
    # a drafter, a drafter that is no local folder, and trials stored before version 3.
    drafter_digest: str | None = None
    created_at: datetime = Field(default_factory=utcnow)
