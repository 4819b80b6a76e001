"""Pipeline stages: Ray Data (``BatchGenOperator``) and Hugging Face datasets (``BatchGenMap``).

The stages load on first use, so the row bookkeeping (``rows.py``: the stage config and its
sampling defaults, which the CLI reads before parsing its flags) imports without torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

_EXPORTS = {
    "BatchGenMap": "batchgen_data.operators.datasets_map",
    "BatchGenOperator": "batchgen_data.operators.ray_operator",
    "OUTPUT_COLUMNS": "batchgen_data.operators.columns",
    "StageConfig": "batchgen_data.operators.rows",
}
__all__ = ["OUTPUT_COLUMNS", "BatchGenMap", "BatchGenOperator", "StageConfig"]

if TYPE_CHECKING:
    from batchgen_data.operators.datasets_map import BatchGenMap
    from batchgen_data.operators.ray_operator import BatchGenOperator
    from batchgen_data.operators.columns import OUTPUT_COLUMNS
    from batchgen_data.operators.rows import StageConfig


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    raise AttributeError(f"module 'batchgen_data.operators' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
