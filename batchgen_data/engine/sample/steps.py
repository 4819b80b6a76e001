"""The sampler's steps, in their declared order (``SAMPLING_STEPS``).

NOTE: a step runs only when the batch has rows that ask for it (``applies``), so a batch of
plain rows pays for none of them. The order is part of the semantics, as in vLLM's sampler:
  1. ``GrammarMask``     structured outputs: disallowed tokens of constrained rows get -inf
                         (greedy rows that allow few tokens are picked here, with no write,
                         and so are greedy rows whose argmax their grammar allows: their
                         masks are filled only if it does not, ``structured/lazy.py``);
                         vLLM applies the grammar's bitmask before its sampler, too;
  2. ``KeepRawLogits``   logprob rows a processor below changes: a copy of their logits now
                         (vLLM's ``raw_logprobs``: before processors and penalties);
  3. ``AllowedTokenIds`` every token but the row's ``allowed_token_ids`` gets -inf;
  4. ``BadWords``        the last token of a bad word the output's tail would complete: -inf;
  5. ``MinTokens``       stop and end-of-sequence tokens, while ``min_tokens`` is not reached;
  6. ``LogitBias``       ``logit_bias`` added;
  7. ``Penalties``       repetition (prompt and output), frequency and presence (output);
  8. ``Sample``          greedy on these logits, or temperature / min-p / top-k / top-p with
                         per-row counter noise (``kernels.sample``);
  9. ``CaptureLogprobs`` the asked rows' logprobs of the logits as the model gave them, masked.
Steps 3-7 write only the (row, token) pairs their rows ask for (``processors.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from batchgen_data.engine.sample.batch import SamplingBatch
from batchgen_data.engine.sample.bitmask import apply_token_bitmask, merge_picks, pick_lazily
from batchgen_data.engine.sample.kernels import sample
from batchgen_data.engine.sample.logprob_capture import logit_topk, token_logprobs, top_k_of
from batchgen_data.engine.sample.logprobs import TokenLogprobs
from batchgen_data.engine.sample.penalties import apply_penalties
from batchgen_data.model.native.kernels import LogitTopK


@dataclass(slots=True)
class SamplingState:
    """What the sampler's steps hand each other within one call."""

    logits: torch.Tensor  # [N, V]; steps before ``Sample`` may change it in place
    tokens: torch.Tensor | None = None  # [N] int64, once sampled
    forced: Any = None  # ``BitmaskPicks``: greedy constrained rows the mask step already chose
    logprobs: list[TokenLogprobs | None] | None = None
    raw_logits: torch.Tensor | None = None  # [r, V]: ``batch.raw_logprob_rows`` before the processors
    top: LogitTopK | None = None  # of ``logits``, when ``Sample`` took the greedy tokens from it


class SamplingStep(Protocol):
    """One step of the sampler, run only where ``applies`` says the batch has rows for it."""

    def applies(self, batch: SamplingBatch) -> bool: ...

    def __call__(self, state: SamplingState, batch: SamplingBatch) -> None: ...


class GrammarMask:
    """Structured outputs: each constrained row's grammar bitmask applied to its logits."""

    def applies(self, batch: SamplingBatch) -> bool:
        return batch.token_bitmask is not None

    def __call__(self, state: SamplingState, batch: SamplingBatch) -> None:
        rows, words, greedy = batch.bitmask_rows, batch.token_bitmask, batch.bitmask_greedy
        lazy_picks = None
        if batch.bitmask_lazy is not None:  # greedy rows picked from their argmax, or filled now
            keep, lazy_picks = pick_lazily(state.logits, words, rows, greedy, batch.bitmask_lazy)
            if len(keep) < len(rows):
                rows, words = [rows[i] for i in keep], words[keep]
                greedy = None if greedy is None else [greedy[i] for i in keep]
        forced = apply_token_bitmask(state.logits, words, rows, greedy) if rows else None
        state.forced = merge_picks(forced, lazy_picks)


class KeepRawLogits:
    """The logits, now, of the logprob rows a processor below changes (their logprobs stay the
    model's distribution)."""

    def applies(self, batch: SamplingBatch) -> bool:
        return batch.raw_logprob_rows is not None

    def __call__(self, state: SamplingState, batch: SamplingBatch) -> None:
        state.raw_logits = state.logits[torch.tensor(batch.raw_logprob_rows, device=state.logits.device)]


class AllowedTokenIds:
    """Only the row's ``allowed_token_ids`` keep their logits."""

    def applies(self, batch: SamplingBatch) -> bool:
        return batch.processors is not None and bool(batch.processors.allowed_rows)

    def __call__(self, state: SamplingState, batch: SamplingBatch) -> None:
        logits, processors = state.logits, batch.processors
        for row, token_ids in zip(processors.allowed_rows, processors.allowed_token_ids):
            index = torch.tensor(token_ids, device=logits.device)
            kept = logits[row].index_select(0, index)
            logits[row].fill_(float("-inf")).index_copy_(0, index, kept)


