"""Ray Data LLM's processor API over this engine: ``build_processor(vLLMEngineProcessorConfig(...))``.

A Ray Data LLM pipeline

    from ray.data.llm import build_processor, vLLMEngineProcessorConfig
    processor = build_processor(vLLMEngineProcessorConfig(model_source=..., engine_kwargs=...,
                                batch_size=..., concurrency=...), preprocess=..., postprocess=...)
    ds = processor(ds)

switches by changing its import only:

    from batchgen_data import build_processor, vLLMEngineProcessorConfig

(the config is ``config/ray_processor.py``'s, a subclass of Ray's). The processor is preprocess
(``ds.map``; what it returns is merged into the row, as in Ray Data LLM), one ``BatchGenOperator``
stage (``vLLMEngineStage``: the chat template, tokenizing, generating and detokenizing all happen
in the engine actor; ``list_stage_names`` names them as Ray does), then postprocess (``ds.map``;
only what it returns is kept; error rows skip it whole). Rows take Ray Data LLM's columns:
``messages`` or ``prompt`` (or ``tokenized_prompt`` / ``prompt_token_ids``) and a
``sampling_params`` dict with vLLM's names (``pooling_params`` for ``task_type`` embed /
classify). Configs this engine does not run (HTTP, Serve, SGLang) go to Ray's own
``build_processor``, so a file building one beside an engine processor keeps working.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from batchgen_data.config.ray_processor import BatchGenProcessorConfig, vLLMEngineProcessorConfig
from batchgen_data.errors import ConfigError
from batchgen_data.processor.stages import ProcessorStage, engine_stages

__all__ = ["BatchGenProcessorConfig", "Processor", "ProcessorStage", "build_llm_processor", "build_processor",
           "vLLMEngineProcessorConfig"]

# Keys Ray's vLLM builder takes in ``builder_kwargs`` (the others are build_processor's own).
_BUILDER_KWARGS = frozenset({"chat_template_kwargs"})
_RESERVED_BUILDER_KWARGS = frozenset({"preprocess", "postprocess", "preprocess_map_kwargs", "postprocess_map_kwargs"})


class Processor:
    """``processor(dataset) -> dataset``: preprocess, the stages, postprocess (lazily), with Ray
    Data LLM's ``Processor`` constructor and methods.

    Args:
        config: the processor's config (ours, or any of Ray's ``ProcessorConfig`` classes).
        stages: ``ProcessorStage`` objects in order (``build_processor`` makes them); each with a
            ``fn`` is mapped with ``Dataset.map_batches``, the others run inside the engine actor.
        preprocess: row -> dict merged into the row.
        postprocess: row -> the output row; error rows skip it (``__inference_error__`` not "").
        preprocess_map_kwargs, postprocess_map_kwargs: extra ``Dataset.map`` arguments.

    Example:
        >>> from ray.data.llm import ProcessorConfig
        >>> Processor(ProcessorConfig(batch_size=8), stages=[]).list_stage_names()
        []
    """

    def __init__(self, config, stages: Iterable[ProcessorStage], preprocess: Callable[[dict], dict] | None = None,
                 postprocess: Callable[[dict], dict] | None = None, preprocess_map_kwargs: dict | None = None,
                 postprocess_map_kwargs: dict | None = None):
        self.config = config
        self.preprocess = preprocess
        self.postprocess = postprocess
        self.preprocess_map_kwargs = dict(preprocess_map_kwargs or {})
        self.postprocess_map_kwargs = dict(postprocess_map_kwargs or {})
        self.stages: OrderedDict[str, ProcessorStage] = OrderedDict()
        for stage in stages:
            if not isinstance(stage, ProcessorStage):
                raise TypeError(f"stages must be ProcessorStage objects (build_processor makes them), got "
                                f"{type(stage).__name__}; Ray's own stages run in ray.data.llm.Processor")
            name, n = type(stage).__name__, 0
            while name in self.stages:
                n += 1
                name = f"{type(stage).__name__}_{n}"
            self.stages[name] = stage

    def list_stage_names(self) -> list[str]:
        """The stages' names in order (``DummyStage``, ``DummyStage_1`` for two of one class)."""
        return list(self.stages)

    def get_stage_by_name(self, name: str) -> ProcessorStage:
        if name not in self.stages:
            raise ValueError(f"Stage {name} not found")
        return self.stages[name]

    def __call__(self, dataset):
        if self.preprocess is not None:
            dataset = dataset.map(_MergeInto(self.preprocess), **self.preprocess_map_kwargs)
        for stage in self.stages.values():
            if stage.runs_in_engine_actor:
                continue
            options = dict(stage.map_batches_kwargs)
            if "num_cpus" not in options:
                options["num_cpus"] = _default_cpus(_pool_max(options.get("compute")))
            dataset = dataset.map_batches(stage.fn, fn_constructor_kwargs=stage.fn_constructor_kwargs, **options)
        # as Ray's: always a postprocess (identity by default), which error rows skip
        return dataset.map(_PostprocessPassingErrors(self.postprocess,
                                                     getattr(self.config, "should_continue_on_error", False)),
                           **self.postprocess_map_kwargs)

    def log_input_column_names(self) -> None:
        """Log the columns the first stage reads (Ray Data LLM's method)."""
        import logging

        if getattr(self.config, "task_type", "generate") == "generate":
            needed = "messages (chat, when chat_template_stage is on), or prompt, or tokenized_prompt; sampling_params"
        else:
            needed = "messages, prompt or tokenized_prompt; optional pooling_params"
        first = next(iter(self.stages), None)
        logging.getLogger(__name__).info("The first stage of the processor is %s.\nRequired input columns: %s",
                                         first, needed)


