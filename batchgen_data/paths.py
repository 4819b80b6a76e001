"""Where the project keeps files it generates (the demo checkpoint, GEMM plans)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$BATCHGEN_DATA_CACHE``, else ``$XDG_CACHE_HOME/batchgen-data``, else ``~/.cache/batchgen-data``."""
    if os.environ.get("BATCHGEN_DATA_CACHE"):
        return Path(os.environ["BATCHGEN_DATA_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "batchgen-data"
