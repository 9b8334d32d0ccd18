"""DuckDB storage: open (with migration), insert, query. See store.py."""

from .store import DatabaseBusy, open_db

__all__ = ["DatabaseBusy", "open_db"]
