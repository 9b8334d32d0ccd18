"""The scripts under benchmarks/ (and setup.py) loaded as modules, for the tests of their functions:
they are run as files, not installed, so they cannot be imported by name."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


def load_script(name: str, path: Path | None = None) -> ModuleType:
    """benchmarks/NAME.py (or the file at `path`) as a fresh module named NAME."""
    spec = importlib.util.spec_from_file_location(name, path or BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
