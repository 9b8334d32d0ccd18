"""Reports of a results database: the HTML report with its PNG charts (report.py, charts.py)
and the registry of measured pairs (registry.py).

Names are imported on first use: `registry show` should not pay for altair and vl-convert.
"""

_EXPORTS = {
    "build_report": "report",
    "build_registry": "registry",
    "load_registry": "registry",
    "write_registry": "registry",
    "registry_table": "registry",
    "registry_markdown": "registry",
    "MIN_TRIALS": "registry",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
