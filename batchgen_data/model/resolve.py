"""Model-name resolution: ``"demo"`` or a local checkpoint folder, to a folder with config.json."""

from __future__ import annotations

import os
from pathlib import Path

from batchgen_data.errors import CheckpointError
from batchgen_data.model.demo import DEMO_MODEL, ensure_demo_checkpoint


def resolve_model(model: str | os.PathLike) -> Path:
    """Turn ``"demo"`` or a checkpoint folder into a folder holding ``config.json``."""
    if str(model) == DEMO_MODEL:
        return ensure_demo_checkpoint()
    folder = Path(model).expanduser()
    if not (folder / "config.json").is_file():
        raise CheckpointError(
            f"model {str(model)!r} is neither 'demo' nor a local checkpoint folder with config.json "
            "(weights cannot be downloaded here: point at a folder holding config.json, "
            "*.safetensors and tokenizer files)"
        )
    return folder
