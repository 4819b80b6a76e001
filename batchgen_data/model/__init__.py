"""The model layer: MoE transformer modules that run on flat token batches."""

from batchgen_data.model.config import ModelConfig
from batchgen_data.model.model import MoEModel

__all__ = ["ModelConfig", "MoEModel"]
