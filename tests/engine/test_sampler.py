"""Sampling semantics: greedy, top-k, top-p, and counter-based determinism."""

from __future__ import annotations

import pytest
import torch

from batchgen_data.engine.sample.sampler import SamplingBatch, counter_uniform, first_argmax, sample


def _batch(n, temperature=1.0, top_p=1.0, top_k=0, seeds=None, steps=None):
    return SamplingBatch.build([temperature] * n, [top_p] * n, [top_k] * n, seeds or list(range(n)), steps or [0] * n)


def test_counter_uniform_is_deterministic_and_uniform():
    u = counter_uniform(list(range(20000)), [3] * 20000)
    assert ((0 <= u) & (u < 1)).all()
    assert abs(u.mean() - 0.5) < 0.01
    assert (counter_uniform([7, 7], [0, 1]) != counter_uniform([7, 7], [1, 0])).all()
    assert (counter_uniform([7], [5]) == counter_uniform([7], [5])).all()


def test_greedy_rows_take_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 0.0]])
    assert sample(logits, _batch(2, temperature=0.0)).tolist() == [1, 0]


def test_greedy_ties_take_the_first_maximum_as_argmax_does():
    vocab = 32000
    logits = torch.randn(64, vocab)
    logits[:, 20000] = 50.0
    logits[:, 7 * torch.arange(64) + 3] = 50.0  # an earlier tie in every row, at a different index
    logits[5, 40] = float("nan")  # NaN wins, as in argmax
    expected = logits.argmax(dim=-1)
    assert expected[5] == 40 and expected[0] == 3
    assert torch.equal(first_argmax(logits), expected)
    assert torch.equal(sample(logits, _batch(64, temperature=0.0)), expected)


def test_sampling_follows_the_distribution_and_filters():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 20000
    logits = probs.log().expand(n, 4).clone()
    counts = torch.bincount(sample(logits, _batch(n)), minlength=4).float() / n
    assert torch.allclose(counts, probs, atol=0.015)
    top_k = torch.bincount(sample(logits, _batch(n, top_k=2)), minlength=4).float() / n
    assert top_k[2:].sum() == 0 and abs(top_k[0] - 0.5 / 0.8) < 0.015
    top_p = torch.bincount(sample(logits, _batch(n, top_p=0.7)), minlength=4).float() / n
    assert top_p[2:].sum() == 0  # 0.5 + 0.3 reach 0.7; the rest are cut
    tiny_p = torch.bincount(sample(logits, _batch(n, top_p=0.01)), minlength=4)
    assert tiny_p[0] == n  # at least the top token is always kept


def test_row_result_does_not_depend_on_batch_neighbours():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    full = sample(logits, _batch(6, seeds=[11, 12, 13, 14, 15, 16], steps=[4] * 6))
    alone = sample(logits[3:4], _batch(1, seeds=[14], steps=[4]))
    assert full[3] == alone[0]


def test_seeded_samples_survive_tiny_logit_changes():
    # Batch shape and thread count change logits in the last bits; the pick must not move.
    torch.manual_seed(1)
    logits = torch.randn(300, 151936) * 0.5  # a flat, demo-model-like distribution
    batch = _batch(300, temperature=0.8, seeds=list(range(300)), steps=[3] * 300)
    base = sample(logits, batch)
    nudged = sample(logits * (1 + 1e-6) + 1e-6, batch)
    assert torch.equal(base, nudged)


@pytest.mark.parametrize("vocab", [151936, 151937, 5000, 300])
def test_first_argmax_block_search_keeps_argmax_semantics(vocab):
    """Ties pick the first, NaN counts as the maximum, a maximum in a partial last block, rows of
    equal values and of -inf: the same as ``max(dim).indices`` everywhere."""
    from batchgen_data.engine.sample.sampler import first_argmax

    x = torch.randn(16, vocab, generator=torch.Generator().manual_seed(vocab))
    x[3, 100] = x[3].max() + 1
    x[3, 90000 % vocab] = x[3, 100]
    x[5, 7] = float("nan")
    x[5, vocab - 1] = float("nan")
    x[6, vocab - 1] = x[6].max() + 5
    x[7] = 0.0
    x[8] = float("-inf")
    x[8, vocab // 2] = 1.0
    assert torch.equal(first_argmax(x), x.max(dim=-1).indices)


def test_sampler_steps_run_in_their_declared_order_and_only_for_rows_that_ask():
    from batchgen_data.engine.sample.sampler import Sampler
    from batchgen_data.engine.sample.steps import (SAMPLING_STEPS, AllowedTokenIds, BadWords, CaptureLogprobs,
                                                   GrammarMask, KeepRawLogits, LogitBias, MinTokens, Penalties,
                                                   Sample)

    assert [type(s) for s in SAMPLING_STEPS] == [GrammarMask, KeepRawLogits, AllowedTokenIds, BadWords, MinTokens,
                                                 LogitBias, Penalties, Sample, CaptureLogprobs]  # vLLM's order
    ran = []

    class Spy:
        def __init__(self, step):
            self.step = step

        def applies(self, batch):
            return self.step.applies(batch)

        def __call__(self, state, batch):
            ran.append(type(self.step).__name__)
            self.step(state, batch)

    sampler = Sampler(tuple(Spy(s) for s in SAMPLING_STEPS))
    logits = torch.tensor([[0.1, 2.0, 0.3], [1.0, 0.0, 0.5]])
    out = sampler(logits.clone(), SamplingBatch.build([0.0, 0.0], [1.0, 1.0], [0, 0], [1, 2], [0, 0]))
    assert ran == ["Sample"] and out.logprobs is None and out.token_ids.tolist() == [1, 0]
    ran.clear()
    out = sampler(logits.clone(), SamplingBatch.build([0.0, 0.0], [1.0, 1.0], [0, 0], [1, 2], [0, 0], logprobs=[None, 1]))
    assert ran == ["Sample", "CaptureLogprobs"] and out.logprobs[0] is None and out.logprobs[1] is not None
