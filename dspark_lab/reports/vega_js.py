"""The vega + vega-lite + vega-embed JavaScript that makes a report work offline.

vl-convert-python ships the libraries and bundles them on request, which takes seconds (it
runs a JavaScript bundler), so the bundle is kept: in memory for this process, and on disk
under the dspark-lab cache, keyed by the vl-convert and vega-lite versions that made it.
"""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path


def _cache_file(vl_version: str | None) -> Path:
    import vl_convert as vlc

    env = os.environ.get("DSPARK_LAB_CACHE")  # the same root as the model cache (engine/pypi_models.py)
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "dspark-lab"
    return root / "vega" / f"bundle-vlconvert{vlc.__version__}-vl{vl_version or 'default'}.js"


@functools.cache
def javascript_bundle(vl_version: str | None = None) -> str:
    """The bundle as one script's text (it defines window.vegaEmbed)."""
    import vl_convert as vlc

    path = _cache_file(vl_version)
    try:
        text = path.read_text(encoding="utf-8")
        if "window.vegaEmbed=" in text[-4000:]:  # the bundle's last statements define it
            return text
    except OSError:
        pass
    text = vlc.javascript_bundle(vl_version=vl_version)
    try:  # written whole or not at all: a half-written bundle would break every later report
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=path.parent, delete=False, suffix=".tmp") as f:
            f.write(text)
        os.replace(f.name, path)
    except OSError:
        pass  # an unwritable cache only costs time
    return text
