"""Pooling parameters (embed, classify), with vLLM's names and defaults. No torch.

A pooling request is prefill-only: it runs its prompt like any other (in the same forwards,
through the same combined expert batches) and, once the prompt is computed, finishes with the
pooler's output instead of a sampled token. The pooled state is the final-normed hidden state
at the last prompt position (vLLM's LAST pooling, its default for a generative model converted
with ``convert="embed"`` / ``"classify"``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from batchgen_data.config.tasks import POOLING_TASKS
from batchgen_data.engine.validated import ValidatedOnAssignment
from batchgen_data.errors import ConfigError, RequestError

if TYPE_CHECKING:
    from batchgen_data.model.config import ModelConfig

# The fields each task takes (vLLM's ``PoolingParams.valid_parameters``); another task's field
# set is an error, as in vLLM.
_TASK_FIELDS = {"embed": ("dimensions", "normalize"), "classify": ("use_activation",)}


@dataclass(slots=True)
class PoolingParams(ValidatedOnAssignment):
    """How to pool one request's prompt; names and defaults follow ``vllm.PoolingParams``.

    Args:
        task (str | None, default None): ``"embed"`` or ``"classify"``. ``Engine.embed`` /
            ``Engine.classify`` set it; ``Engine.add_request`` needs it set.
        dimensions (int | None, default None): embed: keep the first ``dimensions`` values
            (matryoshka), then normalize. Only for checkpoints whose config.json declares
            ``matryoshka_dimensions`` (one of them) or ``is_matryoshka``, as in vLLM.
        normalize (bool | None, default None -> True): embed: L2-normalize the embedding.
        use_activation (bool | None, default None -> True): classify: turn the head's logits
            into probabilities (softmax; sigmoid for a single label or a multi-label
            ``problem_type``; none for ``regression``), else return the logits.
        truncate_prompt_tokens (int | None, default None): keep only the last k prompt tokens
            (left truncation); -1 keeps as many as the context limit holds.
        skip_reading_prefix_cache (bool | None, default None -> True): compute the whole prompt,
            taking no prefix from the cache, so a prompt's pooled output does not depend on what
            was cached before it (identical prompts give identical embeddings, as Ray Data LLM's
            tests expect). False takes a cached prefix's KV, as vLLM's default for LAST pooling:
            faster for rows sharing a long prefix, equal to about 1e-7.

    Example:
        >>> PoolingParams(task="embed", dimensions=32).for_task("embed").normalize
        True
    """

    task: str | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None
    skip_reading_prefix_cache: bool | None = None
    # True once built: a field set later is checked as it is set (``validated.py``).
    _checked: bool = dataclasses.field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.verify()
        self._checked = True

    def verify(self) -> None:
        """Raise ``ConfigError`` naming the first invalid field and its valid range; with a
        task set, fill in its defaults (``normalize`` / ``use_activation`` True), as vLLM's."""
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ConfigError(f"task must be one of {list(POOLING_TASKS)} or None, got {self.task!r}")
        value = self.dimensions
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"dimensions must be an int >= 1 or None, got {value!r}")
        for name in ("normalize", "use_activation", "skip_reading_prefix_cache"):
            if getattr(self, name) not in (None, True, False):
                raise ConfigError(f"{name} must be a bool or None, got {getattr(self, name)!r}")
        value = self.truncate_prompt_tokens
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value == 0 or value < -1):
            raise ConfigError(f"truncate_prompt_tokens must be an int >= 1, -1 (the context limit) or None, "
                              f"got {value!r}")
        if self.task is not None:
            others = [name for task, names in _TASK_FIELDS.items() if task != self.task for name in names
                      if getattr(self, name) is not None]
            if others:
                raise ConfigError(f"task {self.task!r} takes {list(_TASK_FIELDS[self.task])}, "
                                  f"not {others}")
        if self.task == "embed" and self.normalize is None:
            self.normalize = True
        if self.task == "classify" and self.use_activation is None:
            self.use_activation = True

    @property
    def max_tokens(self) -> int:
        """Tokens a pooling request generates: none (what the engine's token budgets read)."""
        return 0

    def for_task(self, task: str) -> PoolingParams:
        """A copy for ``task``, its defaults filled in; a different task already set is an
        error, as in vLLM."""
        if self.task is not None and self.task != task:
            raise ConfigError(f"PoolingParams(task={self.task!r}) cannot run as task {task!r}")
        if self.task == task:  # built for it: its defaults are filled in already
            return self
        return dataclasses.replace(self, task=task)

    def check_model(self, model: ModelConfig) -> None:
        """Raise ``RequestError`` unless ``model`` can run this request: a task is set, classify
        has a classification head, ``dimensions`` fits a matryoshka model."""
        if self.task is None:
            raise RequestError("PoolingParams.task is not set: use Engine.embed / Engine.classify, "
                               "or PoolingParams(task='embed' | 'classify')")
        if self.task == "classify" and not model.num_labels:
            raise RequestError(f"classify needs a sequence-classification head (a *ForSequenceClassification "
                               f"checkpoint with score.weight); this {model.model_type} checkpoint has none")
        if self.dimensions is not None:
            supported = model.matryoshka_dimensions
            if not model.is_matryoshka:
                raise RequestError(f"dimensions={self.dimensions}: this checkpoint does not declare matryoshka "
                                   "embeddings (config.json matryoshka_dimensions or is_matryoshka); truncating "
                                   "its embeddings would give poor results (as vLLM refuses)")
            if supported and self.dimensions not in supported:
                raise RequestError(f"dimensions={self.dimensions}: this checkpoint supports {list(supported)}")
            if self.dimensions > model.hidden_size:
                raise RequestError(f"dimensions={self.dimensions} exceeds the embedding size {model.hidden_size}")

    def to_dict(self) -> dict:
        """The fields as plain data (what ``from_dict`` takes back)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    @classmethod
    def from_dict(cls, values: dict) -> PoolingParams:
        """Build from a dict with vLLM's names (Ray Data LLM's ``pooling_params`` column);
        unknown keys are an error, None means the default."""
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown pooling parameter(s) {unknown}; known: {sorted(known)}")
        return cls(**{k: v for k, v in values.items() if v is not None})
