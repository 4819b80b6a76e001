"""Vectorised sampling: greedy, temperature, top-k, top-p, with per-row seeds.

Randomness is counter-based: each row's noise comes from a generator seeded with a hash of
(seed, tokens generated so far), so a request's tokens do not depend on what else shares the
batch, on how many requests are in flight, or on whether it was suspended and recomputed.
Sampling is Gumbel-max (argmax of logits / T plus Gumbel noise): unlike an inverse CDF over a
150k-token vocabulary, whose bucket edges move with the last bits of the logits, it only changes
its pick when two perturbed scores tie to within float error, so the same seed gives the same
tokens even when a different thread count or batch shape changes the logits by 1e-6.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen_data.engine.sample.batch import SamplingBatch
from batchgen_data.engine.sample import grammar_topk
from batchgen_data.engine.sample.kernels import counter_uniform, first_argmax, sample
from batchgen_data.engine.sample.logprob_capture import logprob_entries
from batchgen_data.engine.sample.logprobs import TokenLogprobs
from batchgen_data.engine.sample.steps import SAMPLING_STEPS, SamplingState, SamplingStep
from batchgen_data.model.lm_head_topk import GRAMMAR, LOGPROBS, PLAIN

__all__ = ["Sampler", "SamplerOutput", "SamplingBatch", "SamplingState", "SamplingStep", "counter_uniform",
           "first_argmax", "sample"]



@dataclass(slots=True)
class SamplerOutput:
    """The sampled tokens, and for the rows that asked, their ``TokenLogprobs`` (else None)."""

    token_ids: torch.Tensor  # [N] int64
    logprobs: list[TokenLogprobs | None] | None = None


class Sampler:
    """``logits -> SamplerOutput``: its steps (``steps.py``), in their declared order, each on
    the rows that ask for it: the grammar bitmasks of the constrained rows (structured outputs),
    then vLLM's logits processors and penalties (allowed tokens, bad words, min_tokens,
    logit_bias, repetition / frequency / presence), then ``sample`` — greedy, temperature, min-p,
    top-k, top-p and seeded sampling all pick from the processed distribution — then logprob
    capture, from the model's logits (masked by the grammar), before processors, temperature and
    top-k/top-p.

    Example:
        >>> import torch
        >>> batch = SamplingBatch.build([0.0], [1.0], [0], [7], [0])
        >>> Sampler()(torch.tensor([[0.1, 2.0, 0.3]]), batch).token_ids.tolist()
        [1]
    """

    def __init__(self, steps: tuple[SamplingStep, ...] | None = None):
        self.steps = SAMPLING_STEPS if steps is None else steps

    @staticmethod
    def greedy_topk(batch: SamplingBatch) -> tuple[int, int] | None:
        """(k, kind) where the batch's tokens and logprobs need only each row's first maximum
        (over its grammar's tokens), its top k and, for ``LOGPROBS``, its log sum exp
        (``LogitTopK``): every row greedy, no processor, and either no row or every row asking
        for logprobs, with no grammar; or, ``GRAMMAR``, constrained rows and no logprobs
        (``grammar_topk.py``). Else None (the logits go through the steps)."""
        if not batch.all_greedy or batch.processors is not None:
            return None
        if batch.token_bitmask is not None:  # lazy rows need their candidates, masked rows their first
            if batch.logprob_rows is not None:
                return None
            return (grammar_topk.CANDIDATES if batch.bitmask_lazy is not None else 1), GRAMMAR
        if batch.logprob_rows is None:
            return 1, PLAIN
        if len(batch.logprob_rows) == len(batch):
            return max(1, max(batch.logprob_ks)), LOGPROBS
        return None

    @staticmethod
    def from_topk(top, batch: SamplingBatch, head: grammar_topk.MissLogits | None = None) -> SamplerOutput:
        """What ``__call__`` gives for a ``greedy_topk`` batch, from the ``LogitTopK`` of its
        logits (the filled grammar masks applied); ``head``: the logits of constrained rows
        that need them (``grammar_topk.grammar_tokens``)."""
        if batch.token_bitmask is not None:
            return SamplerOutput(grammar_topk.grammar_tokens(top, batch, head))
        logprobs = None if batch.logprob_rows is None else logprob_entries(top, batch.logprob_ks)
        return SamplerOutput(top.chosen, logprobs)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        state = SamplingState(logits)
        for step in self.steps:
            if step.applies(batch):
                step(state, batch)
        return SamplerOutput(state.tokens, state.logprobs)
