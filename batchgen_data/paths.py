"""Where the project keeps files it generates (the demo checkpoint), and model-name resolution."""

from __future__ import annotations

import os
from pathlib import Path

from batchgen_data.errors import CheckpointError

DEMO_MODEL = "demo"


def cache_dir() -> Path:
    """``$BATCHGEN_DATA_CACHE``, else ``$XDG_CACHE_HOME/batchgen-data``, else ``~/.cache/batchgen-data``."""
    if os.environ.get("BATCHGEN_DATA_CACHE"):
        return Path(os.environ["BATCHGEN_DATA_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "batchgen-data"


def resolve_model(model: str | os.PathLike) -> Path:
    """Turn ``"demo"`` or a checkpoint folder into a folder holding ``config.json``."""
    if str(model) == DEMO_MODEL:
        from batchgen_data.demo import ensure_demo_checkpoint

        return ensure_demo_checkpoint()
    folder = Path(model).expanduser()
    if not (folder / "config.json").is_file():
        raise CheckpointError(
            f"model {str(model)!r} is neither 'demo' nor a local checkpoint folder with config.json "
            "(weights cannot be downloaded here: point at a folder holding config.json, "
            "*.safetensors and tokenizer files)"
        )
    return folder
