"""The grammar-bitmask kernel against its token-by-token definition, and the sampler around it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchgen_data.engine.sample.sampler import Sampler, SamplingBatch, first_argmax
from batchgen_data.engine.sample.bitmask import (
    _unpack_disallowed_cpu,
    _unpack_disallowed_device,
    apply_token_bitmask,
    reference_masked,
)

VOCAB = 300  # not a multiple of 32: the last word has padding bits


def _masks(rng: np.random.Generator, num: int) -> np.ndarray:
    """Rows of every kind the kernel branches on: almost all allowed, a few, none, one, half."""
    words = (VOCAB + 31) // 32
    masks = []
    for i in range(num):
        kind = i % 5
        if kind == 0:
            row = np.full(words, -1, np.int64)
            row[rng.integers(0, words, 3)] &= ~(1 << rng.integers(0, 32, 3))
        elif kind == 1:
            row = np.zeros(words, np.int64)
            row[rng.integers(0, words, 2)] |= 1 << rng.integers(0, 32, 2)
        elif kind == 2:
            row = np.zeros(words, np.int64)
            row[words - 1] = 1 << ((VOCAB - 1) % 32)  # only the last real token
        elif kind == 3:
            row = rng.integers(0, 2**32, words)
        else:
            row = np.zeros(words, np.int64)
            row[0] = 1  # only token 0
        masks.append(row.astype(np.uint32).view(np.int32))
    return np.stack(masks)


@pytest.mark.parametrize("greedy", [True, False])
def test_kernel_matches_definition(greedy):
    rng = np.random.default_rng(0)
    logits = torch.randn(12, VOCAB)
    rows = [0, 2, 3, 5, 6, 7, 8, 9, 11, 1]
    mask = _masks(rng, len(rows))
    expected = reference_masked(logits, mask, rows)
    out = logits.clone()
    picks = apply_token_bitmask(out, mask, rows, [greedy] * len(rows))
    tokens = first_argmax(out)
    if picks is not None:
        tokens[picks.rows] = picks.tokens
    assert torch.equal(tokens, first_argmax(expected))
    picked = set() if picks is None else set(picks.rows.tolist())
    for row in range(12):
        if row not in picked:  # rows the kernel wrote hold exactly the masked logits
            assert torch.equal(out[row], expected[row]), row
    assert greedy == bool(picked)
    untouched = [r for r in range(12) if r not in rows]
    assert torch.equal(out[untouched], logits[untouched])


def test_greedy_pick_takes_the_first_maximum_among_allowed():
    logits = torch.zeros(1, VOCAB)
    logits[0, [5, 40, 41]] = 3.0  # tied maximum; 5 is disallowed
    mask = np.zeros((1, (VOCAB + 31) // 32), np.int32)
    mask[0, 1] = (1 << 8) | (1 << 9) | (1 << 10)  # tokens 40, 41, 42
    picks = apply_token_bitmask(logits, mask, [0], [True])
    assert picks.tokens.tolist() == [40]


def test_sampler_samples_only_allowed_tokens():
    rng = np.random.default_rng(1)
    n = 10
    mask = _masks(rng, n)
    allowed = reference_masked(torch.zeros(n, VOCAB), mask, list(range(n))) == 0
    for step in range(20):
        batch = SamplingBatch.build([0.0, 1.0] * (n // 2), [1.0, 0.8] * (n // 2), [0, 5] * (n // 2),
                                    list(range(n)), [step] * n, bitmask_rows=list(range(n)), token_bitmask=mask)
        tokens = Sampler()(torch.randn(n, VOCAB), batch).token_ids
        assert all(allowed[i, t] for i, t in enumerate(tokens.tolist()))


def test_device_unpacking_matches_the_cpu_one():
    """The CUDA path's shift-based unpacking (run here on CPU tensors) equals numpy's."""
    mask = _masks(np.random.default_rng(2), 7)
    assert torch.equal(_unpack_disallowed_device(torch.from_numpy(mask)), _unpack_disallowed_cpu(mask))
