"""The grammar-bitmask kernel against its token-by-token definition, and the sampler around it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen_data.engine.sample.sampler import Sampler, SamplingBatch, first_argmax
from batchgen_data.engine.sample.bitmask import (
    _unpack_disallowed_cpu,
    _unpack_disallowed_device,
    apply_token_bitmask,
    reference_masked,
)

VOCAB = 300  # not a multiple of 32: the last word has padding bits


@pytest.fixture(params=["numpy", "native"])
def kernel(request):
    """Each test runs on both CPU paths: numpy and torch, and the native kernel."""
    from batchgen_data.model.native import _ACTIVE, load_native, use_native_kernels

    if request.param == "native" and load_native() is None:
        pytest.skip("the native kernels cannot be built here")
    was = _ACTIVE["on"]
    use_native_kernels(request.param == "native")
    try:
        yield request.param
    finally:
        use_native_kernels(was)


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
def test_kernel_matches_definition(kernel, greedy):
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


def test_greedy_pick_takes_the_first_maximum_among_allowed(kernel):
    logits = torch.zeros(1, VOCAB)
    logits[0, [5, 40, 41]] = 3.0  # tied maximum; 5 is disallowed
    mask = np.zeros((1, (VOCAB + 31) // 32), np.int32)
    mask[0, 1] = (1 << 8) | (1 << 9) | (1 << 10)  # tokens 40, 41, 42
    picks = apply_token_bitmask(logits, mask, [0], [True])
    assert picks.tokens.tolist() == [40]


def test_sampler_samples_only_allowed_tokens(kernel):
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


@settings(max_examples=60, deadline=None)
@given(vocab=st.integers(1, 200), seed=st.integers(0, 2**31 - 1), density=st.sampled_from([0.0, 0.02, 0.5, 0.98, 1.0]),
       specials=st.lists(st.sampled_from(["nan", "-inf", "inf", "tie"]), max_size=3))
def test_native_kernel_matches_the_definition_on_generated_rows(vocab, seed, density, specials):
    """Any vocabulary size (padding bits), density, NaN, infinities and ties: a greedy row's pick
    is the first maximum over its allowed tokens (NaN first, as argmax) and the row is not
    written; every other row equals its masked row exactly; rows outside ``rows`` are untouched."""
    from batchgen_data.model.native import load_native

    native = load_native()
    if native is None:
        pytest.skip("the native kernels cannot be built here")
    rng = np.random.default_rng(seed)
    n_rows = 6
    logits = torch.from_numpy(rng.standard_normal((n_rows, vocab)).astype(np.float32))
    for special in specials:
        row, col = int(rng.integers(n_rows)), int(rng.integers(vocab))
        logits[row, col] = logits[row].max() if special == "tie" else float(special)
    rows = [r for r in range(n_rows) if rng.random() < 0.8] or [0]
    words = (vocab + 31) // 32
    bits = rng.random((len(rows), words * 32)) < density
    bits[:, vocab:] = rng.random((len(rows), words * 32 - vocab)) < 0.5  # padding bits: ignored either way
    mask = np.packbits(bits.astype(np.uint8), axis=1, bitorder="little").view(np.int32)
    greedy = rng.random(len(rows)) < 0.5
    expected = reference_masked(logits, mask, rows)
    out = logits.clone()
    picks = native.grammar_mask(out, np.array(rows), mask, greedy)
    same = lambda a, b: torch.equal(a.nan_to_num(nan=7.0), b.nan_to_num(nan=7.0))  # noqa: E731
    for i, row in enumerate(rows):
        allowed = np.flatnonzero(bits[i, :vocab])
        if greedy[i] and len(allowed):
            values = logits[row, torch.from_numpy(allowed)]
            nans = torch.isnan(values).nonzero()
            first = int(nans[0]) if len(nans) else int((values == values.max()).nonzero()[0])
            assert picks[i] == allowed[first]
            assert same(out[row], logits[row]), "a picked greedy row is not written"
        else:
            assert picks[i] == -1
            assert same(out[row], expected[row]), row
    untouched = [r for r in range(n_rows) if r not in rows]
    assert same(out[untouched], logits[untouched])
