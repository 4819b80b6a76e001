"""Where the project keeps files it generates (the demo checkpoint, GEMM plans, step models), and
how it writes them."""

from __future__ import annotations

import os
import time
from pathlib import Path


def cache_dir() -> Path:
    """``$BATCHGEN_DATA_CACHE``, else ``$XDG_CACHE_HOME/batchgen-data``, else ``~/.cache/batchgen-data``."""
    if os.environ.get("BATCHGEN_DATA_CACHE"):
        return Path(os.environ["BATCHGEN_DATA_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "batchgen-data"


def write_cache_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` (its folder made) through a temporary file of this call's own, then
    an atomic rename: processes writing the same entry at once never leave a torn file. Raises
    ``OSError``; a cache entry that cannot be written is the caller's warning, not an error."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.{time.time_ns()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
