"""Ray Data LLM's per-stage configs (``ChatTemplateStageConfig``, ``TokenizerStageConfig``,
``DetokenizeStageConfig``, ``PrepareMultimodalStageConfig``) and how a processor config's
``bool | dict | StageConfig`` value resolves to one (``resolve_stage``).

Ray runs each as its own Ray Data stage. Here the chat template, tokenizing and detokenizing run
inside the engine actor, so a stage's own resources (``batch_size``, ``concurrency``,
``runtime_env``, ``num_cpus``, ``memory``) are accepted and have nothing to size; ``enabled``,
``model_source``, ``chat_template`` and ``chat_template_kwargs`` keep Ray's meaning. Ray's own
config objects (pydantic) are accepted too, read through ``model_dump``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

from batchgen_data.errors import ConfigError

T = TypeVar("T", bound="_StageConfig")


@dataclass(slots=True)
class _StageConfig:
    """Fields every Ray Data LLM stage config has."""

    enabled: bool = True
    batch_size: int | None = None
    concurrency: int | tuple[int, int] | None = None
    runtime_env: dict | None = None
    num_cpus: float | None = None
    memory: float | None = None


@dataclass(slots=True)
class ChatTemplateStageConfig(_StageConfig):
    """Render ``messages`` with the chat template (Ray Data LLM's ``ChatTemplateStageConfig``).

    Example:
        >>> ChatTemplateStageConfig(chat_template_kwargs={"enable_thinking": False}).enabled
        True
    """

    model_source: str | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None


@dataclass(slots=True)
class TokenizerStageConfig(_StageConfig):
    """Tokenize prompts (Ray's ``TokenizerStageConfig``): the engine always does; accepted."""

    model_source: str | None = None


@dataclass(slots=True)
class DetokenizeStageConfig(_StageConfig):
    """Detokenize outputs (Ray's ``DetokenizeStageConfig``): enabled, every row gets its
    ``generated_text`` even when its ``sampling_params`` say ``detokenize=False``, as Ray's
    stage decodes ``generated_tokens`` after the engine."""

    model_source: str | None = None


@dataclass(slots=True)
class PrepareMultimodalStageConfig(_StageConfig):
    """Ray's multimodal preprocessing stage: off by default; enabling it is refused when the
    processor is built (text-only models here)."""

    enabled: bool = False
    model_config_kwargs: dict | None = None
    chat_template_content_format: str | None = "string"
    apply_sys_msg_formatting: bool | None = False


def resolve_stage(value: Any, cls: type[T], name: str) -> T:
    """``value`` (bool, dict, one of ours, or Ray's config of the same name) as ``cls``.

    Example:
        >>> resolve_stage({"batch_size": 64}, TokenizerStageConfig, "tokenize_stage").batch_size
        64
        >>> resolve_stage(False, DetokenizeStageConfig, "detokenize_stage").enabled
        False
    """
    if isinstance(value, cls):
        return dataclasses.replace(value)
    if isinstance(value, bool):
        return cls(enabled=value)
    if type(value).__name__ == cls.__name__ and hasattr(value, "model_dump"):  # Ray's pydantic config
        value = value.model_dump()
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a bool, a dict or a {cls.__name__}, got {type(value).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(f"unknown {name} keys {unknown}; known: {sorted(known)}")
    return cls(**value)