def build_processor(config, preprocess: Callable[[dict], dict] | None = None,
                    postprocess: Callable[[dict], dict] | None = None, preprocess_map_kwargs: dict | None = None,
                    postprocess_map_kwargs: dict | None = None, builder_kwargs: dict | None = None):
    """A ``Processor`` for ``config`` (Ray Data LLM's ``ray.data.llm.build_processor``).

    Args:
        config: ``vLLMEngineProcessorConfig`` (ours, ``BatchGenProcessorConfig``; Ray's own is
            read field for field). Ray's other configs (``HttpRequestProcessorConfig``,
            ``ServeDeploymentProcessorConfig``, ``SGLangEngineProcessorConfig``) are built by
            Ray's own ``build_processor``.
        preprocess: row -> dict merged into the row (give ``messages`` or ``prompt``, and
            ``sampling_params``).
        postprocess: row -> the output row (the generated columns are in it); error rows skip it.
        preprocess_map_kwargs, postprocess_map_kwargs: extra ``Dataset.map`` arguments.
        builder_kwargs: as Ray's: ``chat_template_kwargs`` (used where the chat template stage
            gives none).

    Raises:
        ValueError: ``builder_kwargs`` holding one of the arguments above.
        TypeError: another ``builder_kwargs`` key (as Ray's builder's signature refuses it).
        ConfigError: what ``BatchGenProcessorConfig.check`` refuses.

    Example:
        >>> processor = build_processor(BatchGenProcessorConfig(model_source="demo"))
        >>> processor.list_stage_names()
        ['ChatTemplateStage', 'TokenizeStage', 'vLLMEngineStage', 'DetokenizeStage']
    """
    builder_kwargs = dict(builder_kwargs or {})
    reserved = sorted(_RESERVED_BUILDER_KWARGS & builder_kwargs.keys())
    if reserved:
        raise ValueError(f"builder_kwargs cannot contain {reserved} as these are passed as explicit arguments to "
                         "build_processor. Please pass these directly instead of in builder_kwargs.")
    if _is_rays_vllm_config(config):
        config = BatchGenProcessorConfig(**_fields_of_rays(config))
    if not isinstance(config, BatchGenProcessorConfig):
        if type(config).__module__.startswith("ray."):
            from ray.data.llm import build_processor as rays_build_processor

            return rays_build_processor(config, preprocess, postprocess, preprocess_map_kwargs,
                                        postprocess_map_kwargs, builder_kwargs or None)
        raise ConfigError(f"config must be a vLLMEngineProcessorConfig (BatchGenProcessorConfig) or one of Ray "
                          f"Data LLM's processor configs, got {type(config).__name__}")
    unknown = sorted(builder_kwargs.keys() - _BUILDER_KWARGS)
    if unknown:
        raise TypeError(f"build_processor() got unexpected builder_kwargs {unknown}; the vLLM engine processor "
                        f"takes {sorted(_BUILDER_KWARGS)}")
    engine_fields = config.check()  # engine_kwargs mapped and checked once, for every stage
    stages = engine_stages(config, builder_kwargs.get("chat_template_kwargs"), engine_fields=engine_fields)
    return Processor(config, stages, preprocess, postprocess, preprocess_map_kwargs, postprocess_map_kwargs)


