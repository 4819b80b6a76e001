"""Ray Data LLM's per-stage configs, and how a processor config's ``bool | dict | StageConfig``
value resolves to one (``resolve_stage``).

The classes are Ray's own (``ray.data.llm.ChatTemplateStageConfig``, ...): the same fields,
validation and ``ValidationError``, and ``isinstance`` holds either way. Ray runs each as its own
Ray Data stage; here the chat template, tokenizing and detokenizing run inside the engine actor, so
a stage's own resources (``batch_size``, ``concurrency``, ``runtime_env``, ``num_cpus``,
``memory``) have nothing to size, while ``enabled``, ``model_source``, ``chat_template`` and
``chat_template_kwargs`` keep Ray's meaning.
"""

from __future__ import annotations

from typing import Any, TypeVar

from ray.data.llm import (
    ChatTemplateStageConfig,
    DetokenizeStageConfig,
    PrepareMultimodalStageConfig,
    TokenizerStageConfig,
)

__all__ = ["ChatTemplateStageConfig", "DetokenizeStageConfig", "PrepareMultimodalStageConfig",
           "TokenizerStageConfig", "STAGE_FIELDS", "resolve_stage"]

T = TypeVar("T")

# A processor config's stage fields and the config class each resolves to, in the order they run.
STAGE_FIELDS: dict[str, type] = {
    "prepare_multimodal_stage": PrepareMultimodalStageConfig,
    "chat_template_stage": ChatTemplateStageConfig,
    "tokenize_stage": TokenizerStageConfig,
    "detokenize_stage": DetokenizeStageConfig,
}


def resolve_stage(value: Any, cls: type[T]) -> T:
    """``value`` (a bool, a dict of the config's fields, or a config of that class) as a new
    ``cls``, as Ray's builder resolves it; the value given is never changed.

    Raises:
        pydantic.ValidationError: a dict with an unknown key or a bad value.
        TypeError: any other type.

    Example:
        >>> resolve_stage({"batch_size": 64}, TokenizerStageConfig).batch_size
        64
        >>> resolve_stage(False, DetokenizeStageConfig).enabled
        False
    """
    if isinstance(value, cls) or (type(value).__name__ == cls.__name__ and hasattr(value, "model_dump")):
        return cls.model_validate(value.model_dump())  # also Ray's internal class of that name
    if isinstance(value, bool):
        return cls(enabled=value)
    if isinstance(value, dict):
        return cls(**value)
    raise TypeError(f"Unsupported type for stage config: {type(value).__name__}. Expected bool, dict, or "
                    f"{cls.__name__} instance. Got: {value!r}")
