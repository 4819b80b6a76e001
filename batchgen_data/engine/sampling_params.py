"""Sampling parameters, with vLLM's names and defaults."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from batchgen_data.engine.structured.params import StructuredOutputsParams
from batchgen_data.engine.validated import ValidatedOnAssignment
from batchgen_data.errors import ConfigError

# Most top tokens a request may ask for per position (vLLM's default max_logprobs).
MAX_LOGPROBS = 20
# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS): a positive temperature that
# rounds to 0 in the sampler's float32 would otherwise divide the logits by zero.
SAMPLING_EPS = 1e-5
# Ray Data LLM's name for ``structured_outputs`` (vLLM's before 0.10), accepted by ``from_dict``.
GUIDED_DECODING_ALIAS = "guided_decoding"
# presence_penalty and frequency_penalty bounds (vLLM's, after OpenAI's).
MAX_ABS_PENALTY = 2.0
# logit_bias values are clamped to [-100, 100] (OpenAI's range, as vLLM's OpenAI layer does).
MAX_ABS_LOGIT_BIAS = 100.0
# The float fields: NaN or an infinity in any of them is an error (as in vLLM), and so is a value
# float32 cannot hold, the sampler's dtype (a temperature of 1e300 is inf there, and the logits
# it divides become NaN).
FLOAT_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
FLOAT32_MAX = 3.4028234663852886e38


@dataclass(slots=True)
class SamplingParams(ValidatedOnAssignment):
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
        presence_penalty (float, default 0.0): in [-2, 2]; subtracted once from the logit of
            every token the output already holds (> 0: new tokens; < 0: repeats).
        frequency_penalty (float, default 0.0): in [-2, 2]; subtracted from each token's logit
            once per time the output holds it.
        repetition_penalty (float, default 1.0): > 0; the logit of every token in the prompt or
            the output is divided by it when positive and multiplied by it otherwise (> 1:
            new tokens).
        min_p (float, default 0.0): in [0, 1]; a sampled row keeps only the tokens whose
            probability (after temperature) is at least ``min_p`` times the top token's.
        min_tokens (int, default 0): in [0, max_tokens]; until this many tokens are generated,
            end-of-sequence and ``stop_token_ids`` are masked out and neither they nor stop
            strings stop the output.
        logit_bias (dict[int, float] | None, default None): added to the named tokens' logits;
            keys may be int-like strings (as JSON gives them), values are clamped to
            [-100, 100]. Token ids must be in the vocabulary.
        allowed_token_ids (list[int] | None, default None): only these tokens can be generated.
        bad_words (list[str] | None, default None): words that are never completed: each is
            tokenized with and without a leading space, and the last token of a sequence is
            masked whenever the output ends with the rest of it.
        Penalties, bias and masks apply in vLLM's order (allowed tokens, bad words, min_tokens,
        logit_bias, penalties, then temperature, min_p, top-k, top-p); ``logprobs`` still
        report the model's own distribution (vLLM's default ``raw_logprobs``).

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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    _stop_strings: tuple[str, ...] = field(default=(), init=False, repr=False)
    # Set by ``verify``: some logits processor or penalty changes this request's logits.
    _adjusts_logits: bool = field(default=False, init=False, repr=False, compare=False)
    # Resolved against the engine's tokenizer when the request is added (``requests.py``
    # ``resolve_token_params``; vLLM's ``_bad_words_token_ids`` / ``_all_stop_token_ids``).
    _bad_words_token_ids: tuple[tuple[int, ...], ...] | None = field(default=None, init=False, repr=False,
                                                                     compare=False)
    _all_stop_token_ids: frozenset[int] | None = field(default=None, init=False, repr=False, compare=False)
    # True once built: a field set later is checked as it is set (``validated.py``).
    _checked: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.verify()
        self._checked = True

    def verify(self) -> None:
        """Raise ``ConfigError`` naming the first invalid field and its valid range."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ConfigError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens}")
        for name in FLOAT_FIELDS:
            _check_finite(name, getattr(self, name))
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool):
            raise ConfigError(f"temperature must be a float >= 0, got {self.temperature!r}")
        if self.temperature < 0:
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
        self._verify_logits_processors()

    def _verify_logits_processors(self) -> None:
        """vLLM's checks and messages for the penalties and logits processors' fields."""
        for name in ("presence_penalty", "frequency_penalty"):
            value = _as_float(name, getattr(self, name))
            if not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:
                raise ConfigError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        value = _as_float("repetition_penalty", self.repetition_penalty)
        if not math.isfinite(value) or value <= 0.0:
            raise ConfigError(f"repetition_penalty must be a finite number greater than zero, got {value}")
        self.repetition_penalty = value
        value = _as_float("min_p", self.min_p)
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"min_p must be in [0, 1], got {value}")
        self.min_p = value
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ConfigError(f"min_tokens must be an int greater than or equal to 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ConfigError(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                              f"got {self.min_tokens}")
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if isinstance(ids, (str, bytes, dict)) or not hasattr(ids, "__iter__"):
                raise ConfigError(f"allowed_token_ids must be a list of token ids or None, got {ids!r}")
            ids = list(ids)
            if not ids:
                raise ConfigError("allowed_token_ids must not be empty (None allows every token)")
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise ConfigError(f"allowed_token_ids must be ints, got {self.allowed_token_ids!r}")
            self.allowed_token_ids = ids
        if self.bad_words is not None:
            words = self.bad_words
            if isinstance(words, (str, bytes, dict)) or not hasattr(words, "__iter__"):
                raise ConfigError(f"bad_words must be a list of strings or None, got {words!r}")
            words = list(words)
            if not all(isinstance(w, str) for w in words):
                raise ConfigError(f"bad_words must be strings, got {self.bad_words!r}")
            if not all(words):
                raise ConfigError(f"bad_words cannot contain an empty string, got bad_words={words!r}")
            self.bad_words = list(dict.fromkeys(words))  # vLLM drops repeats
        self._adjusts_logits = bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
            or (self.min_p and self.temperature > 0.0) or self.min_tokens or self.logit_bias
            or self.allowed_token_ids is not None or self.bad_words)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Some penalty or logits processor (min_p included) changes this request's sampling:
        the sampler builds per-row data only for such rows."""
        return self._adjusts_logits

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def bad_words_token_ids(self) -> tuple[tuple[int, ...], ...]:
        """``bad_words`` as token sequences (resolved when the request is added; empty before)."""
        return self._bad_words_token_ids or ()

    @property
    def all_stop_token_ids(self) -> frozenset[int]:
        """The tokens ``min_tokens`` masks: ``stop_token_ids`` and the model's end-of-sequence
        tokens (even with ``ignore_eos``, as vLLM), once the request is added."""
        if self._all_stop_token_ids is not None:
            return self._all_stop_token_ids
        return frozenset(self.stop_token_ids or ())

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


def _check_finite(name: str, value) -> None:
    """A float field's value is a finite number float32 holds (other types: the field's own check)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value}")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) > FLOAT32_MAX:
        shown = f"{value:.4g}" if isinstance(value, float) else f"an int of {value.bit_length()} bits"
        raise ConfigError(f"{name} must be within +-{FLOAT32_MAX:.4g} (float32's range, which the sampler "
                          f"computes in), got {shown}")


def _as_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    _check_finite(name, value)
    return float(value)


def _logit_bias(values) -> dict[int, float]:
    """``{token id: bias}`` with int-like string keys taken as ints and biases clamped to
    [-100, 100] (vLLM's ``SamplingParams.from_optional``, which its OpenAI layer uses)."""
    if not isinstance(values, dict):
        raise ConfigError(f"logit_bias must be a dict of token id -> bias or None, got {values!r}")
    out: dict[int, float] = {}
    for key, bias in values.items():
        token = key if isinstance(key, int) and not isinstance(key, bool) else _int_like(key)
        if token is None:
            raise ConfigError(f"logit_bias contains a key that cannot be converted to an integer token id: {key!r}")
        bias = _as_float(f"logit_bias[{key!r}]", bias)
        out[token] = min(MAX_ABS_LOGIT_BIAS, max(-MAX_ABS_LOGIT_BIAS, bias))
    return out


def _int_like(key) -> int | None:
    if isinstance(key, str):
        try:
            return int(key.strip())
        except ValueError:
            return None
    return None


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
