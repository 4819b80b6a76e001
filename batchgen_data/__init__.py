"""batchgen-data: batch inference for Mixture-of-Experts LLMs as a data-pipeline stage.

The public API is re-exported here and loaded on first use, so importing the package (or its
torch-free parts, such as the scheduler) stays cheap: the engine needs torch, the pipeline stages
pyarrow.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "BatchGenError": "batchgen_data.errors",
    "CheckpointError": "batchgen_data.errors",
    "ConfigError": "batchgen_data.errors",
    "EngineDeadError": "batchgen_data.errors",
    "RequestError": "batchgen_data.errors",
    "EngineConfig": "batchgen_data.config",
    "Engine": "batchgen_data.engine.engine",
    "EngineStats": "batchgen_data.engine.stats",
    "GenerationOutput": "batchgen_data.engine.outputs",
    "SamplingParams": "batchgen_data.engine.sampling_params",
    "PoolingParams": "batchgen_data.engine.pooling_params",
    "StructuredOutputsParams": "batchgen_data.engine.structured.params",
    "BatchGenOperator": "batchgen_data.operators",
    "BatchGenProcessorConfig": "batchgen_data.config.ray_processor",
    "build_processor": "batchgen_data.processor",
    "BatchGenMap": "batchgen_data.operators",
    # Ray Data LLM's names (``from ray.data.llm import ...`` -> ``from batchgen_data import ...``):
    # ours where this engine runs them...
    "vLLMEngineProcessorConfig": "batchgen_data.config.ray_processor",
    "build_llm_processor": "batchgen_data.processor",
    "Processor": "batchgen_data.processor",
    "ChatTemplateStageConfig": "batchgen_data.config.ray_stages",
    "DetokenizeStageConfig": "batchgen_data.config.ray_stages",
    "PrepareMultimodalStageConfig": "batchgen_data.config.ray_stages",
    "TokenizerStageConfig": "batchgen_data.config.ray_stages",
    # ...and Ray's own for the processors it runs (``build_processor`` hands them to Ray's).
    "ProcessorConfig": "ray.data.llm",
    "HttpRequestProcessorConfig": "ray.data.llm",
    "ServeDeploymentProcessorConfig": "ray.data.llm",
    "SGLangEngineProcessorConfig": "ray.data.llm",
    "HttpRequestStageConfig": "ray.data.llm",
}
__all__ = [
    "BatchGenError",
    "ChatTemplateStageConfig",
    "DetokenizeStageConfig",
    "HttpRequestProcessorConfig",
    "HttpRequestStageConfig",
    "PrepareMultimodalStageConfig",
    "Processor",
    "ProcessorConfig",
    "SGLangEngineProcessorConfig",
    "ServeDeploymentProcessorConfig",
    "TokenizerStageConfig",
    "build_llm_processor",
    "vLLMEngineProcessorConfig",
    "BatchGenMap",
    "BatchGenOperator",
    "BatchGenProcessorConfig",
    "CheckpointError",
    "ConfigError",
    "Engine",
    "EngineConfig",
    "EngineDeadError",
    "EngineStats",
    "GenerationOutput",
    "RequestError",
    "PoolingParams",
    "SamplingParams",
    "StructuredOutputsParams",
    "build_processor",
]

if TYPE_CHECKING:
    from batchgen_data.config import EngineConfig
    from batchgen_data.engine.engine import Engine
    from batchgen_data.engine.outputs import GenerationOutput
    from batchgen_data.engine.pooling_params import PoolingParams
    from batchgen_data.engine.sampling_params import SamplingParams
    from batchgen_data.engine.stats import EngineStats
    from batchgen_data.engine.structured.params import StructuredOutputsParams
    from batchgen_data.errors import (
        BatchGenError,
        CheckpointError,
        ConfigError,
        EngineDeadError,
        RequestError,
    )
    from batchgen_data.operators import BatchGenMap, BatchGenOperator
    from batchgen_data.config.ray_processor import BatchGenProcessorConfig, vLLMEngineProcessorConfig
    from batchgen_data.processor import Processor, build_llm_processor, build_processor
    from batchgen_data.config.ray_stages import (
        ChatTemplateStageConfig,
        DetokenizeStageConfig,
        PrepareMultimodalStageConfig,
        TokenizerStageConfig,
    )


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    raise AttributeError(f"module 'batchgen_data' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
