"""``enable_chunked_prefill=False`` (vLLM's): a prompt runs whole in one step or waits."""

from __future__ import annotations

from types import SimpleNamespace

from batchgen_data import Engine, EngineConfig, SamplingParams
from batchgen_data.engine.core.scheduler_output import combine


def _seqs(*pending: int) -> list:
    return [SimpleNamespace(num_pending_tokens=p, draft_token_ids=[]) for p in pending]


def test_combine_chunks_by_default_and_runs_whole_prompts_without_chunking():
    running = _seqs(1, 1, 50, 30, 5)
    assert combine(running, 40)[1] == [1, 1, 38]
    # without chunking the 50-token prompt waits, and the prompts admitted after it wait with it
    assert combine(running, 40, chunked_prefill=False)[1] == [1, 1]
    assert combine(running, 90, chunked_prefill=False)[1] == [1, 1, 50, 30, 5]
    seqs, lens, samples = combine(_seqs(1, 30, 50), 60, chunked_prefill=False)
    assert lens == [1, 30] and samples == [True, True]


def test_the_engine_gives_the_same_tokens_and_a_budget_holding_max_model_len():
    params = SamplingParams(max_tokens=6, temperature=0.0)
    prompts = ["word " * n for n in (3, 40, 90, 17)]
    chunked = Engine("demo", EngineConfig(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=160,
                                          tune_gemms=False))
    whole = Engine("demo", EngineConfig(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=160,
                                        enable_chunked_prefill=False, tune_gemms=False))
    assert whole.executor.scheduler.config.max_num_batched_tokens == 160
    assert [o.token_ids for o in whole.generate(prompts, params)] == [o.token_ids for o in chunked.generate(prompts, params)]
