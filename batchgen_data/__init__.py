"""batchgen-data: batch inference for Mixture-of-Experts LLMs as a data-pipeline stage."""

from batchgen_data.config import EngineConfig
from batchgen_data.engine import Engine, EngineStats
from batchgen_data.errors import BatchGenError, CheckpointError, ConfigError, RequestError
from batchgen_data.outputs import GenerationOutput
from batchgen_data.sampling_params import SamplingParams

__all__ = [
    "BatchGenError",
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
