"""The engine's outputs equal a per-prompt transformers run, under any batching and memory pressure."""

from __future__ import annotations

import random

import pytest
from tiny_checkpoints import hf_greedy_continuations

from batchgen_data import Engine, EngineConfig, SamplingParams
from batchgen_data.errors import ConfigError
from batchgen_data.engine.core.sequence import SequenceStatus
from batchgen_data.model.kv_cache import KVCache

ARCH = "qwen3_moe"
MAX_NEW = 24


def _workload(n: int = 12, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(4, 500) for _ in range(rng.choice([1, 3, 9, 17, 40, 70]))] for _ in range(n)]
    max_tokens = [rng.choice([1, 5, 12, MAX_NEW]) for _ in range(n)]
    return prompts, max_tokens


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    """Greedy continuations from transformers, one prompt at a time."""
    folder, hf = tiny_checkpoint(ARCH)
    prompts, max_tokens = _workload()
    return folder, prompts, max_tokens, hf_greedy_continuations(hf, prompts, MAX_NEW)


def _params(max_tokens: list[int]) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]


def _kv_budget(folder, num_tokens: int, block_size: int = 8) -> int:
    from batchgen_data.model import MoEModel

    specs = MoEModel.from_pretrained(folder).kv_specs
    return KVCache.bytes_per_block(specs, block_size) * (-(-num_tokens // block_size))


@pytest.mark.parametrize(
    "max_num_seqs,attention_batch_size,max_num_batched_tokens",
    [(16, 16, 512), (16, 3, 512), (5, 2, 32), (1, 1, 16)],
)
def test_greedy_matches_transformers_across_batch_settings(reference, max_num_seqs, attention_batch_size, max_num_batched_tokens):
    folder, prompts, max_tokens, refs = reference
    config = EngineConfig(
        max_num_seqs=max_num_seqs,
        attention_batch_size=attention_batch_size,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=8,
    )
    outs = Engine(folder, config).generate(prompts, _params(max_tokens))
    assert [o.token_ids for o in outs] == [r[:m] for r, m in zip(refs, max_tokens)]
    assert all(o.finish_reason == "length" and o.num_input_tokens == len(p) for o, p in zip(outs, prompts))


@pytest.mark.parametrize("swap_space_bytes", [0, 1 << 30])
@pytest.mark.parametrize("suspend_policy", ["most_progress", "shortest_first"])
def test_greedy_matches_transformers_under_memory_pressure(reference, swap_space_bytes, suspend_policy):
    folder, prompts, max_tokens, refs = reference
    budget = _kv_budget(folder, 160)  # far below the ~600 tokens the workload holds at once
    config = EngineConfig(
        max_num_seqs=12,
        attention_batch_size=4,
        max_num_batched_tokens=64,
        block_size=8,
        kv_cache_memory_bytes=budget,
        swap_space_bytes=swap_space_bytes,
        suspend_policy=suspend_policy,
        refill_threshold=1.0,
    )
    engine = Engine(folder, config)
    outs = engine.generate(prompts, _params(max_tokens))
    assert [o.token_ids for o in outs] == [r[:m] for r, m in zip(refs, max_tokens)]
    stats = engine.stats()
    assert stats.num_suspended > 0
    if swap_space_bytes:
        assert stats.num_resumed_swap > 0
    else:
        assert stats.num_resumed_recompute > 0 and stats.num_recomputed_tokens > 0
    assert engine.executor.blocks.num_free == engine.executor.blocks.num_blocks  # everything given back


def test_seeded_sampling_is_independent_of_batch_composition(reference):
    folder, prompts, _, _ = reference
    target = prompts[3]
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = Engine(folder, EngineConfig(block_size=8)).generate([target], params)[0].token_ids
    others = [SamplingParams(max_tokens=10, temperature=1.0, seed=s) for s in range(len(prompts))]
    mixed = Engine(folder, EngineConfig(block_size=8, max_num_seqs=4, attention_batch_size=2)).generate(
        prompts[:3] + [target] + prompts[4:], others[:3] + [params] + others[4:]
    )[3].token_ids
    tight = EngineConfig(
        block_size=8, max_num_seqs=12, max_num_batched_tokens=64, kv_cache_memory_bytes=_kv_budget(folder, 160)
    )
    pressured_engine = Engine(folder, tight)
    pressured = pressured_engine.generate(prompts[:3] + [target] + prompts[4:], others[:3] + [params] + others[4:])
    assert pressured_engine.stats().num_suspended > 0
    assert alone == mixed == pressured[3].token_ids
    assert len(alone) == 16
    # A different seed gives a different continuation (the seed is actually used).
    other_seed = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=99, ignore_eos=True)
    assert Engine(folder, EngineConfig(block_size=8)).generate([target], other_seed)[0].token_ids != alone


def test_invalid_requests_get_errors_and_do_not_disturb_others(reference):
    folder, prompts, max_tokens, refs = reference
    engine = Engine(folder, EngineConfig(block_size=8, max_model_len=128))
    good = SamplingParams(max_tokens=max_tokens[0], temperature=0, ignore_eos=True)
    bad_params = SamplingParams(max_tokens=4)
    with pytest.raises(ConfigError, match="top_p"):  # checked as it is set, left as it was
        bad_params.top_p = 1.5
    assert bad_params.top_p == 1.0
    bad_params = [1, 2]  # not params at all: the input processor's error
    batch = [prompts[0], "", [], [1, 2, 10**6], [1, "x"], [1.5], list(range(4, 200)), prompts[0], 42]
    params = [good, good, good, good, good, good, good, bad_params, good]
    outs = engine.generate(batch, params)
    assert outs[0].token_ids == refs[0][: max_tokens[0]]
    errors = {i: o.error for i, o in enumerate(outs) if o.finish_reason == "error"}
    assert sorted(errors) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert "empty prompt" in errors[1] and "empty prompt" in errors[2]
    assert "outside the vocabulary" in errors[3]
    assert "integers" in errors[4] and "integers" in errors[5]
    assert "context limit is 128" in errors[6]
    assert "must be a SamplingParams or a PoolingParams" in errors[7]
    assert "prompt must be" in errors[8]


def test_request_that_can_never_fit_the_kv_budget_errors(reference):
    folder, prompts, _, refs = reference
    engine = Engine(folder, EngineConfig(block_size=8, kv_cache_memory_bytes=_kv_budget(folder, 64)))
    outs = engine.generate(
        [prompts[0], list(range(4, 70)), prompts[0]],
        [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)] * 3,
    )
    assert outs[1].finish_reason == "error" and "KV budget holds 64 tokens" in outs[1].error
    assert outs[0].token_ids == outs[2].token_ids == refs[0][:8]


