"""Pipeline stages: Ray Data (``BatchGenOperator``) and Hugging Face datasets (``BatchGenMap``)."""

from batchgen_data.operators.datasets_map import BatchGenMap
from batchgen_data.operators.ray_operator import BatchGenOperator
from batchgen_data.operators.rows import OUTPUT_COLUMNS, StageConfig

__all__ = ["OUTPUT_COLUMNS", "BatchGenMap", "BatchGenOperator", "StageConfig"]
