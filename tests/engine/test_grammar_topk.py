"""Greedy constrained rows from the chunked LM head (``sample/grammar_topk.py``): the masks
applied chunk by chunk give the whole logits' masked argmax, in the kernel and in the engine,
lazy rows and their misses included."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from batchgen_data import Engine, EngineConfig, SamplingParams
from batchgen_data.engine.sample import grammar_topk
from batchgen_data.engine.structured.manager import StructuredOutputManager
from batchgen_data.engine.worker import model_runner
from batchgen_data.model.lm_head_topk import HeadChoice


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 40), vocab=st.integers(33, 3000), hidden=st.integers(1, 24), k=st.integers(1, 20),
       chunk=st.sampled_from([128, 384, 1024]), density=st.sampled_from([0.0005, 0.01, 0.3, 0.97, 1.0]),
       keep_some=st.booleans(), seed=st.integers(0, 2**16))
@example(rows=9, vocab=129, hidden=5, k=1, chunk=128, density=0.0005, keep_some=False, seed=0)  # a 1-column last chunk
def test_masked_chunks_give_the_masked_argmax(native, rows, vocab, hidden, k, chunk, density, keep_some, seed):
    """Masks from one allowed token in a thousand to all, some rows unmasked, each row keeping
    all k or fewer: each masked row's chosen token and finite top values are those of the whole
    logits with -inf at the disallowed tokens; unmasked rows are untouched; past what a row
    keeps (or allows) its top list is -inf, -1."""
    g = torch.Generator().manual_seed(seed)
    x, head = torch.randn(rows, hidden, generator=g), torch.randn(vocab, hidden, generator=g)
    k = min(k, vocab)
    masked_rows = np.asarray([r for r in range(rows) if r % 3 != 1], dtype=np.int64)
    allowed = torch.rand(len(masked_rows), vocab, generator=g) < density
    allowed[torch.arange(len(masked_rows)), torch.randint(vocab, (len(masked_rows),), generator=g)] = True  # one at least
    padded = torch.zeros(len(masked_rows), 32 * ((vocab + 31) // 32), dtype=torch.bool)
    padded[:, :vocab] = allowed
    bits = padded.view(len(masked_rows), -1, 32).to(torch.int64) << torch.arange(32)
    words = bits.sum(-1).to(torch.int64).numpy().astype(np.uint32).view(np.int32)
    keep = torch.randint(1, k + 1, (rows,), generator=g) if keep_some else torch.full((rows,), k)
    top = native.lm_head_topk(x, head, k, False, chunk, (masked_rows, words), keep.numpy() if keep_some else None)
    logits = F.linear(x, head)
    logits[torch.from_numpy(masked_rows)] = logits[torch.from_numpy(masked_rows)].masked_fill(~allowed, float("-inf"))
    order = torch.sort(logits, dim=-1, descending=True, stable=True)
    assert torch.equal(top.chosen, order.indices[:, 0])
    finite = order.values[:, :k].isfinite() & (torch.arange(k) < keep[:, None])
    assert torch.equal(top.top_ids[~finite], torch.full_like(top.top_ids[~finite], -1))
    assert torch.equal(top.top_values.isfinite(), finite)
    assert torch.equal(top.top_values[finite], order.values[:, :k][finite])
    assert torch.equal(top.top_ids[finite], order.indices[:, :k][finite])


BOUNDED = {"json": {"type": "object", "properties": {"name": {"type": "string", "minLength": 3, "maxLength": 30},
                                                     "note": {"type": "string"}},
                    "required": ["name", "note"], "additionalProperties": False}, "disable_any_whitespace": True}
CONSTRAINTS = [BOUNDED, {"regex": "[a-z ]{20,60}"}, {"regex": "(yes|no|maybe)( (yes|no|maybe)){3,9}"},
               {"choice": ["positive", "negative", "neutral"]}]


class _Recorded:
    """A ``MissLogits`` that records which way each miss's logits were computed."""

    def __init__(self, head, calls: list[str]):
        self.head, self.calls, self.vocab = head, calls, head.vocab

    def whole(self, rows):
        self.calls.append("whole")
        return self.head.whole(rows)

    def at(self, row, tokens):
        self.calls.append("at")
        return self.head.at(row, tokens)


@pytest.mark.parametrize("candidates, gather_share, way", [(grammar_topk.CANDIDATES, grammar_topk.GATHER_SHARE, None),
                                                            (1, 1, "at"), (1, 10**9, "whole")])
