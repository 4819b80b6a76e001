"""batchgen-data: batch inference for Mixture-of-Experts LLMs as a data-pipeline stage."""

from batchgen_data.config import EngineConfig
from batchgen_data.engine import Engine, EngineStats
from batchgen_data.errors import BatchGenError, CheckpointError, ConfigError, RequestError
from batchgen_data.outputs import GenerationOutput
from batchgen_data.sampling_params import SamplingParams

__all__ = [
    "BatchGenError",
    "BatchGenMap",
    "BatchGenOperator",
    "CheckpointError",
    "ConfigError",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "GenerationOutput",
    "RequestError",
    "SamplingParams",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The pipeline stages import pyarrow; load them only when asked for.
    if name in ("BatchGenOperator", "BatchGenMap"):
        from batchgen_data import operators

        return getattr(operators, name)
    raise AttributeError(f"module 'batchgen_data' has no attribute {name!r}")
