"""A processor's stages as Ray Data LLM names and shows them (``Processor.list_stage_names``,
``get_stage_by_name``), built from a ``BatchGenProcessorConfig``.

Ray runs ``ChatTemplateStage``, ``TokenizeStage``, ``vLLMEngineStage`` and ``DetokenizeStage``
as four Ray Data stages. Here one ``BatchGenOperator`` actor runs all of them, so only
``vLLMEngineStage`` has a ``fn`` that Ray Data maps; the others are named, in Ray's order and on
Ray's conditions, with ``fn`` None and the config they run with in ``fn_constructor_kwargs``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchgen_data.config.ray_processor import BatchGenProcessorConfig


@dataclass
class ProcessorStage:
    """One stage, with the attributes of Ray's ``StatefulStage``: ``fn`` (the class Ray Data maps
    over batches, or None for a stage that runs inside the engine actor),
    ``fn_constructor_kwargs`` and ``map_batches_kwargs`` (``Dataset.map_batches`` arguments:
    ``compute``, ``batch_size``, ...). Its name is its class's name, as in Ray."""

    fn: Any = None
    fn_constructor_kwargs: dict = field(default_factory=dict)
    map_batches_kwargs: dict = field(default_factory=dict)

    @property
    def runs_in_engine_actor(self) -> bool:
        return self.fn is None


class ChatTemplateStage(ProcessorStage):
    """Renders ``messages`` with the chat template (inside the engine actor)."""


class TokenizeStage(ProcessorStage):
    """Tokenizes prompts (inside the engine actor)."""


class vLLMEngineStage(ProcessorStage):  # noqa: N801 (Ray's name)
    """Generates (or pools): ``BatchGenOperator`` actors, mapped by Ray Data."""


class DetokenizeStage(ProcessorStage):
    """Decodes ``generated_tokens`` into ``generated_text`` for every row (inside the engine actor)."""


def engine_stages(config: BatchGenProcessorConfig, chat_template_kwargs: dict | None = None,
                  num_cpus: float | None = None, engine_fields: dict | None = None) -> list[ProcessorStage]:
    """The stages ``config`` runs, in Ray's order: chat template and tokenize when enabled, the
    engine, detokenize when enabled (``config.check()`` has refused an enabled multimodal stage).

    Args:
        config: the processor's config.
        chat_template_kwargs: ``build_processor``'s ``builder_kwargs`` fallback, as in Ray.
        num_cpus: CPUs per engine actor when the config gives none (``Processor`` sizes it on
            the cluster it runs on).
        engine_fields: ``config.check()``'s (the engine arguments mapped once), else mapped here.
    """
    import ray

    from batchgen_data.operators import BatchGenOperator

    operator_kwargs = config.operator_kwargs(chat_template_kwargs, engine_fields)
    stages: list[ProcessorStage] = []
    chat = config.stage("chat_template_stage")
    if chat.enabled:
        stages.append(ChatTemplateStage(fn_constructor_kwargs={
            "chat_template": operator_kwargs["chat_template"],
            "chat_template_kwargs": operator_kwargs["chat_template_kwargs"],
            "model_source": operator_kwargs["model"]}))
    if config.stage("tokenize_stage").enabled:
        stages.append(TokenizeStage(fn_constructor_kwargs={"model_source": operator_kwargs["model"]}))
    pool = config.actor_pool()
    options: dict[str, Any] = {
        # Arrow batches: every output column keeps its Arrow type (logprobs too)
        "batch_size": config.batch_size, "batch_format": "pyarrow",
        "compute": ray.data.ActorPoolStrategy(**pool, max_concurrent_calls_per_actor=config.max_concurrent_batches,
                                              max_tasks_in_flight_per_actor=config.max_tasks_in_flight_per_actor),
    }
    if config.num_cpus is not None or num_cpus is not None:
        options["num_cpus"] = config.num_cpus if config.num_cpus is not None else num_cpus
    if config.runtime_env is not None:
        options["runtime_env"] = config.runtime_env
    if config.accelerator_type is not None:
        options.update(accelerator_type=config.accelerator_type, num_gpus=1)
    # The actor's call slots, as its pool strategy gives them: the pool learns when the input is all in.
    stages.append(vLLMEngineStage(fn=BatchGenOperator, map_batches_kwargs=options, fn_constructor_kwargs={
        **operator_kwargs, "max_concurrent_batches": config.max_concurrent_batches}))
    if config.stage("detokenize_stage").enabled:
        stages.append(DetokenizeStage(fn_constructor_kwargs={"model_source": operator_kwargs["model"]}))
    return stages
