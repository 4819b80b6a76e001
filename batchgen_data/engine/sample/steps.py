"""The sampler's steps, in their declared order (``SAMPLING_STEPS``).

NOTE: a step runs only when the batch has rows that ask for it (``applies``), so a batch of
plain rows pays for none of them. The order is part of the semantics, as in vLLM's sampler:
  1. ``GrammarMask``     structured outputs: disallowed tokens of constrained rows get -inf
                         (greedy rows that allow few tokens are picked here, with no write);
     (logits processors that change scores — penalties, bias — belong here, after the mask)
  2. ``Sample``          greedy / temperature / top-k / top-p with per-row counter noise;
  3. ``CaptureLogprobs`` the asked rows' logprobs of the logits as the model gave them, masked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from batchgen_data.engine.sample.batch import SamplingBatch
from batchgen_data.engine.sample.bitmask import apply_token_bitmask
from batchgen_data.engine.sample.kernels import sample
from batchgen_data.engine.sample.logprob_capture import token_logprobs
from batchgen_data.engine.sample.logprobs import TokenLogprobs


@dataclass(slots=True)
class SamplingState:
    """What the sampler's steps hand each other within one call."""

    logits: torch.Tensor  # [N, V]; steps before ``Sample`` may change it in place
    tokens: torch.Tensor | None = None  # [N] int64, once sampled
    forced: Any = None  # ``BitmaskPicks``: greedy constrained rows the mask step already chose
    logprobs: list[TokenLogprobs | None] | None = None


class SamplingStep(Protocol):
    """One step of the sampler, run only where ``applies`` says the batch has rows for it."""

    def applies(self, batch: SamplingBatch) -> bool: ...

    def __call__(self, state: SamplingState, batch: SamplingBatch) -> None: ...


class GrammarMask:
    """Structured outputs: each constrained row's grammar bitmask applied to its logits."""

    def applies(self, batch: SamplingBatch) -> bool:
        return batch.token_bitmask is not None

    def __call__(self, state: SamplingState, batch: SamplingBatch) -> None:
        state.forced = apply_token_bitmask(state.logits, batch.token_bitmask, batch.bitmask_rows,
                                           batch.bitmask_greedy)


class Sample:
    """The next token of every row (``sampler.sample``), then the mask step's forced picks."""

    def applies(self, batch: SamplingBatch) -> bool:
        return True

    def __call__(self, state: SamplingState, batch: SamplingBatch) -> None:
        tokens = sample(state.logits, batch)
        picks = state.forced
        if picks is not None:  # greedy rows whose token the mask step chose among few allowed
            tokens[picks.rows.to(tokens.device)] = picks.tokens.to(tokens.device)
        state.tokens = tokens


class CaptureLogprobs:
    """``TokenLogprobs`` for the rows that asked (``SamplingParams.logprobs``)."""

    def applies(self, batch: SamplingBatch) -> bool:
        return batch.logprob_rows is not None

    def __call__(self, state: SamplingState, batch: SamplingBatch) -> None:
        logits, tokens = state.logits, state.tokens
        if len(batch.logprob_rows) == len(batch):  # every row: no [n, V] gather (the logits are done with)
            computed = token_logprobs(logits, tokens, batch.logprob_ks, overwrite=True)
        else:
            rows = torch.tensor(batch.logprob_rows, device=logits.device)
            computed = token_logprobs(logits[rows], tokens[rows], batch.logprob_ks, overwrite=True)
        per_row: list[TokenLogprobs | None] = [None] * len(batch)
        for row, value in zip(batch.logprob_rows, computed):
            per_row[row] = value
        state.logprobs = per_row


SAMPLING_STEPS = (GrammarMask(), Sample(), CaptureLogprobs())