def test_stop_rules(reference):
    folder, prompts, _, refs = reference
    engine = Engine(folder, EngineConfig(block_size=8))
    ref = refs[0]
    stop_tok = ref[5]
    first = ref.index(stop_tok)
    out = engine.generate([prompts[0]], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_tok]))[0]
    assert out.finish_reason == "stop" and out.token_ids == ref[: first + 1]
    full_text = engine.tokenizer.decode(ref[:20])
    stop_str = full_text[len(full_text) // 2 : len(full_text) // 2 + 3]
    out = engine.generate([prompts[0]], SamplingParams(max_tokens=20, temperature=0, stop=stop_str, ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert stop_str not in out.text and full_text.startswith(out.text)
    assert out.text == full_text[: full_text.find(stop_str)]


def test_eos_stops_unless_ignored(reference):
    folder, prompts, _, _ = reference
    engine = Engine(folder, EngineConfig(block_size=8))
    # Make token 2 (eos) win by reading the model's own greedy choice and declaring it eos.
    first = engine.generate([prompts[1]], SamplingParams(max_tokens=1, temperature=0))[0].token_ids[0]
    engine.executor.scheduler.stops.eos_token_ids = frozenset({first})
    assert engine.generate([prompts[1]], SamplingParams(max_tokens=5, temperature=0))[0].finish_reason == "stop"
    out = engine.generate([prompts[1]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and out.num_generated_tokens == 5


def test_generation_stops_at_max_model_len(reference):
    folder, prompts, _, refs = reference
    engine = Engine(folder, EngineConfig(block_size=8, max_model_len=len(prompts[0]) + 4))
    out = engine.generate([prompts[0]], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and out.token_ids == refs[0][:4]


def test_stream_yields_every_output_once(reference):
    folder, prompts, max_tokens, refs = reference
    engine = Engine(folder, EngineConfig(block_size=8))
    seen = {o.request_id: o for o in engine.stream(prompts, _params(max_tokens))}
    assert len(seen) == len(prompts)
    by_tokens = sorted(o.token_ids for o in seen.values())
    assert by_tokens == sorted(r[:m] for r, m in zip(refs, max_tokens))


def test_exported_sequence_continues_identically_in_another_engine(reference):
    folder, prompts, _, refs = reference
    config = EngineConfig(block_size=8, max_num_seqs=2)
    source = Engine(folder, config)
    seqs = [source.add_request(p, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)) for p in prompts[:4]]
    for _ in range(6):
        source.step()
    moved = [s for s in seqs if s.status is SequenceStatus.WAITING]
    assert moved, "some sequences should still be waiting with max_num_seqs=2"
    target = Engine(folder, config)
    imported = [target.import_sequence(source.export_sequence(s)) for s in moved]
    done = {}
    while target.has_unfinished_requests():
        for s in target.step():
            done[s.request_id] = s.output.token_ids
    for seq, new in zip(moved, imported):
        assert done[new.request_id] == refs[prompts.index(seq.prompt_token_ids)]


def test_suspended_sequence_migrates_mid_generation(reference):
    folder, prompts, _, refs = reference
    tight = EngineConfig(
        block_size=8, max_num_seqs=12, max_num_batched_tokens=64, kv_cache_memory_bytes=_kv_budget(folder, 160)
    )
    source = Engine(folder, tight)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    seqs = [source.add_request(p, params) for p in prompts]
    moved = []
    while source.has_unfinished_requests() and not moved:
        source.step()
        moved = [s for s in seqs if s.status is SequenceStatus.SUSPENDED and s.num_generated]
    assert moved, "memory pressure should suspend a sequence that has generated tokens"
    target = Engine(folder, EngineConfig(block_size=8))
    pairs = [(s, target.import_sequence(source.export_sequence(s))) for s in moved]
    rest = {}
    while source.has_unfinished_requests():
        for s in source.step():
            rest[s.request_id] = s.output.token_ids
    done = {}
    while target.has_unfinished_requests():
        for s in target.step():
            done[s.request_id] = s.output.token_ids
    for old, new in pairs:
        assert done[new.request_id] == refs[prompts.index(old.prompt_token_ids)]
    for s in seqs:
        if s.request_id in rest:
            assert rest[s.request_id] == refs[prompts.index(s.prompt_token_ids)]


@pytest.mark.parametrize("with_kv", [True, False], ids=["kv-shipped", "kv-recomputed"])
def test_running_sequence_migrates_mid_generation(reference, with_kv):
    folder, prompts, _, refs = reference
    source = Engine(folder, EngineConfig(block_size=8))
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    seqs = [source.add_request(p, params) for p in prompts[:6]]
    for _ in range(7):
        source.step()
    moved = [s for s in seqs if s.status is SequenceStatus.RUNNING and s.num_generated][:3]
    assert len(moved) == 3
    used = source.executor.blocks.num_used
    states = [source.export_sequence(s, with_kv=with_kv) for s in moved]
    assert source.executor.blocks.num_used < used  # the moved sequences' pages are free again
    assert all((st.kv is not None) == with_kv for st in states)
    target = Engine(folder, EngineConfig(block_size=8))
    imported = [target.import_sequence(st) for st in states]
    done = {}
    for engine in (source, target):
        while engine.has_unfinished_requests():
            for s in engine.step():
                done[(engine is target, s.request_id)] = s.output.token_ids
    for old, new in zip(moved, imported):
        assert done[(True, new.request_id)] == refs[prompts.index(old.prompt_token_ids)]
    for s in seqs:
        if s not in moved:
            assert done[(False, s.request_id)] == refs[prompts.index(s.prompt_token_ids)]
    recomputed = target.executor.scheduler.stats.num_recomputed_tokens
    assert (recomputed == 0) == with_kv  # shipped KV is restored, not rebuilt


def test_async_migrate_out_moves_exactly_the_planned_requests(reference):
    """``migrate_out`` exports the requests a plan names (with KV as each ``Move`` says), and
    only those: a named one that finished meanwhile stays finished. Moved ones continue exactly
    on another engine."""
    import asyncio

    from batchgen_data.engine.async_engine import AsyncEngine, MigratedOut
    from batchgen_data.rebalance.core.move_rule import Move

    folder, prompts, _, refs = reference
    source, target = (AsyncEngine(Engine(folder, EngineConfig(block_size=8))) for _ in range(2))
    lengths = [MAX_NEW if i % 2 else 2 for i in range(len(prompts))]
    seen: dict[int, int] = {}  # request id -> max_tokens, from a step listener
    source.add_step_listener(lambda engine, report, live: seen.update(
        (rid, entry.handle.params.max_tokens) for rid, entry in live.items()))

    async def job():
        calls = [asyncio.ensure_future(source.run_one(p, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)))
                 for p, m in zip(prompts, lengths)]
        while source.engine.stats().num_forwards < 4:
            await asyncio.sleep(0.01)
        long_ids = sorted(rid for rid, m in seen.items() if m == MAX_NEW)
        short_id = min(rid for rid, m in seen.items() if m == 2)  # finished by now
        moves = [Move(long_ids[0], True, 0), Move(long_ids[1], False, 0), Move(short_id, True, 0)]
        moved = await source.migrate_out(moves)
        results = await asyncio.gather(*calls)
        finals = []
        for result in results:
            if isinstance(result, MigratedOut):
                result = await target.run_one(None, None, state=result.state)
            finals.append(result)
        return moved, results, finals

    try:
        moved, results, finals = asyncio.run(job())
    finally:
        source.shutdown(), target.shutdown()
    migrated = [r.state for r in results if isinstance(r, MigratedOut)]
    assert moved == len(migrated) == 2  # the two long ones named; the finished short one stayed
    assert sorted(state.kv is not None for state in migrated) == [False, True]  # KV as each move said
    for i, out in enumerate(finals):
        assert out.token_ids == refs[i][: lengths[i]]


def test_async_engine_publishes_progress_and_step_times(reference):
    """What the rebalancer reads (an ``EngineProbe`` step listener): the live sequences after
    each step, and a step-time model."""
    import asyncio

    from batchgen_data.engine.async_engine import AsyncEngine
    from batchgen_data.engine.migration.engine_probe import EngineProbe

    folder, prompts, _, _ = reference
    aengine = AsyncEngine(Engine(folder, EngineConfig(block_size=8)))
    probe = EngineProbe.attach(aengine)
    lengths = [2 + 2 * i for i in range(len(prompts))]  # the running set shrinks one by one
    seen = []

    async def job():
        calls = [asyncio.ensure_future(aengine.run_one(p, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)))
                 for p, m in zip(prompts, lengths)]
        while not all(c.done() for c in calls):
            seen.append(probe.snapshot.progress.seqs)
            await asyncio.sleep(0.002)
        return await asyncio.gather(*calls)

    try:
        asyncio.run(job())
    finally:
        aengine.shutdown()
    started = [p for snapshot in seen for p in snapshot if p.started]
    assert started and all(p.max_tokens in lengths and 0 <= p.num_generated < p.max_tokens for p in started)
    assert all(p.num_tokens > p.num_generated for p in started)  # prompt plus output
    final = probe.snapshot
    assert final.progress.seqs == () and final.progress.num_accepted == len(prompts)  # all done
    model = final.step.fit()
    assert model is not None and model.step_s(4) > 0 and model.per_seq_s >= 0
    assert final.move_s_per_token > 0


def test_a_request_handle_follows_its_request_from_waiting_to_finished(reference):
    """A caller's handle shows what the scheduler's record says after every step: waiting behind
    a full running set, running with its tokens so far, then finished with its output."""
    folder, prompts, _, refs = reference
    engine = Engine(folder, EngineConfig(block_size=8, max_num_seqs=1))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    first, second = (engine.add_request(p, params) for p in prompts[:2])
    seen = [(second.status, second.num_generated)]
    while engine.has_unfinished_requests():
        engine.step()
        seen.append((second.status, second.num_generated))
        assert second.num_tokens == len(prompts[1]) + second.num_generated
    statuses = [status for i, (status, _) in enumerate(seen) if i == 0 or status is not seen[i - 1][0]]
    assert statuses == [SequenceStatus.WAITING, SequenceStatus.RUNNING, SequenceStatus.FINISHED]
    running = [n for status, n in seen if status is SequenceStatus.RUNNING]
    assert running == sorted(running) and 0 < running[-1] < 4  # its tokens so far, step by step
    assert first.is_finished and second.is_finished and second.num_tokens_left == 0
    assert second.output.token_ids == refs[1][:4]
    timings = second.output.timings
    assert 0 < timings.first_token_s <= timings.finished_s


def test_async_callers_share_one_engine(reference):
    import asyncio

    from batchgen_data.engine.async_engine import AsyncEngine

    folder, prompts, max_tokens, refs = reference
    aengine = AsyncEngine(Engine(folder, EngineConfig(block_size=8, collect_timeline=True)))

    async def main():
        half = len(prompts) // 2
        first = aengine.generate(prompts[:half], _params(max_tokens[:half]))
        second = aengine.generate(prompts[half:], _params(max_tokens[half:]))
        return await asyncio.gather(first, second)

    try:
        a, b = asyncio.run(main())
    finally:
        aengine.shutdown()
    assert [o.token_ids for o in a + b] == [r[:m] for r, m in zip(refs, max_tokens)]
    # Both callers' requests ran in the same forwards at some point.
    assert max(step["num_running"] for step in aengine.engine.timeline) > len(prompts) // 2


def test_a_single_string_is_one_prompt_in_engine_and_async_engine(reference):
    import asyncio

    from batchgen_data.engine.async_engine import AsyncEngine

    folder = reference[0]
    engine = Engine(folder, EngineConfig(block_size=8))
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    [expected] = engine.generate(["Hello there"], params)
    assert engine.generate("Hello there", params)[0].token_ids == expected.token_ids
    aengine = AsyncEngine(engine)
    try:
        outputs = asyncio.run(aengine.generate("Hello there", params))
    finally:
        aengine.shutdown()
    assert len(outputs) == 1  # not eleven one-character prompts
    assert outputs[0].token_ids == expected.token_ids and outputs[0].num_input_tokens == expected.num_input_tokens