class BadWords:
    """-inf at the last token of each bad word the output's tail would complete."""

    def applies(self, batch: SamplingBatch) -> bool:
        return batch.processors is not None and bool(batch.processors.bad_word_rows)

    def __call__(self, state: SamplingState, batch: SamplingBatch) -> None:
        _set_minus_inf(state.logits, batch.processors.bad_word_rows, batch.processors.bad_word_tokens)


class MinTokens:
    """-inf at the stop and end-of-sequence tokens of rows short of their ``min_tokens``."""

    def applies(self, batch: SamplingBatch) -> bool:
        return batch.processors is not None and bool(batch.processors.min_tokens_rows)

    def __call__(self, state: SamplingState, batch: SamplingBatch) -> None:
        _set_minus_inf(state.logits, batch.processors.min_tokens_rows, batch.processors.min_tokens_tokens)


class LogitBias:
    """Each row's ``logit_bias`` added to its tokens' logits."""

    def applies(self, batch: SamplingBatch) -> bool:
        return batch.processors is not None and bool(batch.processors.bias_rows)

    def __call__(self, state: SamplingState, batch: SamplingBatch) -> None:
        processors, device = batch.processors, state.logits.device
        index = (torch.tensor(processors.bias_rows, device=device), torch.tensor(processors.bias_tokens, device=device))
        state.logits[index] += torch.tensor(processors.bias_values, dtype=torch.float32, device=device)


class Penalties:
    """Repetition, frequency and presence penalties (``penalties.py``)."""

    def applies(self, batch: SamplingBatch) -> bool:
        return batch.processors is not None and batch.processors.penalties is not None

    def __call__(self, state: SamplingState, batch: SamplingBatch) -> None:
        apply_penalties(state.logits, batch.processors.penalties)


def _set_minus_inf(logits: torch.Tensor, rows: list[int], tokens: list[int]) -> None:
    index = (torch.tensor(rows, device=logits.device), torch.tensor(tokens, device=logits.device))
    logits.index_put_(index, torch.tensor(float("-inf"), device=logits.device))


class Sample:
    """The next token of every row (``sampler.sample``), then the mask step's forced picks."""

    def applies(self, batch: SamplingBatch) -> bool:
        return True

    def __call__(self, state: SamplingState, batch: SamplingBatch) -> None:
        picks = state.forced
        if picks is None and _greedy_logprob_batch(batch):  # one read of each row serves both
            state.top = logit_topk(state.logits, top_k_of(batch.logprob_ks, state.logits.shape[1]))
            if state.top is not None:
                state.tokens = state.top.chosen  # each row's first maximum
                return
        if picks is None:
            tokens = sample(state.logits, batch)
        else:  # greedy rows whose token the mask step chose: no argmax over them again
            rows = picks.rows.to(state.logits.device)
            tokens = sample(state.logits, batch, chosen=rows)
            tokens[rows] = picks.tokens.to(tokens.device)
        state.tokens = tokens


def _greedy_logprob_batch(batch: SamplingBatch) -> bool:
    """Every row greedy and asking for logprobs of the logits it samples from (no processor
    changed them): the argmax and the capture can share one read of each row."""
    return (batch.all_greedy and batch.logprob_rows is not None and len(batch.logprob_rows) == len(batch)
            and batch.raw_logprob_rows is None)


class CaptureLogprobs:
    """``TokenLogprobs`` for the rows that asked (``SamplingParams.logprobs``)."""

    def applies(self, batch: SamplingBatch) -> bool:
        return batch.logprob_rows is not None

    def __call__(self, state: SamplingState, batch: SamplingBatch) -> None:
        logits, tokens = state.logits, state.tokens
        if state.raw_logits is not None:  # the token is chosen: processed rows get their model logits back
            logits[torch.tensor(batch.raw_logprob_rows, device=logits.device)] = state.raw_logits
        if len(batch.logprob_rows) == len(batch):  # every row: no [n, V] gather (the logits are done with)
            computed = token_logprobs(logits, tokens, batch.logprob_ks, overwrite=True, top=state.top)
        else:
            rows = torch.tensor(batch.logprob_rows, device=logits.device)
            computed = token_logprobs(logits[rows], tokens[rows], batch.logprob_ks, overwrite=True)
        per_row: list[TokenLogprobs | None] = [None] * len(batch)
        for row, value in zip(batch.logprob_rows, computed):
            per_row[row] = value
        state.logprobs = per_row


SAMPLING_STEPS = (GrammarMask(), KeepRawLogits(), AllowedTokenIds(), BadWords(), MinTokens(), LogitBias(),
                  Penalties(), Sample(), CaptureLogprobs())
