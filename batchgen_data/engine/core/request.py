"""The plain records a request crosses the executor seam in (no torch; they pickle to ranks).

``NewRequest`` goes in (``Executor.add``: validated, tokenized, numbered and seeded by the engine;
the scheduler builds its own ``Sequence`` record from it) and ``FinishedRequest`` comes out
(``ExecutorStep.finished``: what the engine turns into a ``GenerationOutput``), the same for the
in-process executor and for expert-parallel ranks. In between, executors publish
``RequestProgress`` (``progress.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchgen_data.engine.core.sequence import Sequence
    from batchgen_data.engine.pooling_params import PoolingParams
    from batchgen_data.engine.sample.logprobs import TokenLogprobs
    from batchgen_data.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequest:
    """A validated, tokenized request (the engine tokenizes, assigns ids and seeds)."""

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams  # PoolingParams: a prefill-only (embed, classify) request
    seed: int
    arrival_s: float = 0.0  # the engine's clock


@dataclass(slots=True)
class FinishedRequest:
    """A request's result as its scheduler left it (``finish_reason``: stop, length or error;
    a pooling request's ``pooled_data``: its embedding or class probabilities)."""

    request_id: int
    output_token_ids: list[int]
    finish_reason: str
    error: str | None = None
    stop_text_len: int | None = None  # where a stop string cut the text
    num_cached_tokens: int | None = None  # prompt tokens its first admission found cached
    logprobs: list[TokenLogprobs] | None = None  # one per output token, when asked
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    pooled_data: list[float] | None = None

    @classmethod
    def of(cls, seq: Sequence) -> FinishedRequest:
        """A finished scheduler record, read (by its executor)."""
        return cls(seq.request_id, list(seq.output_token_ids), seq.finish_reason or "error", seq.error,
                   seq.stop_text_len, seq.num_cached_tokens, seq.logprobs, seq.prompt_logprobs, seq.pooled_data)
