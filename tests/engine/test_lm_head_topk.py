"""Greedy tokens and their logprob statistics from the LM head a vocabulary chunk at a time
(``model/lm_head_topk.py``): the same as from the whole logits, in the kernel and in the engine."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen_data import Engine, EngineConfig, SamplingParams
from batchgen_data.engine.worker import model_runner
from batchgen_data.model.lm_head_topk import LOGPROBS, PLAIN, HeadChoice


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 70), vocab=st.integers(1, 3000), hidden=st.integers(1, 40), k=st.integers(1, 21),
       chunk=st.sampled_from([128, 384, 1024]), ties=st.booleans(), with_norm=st.booleans(), seed=st.integers(0, 2**16))
def test_chunked_statistics_equal_the_whole_logits(native, rows, vocab, hidden, k, chunk, ties, with_norm, seed):
    """Chunks that end inside a 128-token block and a vocabulary whose tail is shorter than one;
    many equal logits (first maximum, ties counted in the rank)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g)
    head = torch.randn(vocab, hidden, generator=g)
    if ties:
        x, head = x.round(), head.round().clamp(-1, 1)
    k = min(k, vocab)
    top = native.lm_head_topk(x, head, k, with_norm, chunk)
    logits = F.linear(x, head)
    order = torch.sort(logits, dim=-1, descending=True, stable=True)
    assert torch.equal(top.top_ids, order.indices[:, :k]) and torch.equal(top.top_values, order.values[:, :k])
    first_max = (logits == logits.amax(dim=-1, keepdim=True)).int().argmax(dim=-1)
    assert torch.equal(top.chosen, first_max)
    assert torch.equal(top.rank, (logits >= logits.amax(dim=-1, keepdim=True)).sum(dim=-1))
    if with_norm:
        torch.testing.assert_close(top.log_norm, torch.logsumexp(logits.double(), dim=-1).float(), rtol=2e-5, atol=2e-5)


def test_a_row_holding_nan_or_inf_takes_the_whole_logits(native):
    head = torch.randn(500, 8)
    for bad in (float("nan"), float("inf")):
        x = torch.randn(4, 8)
        x[2, 3] = bad
        assert native.lm_head_topk(x, head, 3, True, 128) is None
    assert native.lm_head_topk(torch.randn(4, 8), head, 3, True, 128) is not None


def test_a_step_of_many_greedy_rows_takes_the_same_tokens_without_its_logits(tiny_checkpoint, monkeypatch):
    """More rows than the native skinny GEMM serves: with and without logprobs, the streamed
    statistics give the tokens the whole logits give, and the logprobs match transformers."""
    folder, hf = tiny_checkpoint("qwen3_moe")
    prompts = [[3 + i, 40 + 2 * i, 7, 100 + i] for i in range(40)]
    used = []
    real = model_runner.lm_head_topk

    def spy(*args):
        used.append(real(*args))
        return used[-1]

    plain = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    with_logprobs = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=3)
    with Engine(folder, EngineConfig(block_size=8, max_num_seqs=64)) as engine:
        engine.executor.runner.head_choice = HeadChoice()  # times both ways (none kept from earlier runs)
        monkeypatch.setattr(model_runner, "lm_head_topk", lambda *args: None)
        expected = engine.generate(prompts, plain)
        monkeypatch.setattr(model_runner, "lm_head_topk", spy)
        streamed = engine.generate(prompts, plain)
        assert any(top is not None for top in used)
        used.clear()
        logged = engine.generate(prompts, with_logprobs)
        assert any(top is not None and not top.log_norm.isnan().any() for top in used)
    assert [o.token_ids for o in streamed] == [o.token_ids for o in expected]
    assert [o.token_ids for o in logged] == [o.token_ids for o in expected]
    for prompt, out in zip(prompts, logged):
        with torch.no_grad():
            reference = torch.log_softmax(hf(torch.tensor([prompt + out.token_ids])).logits[0].float(), dim=-1)
        for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            row = reference[len(prompt) - 1 + i]
            assert abs(entry[token].logprob - row[token].item()) < 2e-4
            assert entry[token].rank == int((row >= row[token]).sum())
            assert list(entry)[1:] == [t for t in row.topk(3).indices.tolist() if t != token][: len(entry) - 1]


def test_the_head_choice_times_both_ways_then_keeps_the_faster_per_size():
    from batchgen_data.model.lm_head_topk import TRIALS

    choice = HeadChoice()
    costs = {(40, True): 2.0, (40, False): 1.0, (60, True): 1.0, (60, False): 3.0, (50, True): 0.99,
             (50, False): 1.0}
    seen = []
    for _ in range(2 * TRIALS + 2):
        for rows in (40, 50, 60):
            chunked = choice.chunked(rows, PLAIN)
            seen.append((rows, chunked))
            choice.record(rows, PLAIN, chunked, costs[(rows, chunked)])
    timed = 2 * TRIALS * 3
    assert seen[:6] == [(40, True), (50, True), (60, True), (40, False), (50, False), (60, False)]  # alternating
    assert {chunked for rows, chunked in seen[timed:] if rows == 40} == {False}
    assert {chunked for rows, chunked in seen[timed:] if rows == 50} == {False}  # 1% faster: within noise
    assert {chunked for rows, chunked in seen[timed:] if rows == 60} == {True}
    assert choice.chunked(41, PLAIN) is False and choice.chunked(41, LOGPROBS) is True  # same bucket; not timed with norm


def test_the_head_choice_is_kept_for_the_next_engine_on_the_machine(tmp_path, monkeypatch):
    import batchgen_data.model.lm_head_topk as module

    monkeypatch.setattr(module, "cache_dir", lambda: tmp_path)
    head = torch.empty(1000, 16)
    first = HeadChoice.for_head(head)
    from batchgen_data.model.lm_head_topk import TRIALS

    for _ in range(TRIALS):
        first.record(60, LOGPROBS, True, 1.0)
        first.record(60, LOGPROBS, False, 2.0)
    assert first.chosen == {(7, LOGPROBS): True}
    again = HeadChoice.for_head(head)
    assert again.chosen == {(7, LOGPROBS): True} and again.chunked(63, LOGPROBS) is True
    assert HeadChoice.for_head(torch.empty(1000, 32)).chosen == {}  # another head shape: timed anew
    assert HeadChoice.for_head(None).chunked(60, LOGPROBS) is False  # no LM head (a classifier)


def test_grammar_steps_share_the_plain_steps_choice():
    from batchgen_data.model.lm_head_topk import GRAMMAR, TRIALS

    choice = HeadChoice()
    for _ in range(TRIALS):  # timed as grammar steps: the plain choice is made from them
        choice.record(60, GRAMMAR, True, 1.0)
        choice.record(60, GRAMMAR, False, 2.0)
    assert choice.chosen == {(7, PLAIN): True}
    assert choice.chunked(62, PLAIN) is True and choice.chunked(62, GRAMMAR) is True
    assert choice.chunked(62, LOGPROBS) is True  # not chosen yet for logprobs: its trials start chunked
    assert HeadChoice(chosen={(7, PLAIN): False}).chunked(60, GRAMMAR) is False
