"""Verdicts of one-time probes (lab/launch_probe.py, lab/kernel_probe.py), stored like
calibration: one ProbeRecord per measurement, keyed by the probe, the device stamp, the model
and the options, the newest reused while the key matches."""

from __future__ import annotations

import hashlib
import json
import uuid

from sqlmodel import Session, select

from ..schemas.records import ProbeRecord
from .device import device_key, machine_class


def probe_key(probe: str, device: str, model_id: str, options: dict) -> str:
    blob = json.dumps([probe, device, model_id, options], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def stored_verdict(db, key: str) -> dict | None:
    """The newest stored verdict under `key`, decoded, or None (none stored, or damaged)."""
    with Session(db) as s:
        row = s.exec(select(ProbeRecord).where(ProbeRecord.key == key).order_by(ProbeRecord.created_at.desc())).first()
    if row is None:
        return None
    try:
        return json.loads(row.verdict)
    except ValueError:
        return None


def store_verdict(db, *, key: str, probe: str, stamp: dict, model_id: str, options: dict, verdict: dict) -> None:
    with Session(db) as s:
        s.add(ProbeRecord(id=uuid.uuid4().hex, key=key, probe=probe, device_key=device_key(stamp), machine=machine_class(stamp),
                          device_stamp=json.dumps(stamp, default=str), model_id=model_id, options=json.dumps(options),
                          verdict=json.dumps(verdict)))
        s.commit()
