"""What the engine returns for each request."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchgen_data.engine.sample.logprobs import Logprob


@dataclass(slots=True)
class RequestTimings:
    """Seconds since the request was submitted (``None`` where not reached)."""

    queued_s: float = 0.0
    first_token_s: float | None = None
    finished_s: float | None = None


@dataclass(slots=True)
class GenerationOutput:
    """One request's result, in the order the prompts were given.

    ``finish_reason`` is ``"stop"`` (end-of-sequence, a stop token or a stop string),
    ``"length"`` (``max_tokens`` reached) or ``"error"`` (then ``error`` says why and the other
    fields describe what was produced before it, usually nothing). ``logprobs`` (one
    ``{token_id: Logprob}`` per generated token) and ``prompt_logprobs`` (one per prompt token,
    the first None) are set when the request's ``SamplingParams`` asked for them, as in vLLM.
    A pooling request (``Engine.embed`` / ``Engine.classify``, a ``PoolingParams``) generates
    nothing (``finish_reason`` "stop", no tokens, empty text) and returns ``embeddings``: the
    embedding, or the class probabilities (vLLM's ``PoolingOutput.data``); None otherwise.
    """

    request_id: int
    token_ids: list[int]
    text: str
    finish_reason: str
    num_input_tokens: int
    num_generated_tokens: int
    error: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (vLLM's name)
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    embeddings: list[float] | None = None
    timings: RequestTimings = field(default_factory=RequestTimings)
