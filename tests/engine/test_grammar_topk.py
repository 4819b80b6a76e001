"""Greedy constrained rows from the chunked LM head (``sample/grammar_topk.py``): the masks
applied chunk by chunk give the whole logits' masked argmax, in the kernel and in the engine,
lazy rows and their misses included."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen_data import Engine, EngineConfig, SamplingParams
from batchgen_data.engine.sample import grammar_topk
from batchgen_data.engine.structured.manager import StructuredOutputManager
from batchgen_data.engine.worker import model_runner
from batchgen_data.model.lm_head_topk import HeadChoice


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 40), vocab=st.integers(33, 3000), hidden=st.integers(1, 24), k=st.integers(1, 20),
       chunk=st.sampled_from([128, 384, 1024]), density=st.sampled_from([0.0005, 0.01, 0.3, 0.97]),
       seed=st.integers(0, 2**16))
def test_masked_chunks_give_the_masked_argmax(native, rows, vocab, hidden, k, chunk, density, seed):
    """Masks from one allowed token in a thousand to nearly all, some rows unmasked: each masked
    row's chosen token and finite top values are those of the whole logits with -inf at the
    disallowed tokens; unmasked rows are untouched."""
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
    top = native.lm_head_topk(x, head, k, False, chunk, (masked_rows, words))
    logits = F.linear(x, head)
    logits[torch.from_numpy(masked_rows)] = logits[torch.from_numpy(masked_rows)].masked_fill(~allowed, float("-inf"))
    order = torch.sort(logits, dim=-1, descending=True, stable=True)
    assert torch.equal(top.chosen, order.indices[:, 0])
    finite = order.values[:, :k].isfinite()
    assert torch.equal(top.top_values.isfinite(), finite)
    assert torch.equal(top.top_values[finite], order.values[:, :k][finite])
    assert torch.equal(top.top_ids[finite], order.indices[:, :k][finite])


BOUNDED = {"json": {"type": "object", "properties": {"name": {"type": "string", "minLength": 3, "maxLength": 30},
                                                     "note": {"type": "string"}},
                    "required": ["name", "note"], "additionalProperties": False}, "disable_any_whitespace": True}
CONSTRAINTS = [BOUNDED, {"regex": "[a-z ]{20,60}"}, {"regex": "(yes|no|maybe)( (yes|no|maybe)){3,9}"},
               {"choice": ["positive", "negative", "neutral"]}]


@pytest.mark.parametrize("candidates", [grammar_topk.CANDIDATES, 1])
def test_a_step_of_many_constrained_greedy_rows_takes_the_whole_logits_tokens(tiny_checkpoint, monkeypatch, candidates):
    """40 greedy rows (more than the skinny GEMM serves), constrained and plain, lazy and
    filled: the chunked head with the masks gives the tokens of the whole logits. With one
    candidate most lazy picks miss, so the misses' second pass over the LM head runs too."""
    folder, _ = tiny_checkpoint("qwen3_moe")
    prompts = [f"Review {i}: the food was {w}." for i, w in enumerate(["great", "cold", "fine", "late", "odd"] * 8)]
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                             structured_outputs=CONSTRAINTS[i % 5] if i % 5 < 4 else None) for i in range(len(prompts))]
    used, recomputed = [], []
    real_topk, real_tokens = model_runner.lm_head_topk, grammar_topk.grammar_tokens

    def spy_topk(*args):
        used.append(real_topk(*args))
        return used[-1]

    def spy_tokens(top, batch, logits_of):
        return real_tokens(top, batch, lambda rows: recomputed.append(len(rows)) or logits_of(rows))

    monkeypatch.setattr(grammar_topk, "CANDIDATES", candidates)
    with Engine(folder, EngineConfig(block_size=8, max_num_seqs=64)) as engine:
        runner, structured = engine.executor.runner, engine.executor.structured
        runner.head_choice = HeadChoice(enabled=False)
        whole = engine.generate(prompts, params)
        runner.head_choice = HeadChoice(chosen={(b, kind): True for b in range(9) for kind in range(3)})
        monkeypatch.setattr(model_runner, "lm_head_topk", spy_topk)
        monkeypatch.setattr(grammar_topk, "grammar_tokens", spy_tokens)
        picks = structured.lazy_picks
        chunked = engine.generate(prompts, params)
    assert any(top is not None for top in used)  # the chunked head served constrained steps
    assert structured.lazy_picks > picks  # lazy rows picked from its candidates
    if candidates == 1:
        assert recomputed  # and missed
    assert [(o.token_ids, o.finish_reason, o.error) for o in chunked] == [(o.token_ids, o.finish_reason, o.error) for o in whole]
    assert all(o.error is None for o in chunked)


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
