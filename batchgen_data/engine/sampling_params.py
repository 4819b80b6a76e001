"""Sampling parameters, with vLLM's names and defaults."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from batchgen_data.engine.structured.params import StructuredOutputsParams
from batchgen_data.errors import ConfigError

# Most top tokens a request may ask for per position (vLLM's default max_logprobs).
MAX_LOGPROBS = 20
# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS): a positive temperature that
# rounds to 0 in the sampler's float32 would otherwise divide the logits by zero.
SAMPLING_EPS = 1e-5
# Ray Data LLM's name for ``structured_outputs`` (vLLM's before 0.10), accepted by ``from_dict``.
GUIDED_DECODING_ALIAS = "guided_decoding"


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request's output; names and defaults follow ``vllm.SamplingParams``.

    Args:
        max_tokens (int, default 16): most tokens to generate; at least 1.
        temperature (float, default 1.0): softmax temperature; ``0`` (or below 1e-5, as in vLLM)
            means greedy.
        top_p (float, default 1.0): nucleus mass to keep, in (0, 1].
        top_k (int, default 0): keep the k most likely tokens; ``0`` or ``-1`` turn it off.
        seed (int | None, default None): per-request seed; the same prompt and seed give the
            same tokens whatever else shares the batch.
        stop (str | list[str] | None, default None): strings that end generation; the stop string
            is not included in the output text.
        stop_token_ids (list[int] | None, default None): token ids that end generation (in
            addition to the model's end-of-sequence tokens unless ``ignore_eos``).
        ignore_eos (bool, default False): keep generating past end-of-sequence tokens.
        skip_special_tokens (bool, default True): drop special tokens when decoding text.
        spaces_between_special_tokens (bool, default True): vLLM's decoding option; it changes
            only slow tokenizers' text, and every tokenizer here is a fast one.
        include_stop_str_in_output (bool, default False): keep the stop string that ended the
            output in its text.
        detokenize (bool, default True): False returns token ids with an empty text (no stop
            strings then, as in vLLM).
        truncate_prompt_tokens (int | None, default None): keep only the last k prompt tokens
            (left truncation); -1 keeps as many as the context limit allows.
        logprobs (int | None, default None): per generated token, return its log-probability and
            those of the ``logprobs`` most likely tokens (0: the generated token only), up to 20.
        prompt_logprobs (int | None, default None): the same for every prompt token after the
            first (its entry is None); such a request does not take prompt KV from the prefix
            cache (its positions must be computed).
        structured_outputs (StructuredOutputsParams | dict | None, default None): a JSON schema,
            regex, choice list or grammar the output must match (a dict of
            ``StructuredOutputsParams`` fields is fine). The output finishes with ``"stop"`` once
            the grammar is complete, or with ``"length"`` if ``max_tokens`` cut it short.

    Example:
        >>> SamplingParams(max_tokens=8, temperature=0).temperature
        0.0
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    truncate_prompt_tokens: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    _stop_strings: tuple[str, ...] = field(default=(), init=False, repr=False)

    def __post_init__(self) -> None:
        self.verify()

    def verify(self) -> None:
        """Raise ``ConfigError`` naming the first invalid field and its valid range."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ConfigError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool):
            raise ConfigError(f"temperature must be a float >= 0, got {self.temperature!r}")
        if math.isnan(self.temperature) or self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        self.temperature = float(self.temperature) if self.temperature >= SAMPLING_EPS else 0.0
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ConfigError(f"top_k must be an int >= -1 (-1 or 0 = off), got {self.top_k!r}")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                     "include_stop_str_in_output", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ConfigError(f"seed must be an int or None, got {self.seed!r}")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if not all(isinstance(s, str) and s for s in stops):
            raise ConfigError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self._stop_strings = tuple(stops)
        if stops and not self.detokenize:
            raise ConfigError("stop strings need detokenize=True (they are found in the text), as in vLLM")
        value = self.truncate_prompt_tokens
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value == 0 or value < -1):
            raise ConfigError(f"truncate_prompt_tokens must be an int >= 1, -1 (the context limit) or None, "
                              f"got {value!r}")
        ids = list(self.stop_token_ids or [])
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ConfigError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value <= MAX_LOGPROBS):
                raise ConfigError(f"{name} must be an int in [0, {MAX_LOGPROBS}] or None, got {value!r}")
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self._stop_strings

    def to_dict(self) -> dict:
        """The public fields as plain data (what ``from_dict`` takes back)."""
        out = {f: getattr(self, f) for f in self.__dataclass_fields__ if not f.startswith("_")}
        if self.structured_outputs is not None:
            out["structured_outputs"] = self.structured_outputs.to_dict()
        return out

    @classmethod
    def from_dict(cls, values: dict) -> SamplingParams:
        """Build from a dict with vLLM / Ray Data LLM names (``guided_decoding`` is taken as
        ``structured_outputs``); unknown keys are an error."""
        values = normalize_structured_outputs(values)
        known = {f for f in cls.__dataclass_fields__ if not f.startswith("_")}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}")
        return cls(**{k: v for k, v in values.items() if v is not None or k == "seed"})

    @classmethod
    def defaults(cls) -> dict:
        """Every public field's default, by name: the one copy the pipeline stages, the CLI flags
        and the work pool take theirs from.

        Example:
            >>> SamplingParams.defaults()["max_tokens"]
            16
        """
        return cls().to_dict()


def normalize_structured_outputs(values: dict) -> dict:
    """``values`` with Ray Data LLM's ``guided_decoding`` renamed ``structured_outputs`` (both
    set is an error)."""
    out = {k: v for k, v in values.items() if k != GUIDED_DECODING_ALIAS}
    alias = values.get(GUIDED_DECODING_ALIAS)
    if alias is not None:
        if out.get("structured_outputs") is not None:
            raise ConfigError("give structured_outputs or guided_decoding, not both")
        out["structured_outputs"] = alias
    return out