def test_a_step_of_many_constrained_greedy_rows_takes_the_whole_logits_tokens(tiny_checkpoint, monkeypatch, candidates,
                                                                              gather_share, way):
    """40 greedy rows (more than the skinny GEMM serves), constrained and plain, lazy and
    filled: the chunked head with the masks gives the tokens of the whole logits. With one
    candidate most lazy picks miss: their logits are then computed at the allowed tokens alone
    (every miss, with ``GATHER_SHARE`` 1) or whole (with no miss sparse enough)."""
    folder, _ = tiny_checkpoint("qwen3_moe")
    prompts = [f"Review {i}: the food was {w}." for i, w in enumerate(["great", "cold", "fine", "late", "odd"] * 8)]
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                             structured_outputs=CONSTRAINTS[i % 5] if i % 5 < 4 else None) for i in range(len(prompts))]
    used, calls = [], []
    real_topk, real_tokens = model_runner.lm_head_topk, grammar_topk.grammar_tokens

    def spy_topk(*args):
        used.append(real_topk(*args))
        return used[-1]

    monkeypatch.setattr(grammar_topk, "CANDIDATES", candidates)
    monkeypatch.setattr(grammar_topk, "GATHER_SHARE", gather_share)
    with Engine(folder, EngineConfig(block_size=8, max_num_seqs=64)) as engine:
        runner, structured = engine.executor.runner, engine.executor.structured
        runner.head_choice = HeadChoice(enabled=False)
        whole = engine.generate(prompts, params)
        runner.head_choice = HeadChoice(chosen={(b, kind): True for b in range(9) for kind in range(3)})
        monkeypatch.setattr(model_runner, "lm_head_topk", spy_topk)
        monkeypatch.setattr(grammar_topk, "grammar_tokens",
                            lambda top, batch, head: real_tokens(top, batch, _Recorded(head, calls)))
        picks = structured.lazy_picks
        chunked = engine.generate(prompts, params)
    assert any(top is not None for top in used)  # the chunked head served constrained steps
    assert structured.lazy_picks > picks  # lazy rows picked from its candidates
    if way is not None:
        assert way in calls and set(calls) == {way}  # and missed, their logits computed that way
    assert [(o.token_ids, o.finish_reason, o.error) for o in chunked] == [(o.token_ids, o.finish_reason, o.error) for o in whole]
    assert all(o.error is None for o in chunked)


class _FixedLogits:
    def __init__(self, logits: torch.Tensor):
        self.logits, self.vocab = logits, logits.shape[1]

    def whole(self, rows):
        raise AssertionError("a sparse pick computes no whole logits")

    def at(self, row, tokens):
        return self.logits[row, tokens]


@settings(max_examples=60, deadline=None)
@given(vocab=st.integers(1, 700), allowed=st.integers(0, 60), levels=st.integers(1, 6), nan=st.booleans(),
       seed=st.integers(0, 2**16))
def test_a_sparse_miss_takes_the_masked_first_maximum(vocab, allowed, levels, nan, seed):
    """A miss's token from its allowed tokens' logits alone is the first maximum of the logits
    with -inf at the disallowed tokens (ties from few distinct values; a NaN is the maximum);
    a mask allowing none, or more than V / GATHER_SHARE, is left to the whole logits."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(levels, (1, vocab), generator=g).float()
    if nan:
        logits[0, int(torch.randint(vocab, (1,), generator=g))] = float("nan")
    ids = torch.randperm(vocab, generator=g)[: min(allowed, vocab)]
    bits = torch.zeros(32 * ((vocab + 31) // 32), dtype=torch.int64)
    bits[ids] = 1
    words = (bits.view(-1, 32) << torch.arange(32)).sum(-1).numpy().astype(np.uint32).view(np.int32)
    token = grammar_topk._sparse_pick(_FixedLogits(logits), 0, words)
    if len(ids) == 0 or (len(ids) > 1 and len(ids) > vocab // grammar_topk.GATHER_SHARE):
        assert token is None
        return
    masked = torch.full_like(logits, float("-inf"))
    masked[0, ids] = logits[0, ids]
    assert token == int(masked.argmax(dim=-1)[0])


def test_without_lazy_rows_every_constrained_row_is_masked_in_the_chunks(tiny_checkpoint, monkeypatch):
    monkeypatch.setattr(StructuredOutputManager, "lazy_greedy", False)
    folder, _ = tiny_checkpoint("qwen3_moe")
    prompts = [f"Row {i}: rate it." for i in range(36)]
    params = SamplingParams(max_tokens=12, temperature=0, structured_outputs=CONSTRAINTS[2])
    with Engine(folder, EngineConfig(block_size=8, max_num_seqs=64)) as engine:
        engine.executor.runner.head_choice = HeadChoice(enabled=False)
        whole = engine.generate(prompts, params)
        engine.executor.runner.head_choice = HeadChoice(chosen={(b, kind): True for b in range(9) for kind in range(3)})
        chunked = engine.generate(prompts, params)
    assert [o.token_ids for o in chunked] == [o.token_ids for o in whole]