# Older Ray Data LLM's name for build_processor.
build_llm_processor = build_processor


def _is_rays_vllm_config(config: Any) -> bool:
    return type(config).__name__ == "vLLMEngineProcessorConfig" and type(config).__module__.startswith("ray.")


def _fields_of_rays(config: Any) -> dict:
    """A Ray ``vLLMEngineProcessorConfig``'s field values (ours is a subclass: every one is ours)."""
    return {name: getattr(config, name) for name in type(config).model_fields}


class _MergeInto:
    """Preprocess as Ray Data LLM applies it: its output is merged into the row."""

    def __init__(self, fn: Callable[[dict], dict]):
        self.fn = fn

    def __call__(self, row: dict) -> dict:
        return {**row, **self.fn(row)}


class _PostprocessPassingErrors:
    """Postprocess as Ray Data LLM applies it, on rows as Ray's stages leave them:
    ``__inference_error__`` is ``""`` on a success row (the engine stage's Arrow column holds null
    there) and ``embeddings`` a float32 ``np.ndarray`` (a ``list<float32>`` column here). An error
    row skips postprocess and comes out whole (a user's postprocess would drop the error or fail
    on the missing outputs); a success row comes out as postprocess returns it, with
    ``__inference_error__`` ``""`` added when the job continues on errors (Ray's one schema)."""

    def __init__(self, fn: Callable[[dict], dict] | None, include_error_column: bool):
        self.fn = fn
        self.include_error_column = include_error_column

    def __call__(self, row: dict) -> dict:
        import numpy as np

        from batchgen_data.operators.columns import ERROR_COLUMN

        if isinstance(row.get("embeddings"), (list, np.ndarray)):
            row["embeddings"] = np.asarray(row["embeddings"], dtype=np.float32)
        if row.get(ERROR_COLUMN) not in (None, ""):
            return row
        if ERROR_COLUMN in row:
            row[ERROR_COLUMN] = ""
        if self.fn is None:
            return row
        result = self.fn(row)
        if self.include_error_column:
            result[ERROR_COLUMN] = ""
        return result


def _pool_max(compute: Any) -> int:
    """The most actors an ``ActorPoolStrategy`` starts (1 for anything else)."""
    return int(getattr(compute, "max_size", None) or getattr(compute, "size", None) or 1)


def _default_cpus(num_actors: int) -> float:
    """Leave a CPU for Ray Data's read and bookkeeping tasks, and half of the rest for a second
    processor's actors in the same pipeline (chained processors): whole-CPU actors on a small
    machine starve them and the pipeline hangs without an error. (Ray's accounting only: an
    actor's torch threads are not bounded by it.)"""
    import ray

    total = ray.cluster_resources().get("CPU", 1) if ray.is_initialized() else 2
    return max(0.25, min(1.0, (total - 1) / num_actors / 2))
