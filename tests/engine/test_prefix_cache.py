"""Prefix caching: block hashing, reference counts and LRU eviction, prefix-ordered admission
(no model), and tokens identical with caching on and off for every family (a real model)."""

from __future__ import annotations

import random

import pytest
from tiny_checkpoints import ARCHITECTURES

from batchgen_data import Engine, EngineConfig, SamplingParams
from batchgen_data.errors import ConfigError
from batchgen_data.engine.core.block_pool import BlockPool
from batchgen_data.engine.core.kv_manager import block_name
from batchgen_data.engine.core.runner_output import ModelRunnerOutput
from batchgen_data.engine.sampling_params import SamplingParams as SP
from batchgen_data.engine.core.scheduler import Scheduler
from batchgen_data.engine.core.admission import MAX_DEFERRALS
from batchgen_data.engine.core.sequence import Sequence
from batchgen_data.model import MoEModel
from batchgen_data.model.kv_cache import KVCache

# -- KV manager and block pool ----------------------------------------------------------------------

P, T = None, (0, 0)  # a first block's parent, and tokens for pool-level tests


def _names(tokens: list[int], size: int, num_blocks: int, extra_key=None) -> list[bytes]:
    names: list[bytes] = []
    for i in range(num_blocks):
        names.append(block_name(names[-1] if names else None, tokens[i * size:(i + 1) * size], extra_key))
    return names


def test_block_names_chain_through_the_prefix_as_sha256_digests():
    a = _names([1, 2, 3, 4, 5, 6, 7], 2, 3)
    b = _names([1, 2, 3, 4, 9, 9], 2, 3)
    c = _names([0, 2, 3, 4, 5, 6], 2, 3)
    assert all(isinstance(n, bytes) and len(n) == 32 for n in a)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]  # same first 4 tokens, then not
    assert c[1] != a[1]  # same tokens in block 1, other parent: another block
    assert _names([1, 2], 2, 1, extra_key="lora-a") != a[:1]  # extra keys salt it
    with pytest.raises(ConfigError, match="prefix_caching_hash_algo"):
        EngineConfig(prefix_caching_hash_algo="builtin")


def test_freed_cached_blocks_keep_their_kv_until_least_recently_freed_first_eviction():
    pool = BlockPool(4)
    first, second = pool.take(2), pool.take(2)
    pool.register(first[0], b"11", P, T), pool.register(second[0], b"22", P, T)
    assert pool.num_free == 0 and pool.num_cached == 2
    pool.release(first)  # freed earlier: evicted first
    pool.release(second)
    assert pool.num_free == 4 and pool.find(b"11", P, T) == first[0] and pool.find(b"22", P, T) == second[0]
    taken = pool.take(2)  # first's two blocks: its uncached tail, then its cached head
    assert set(taken) == set(first)
    assert pool.find(b"11", P, T) is None and pool.find(b"22", P, T) == second[0]
    assert pool.num_cached == 1


def test_reference_counts_share_a_block_and_free_it_once_every_holder_is_done():
    pool = BlockPool(3)
    [b] = pool.take(1)
    pool.register(b, b"7", P, T)
    pool.share([b])
    assert pool.ref_count(b) == 2 and pool.num_free == 2
    pool.release([b])
    assert pool.num_free == 2  # still held by the other owner
    pool.release([b])
    assert pool.num_free == 3 and pool.num_free_among([b]) == 1
    pool.share([b])  # revived from the free queue
    assert pool.num_free == 2 and pool.ref_count(b) == 1
    pool.release([b])
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.release([b])


def test_a_block_is_named_once_and_a_duplicate_name_keeps_the_first_block():
    pool = BlockPool(4)
    a, b = pool.take(2)
    pool.register(a, b"5", P, T)
    pool.register(b, b"5", P, T)
    assert pool.find(b"5", P, T) == a
    pool.register(a, b"6", P, T)  # already named: unchanged
    assert pool.find(b"6", P, T) is None


def test_two_different_blocks_forced_onto_one_name_never_share_kv(monkeypatch):
    """A collision (rows crafted so two different blocks get one name) must not hand the second
    row the first one's KV: the pool checks a hit's tokens and parent."""
    import batchgen_data.engine.core.kv_manager as kv_manager

    monkeypatch.setattr(kv_manager, "block_name", lambda parent, tokens, extra=None: b"same name for every block")
    sched = _scheduler()
    first = _row(0)
    sched.add(first)
    while sched.has_unfinished():
        _step(sched)  # the first row's blocks are cached (freed, kept)
    assert sched.kv.pool.num_cached == 1  # every block had the one name: the first one kept it
    other = Sequence(1, list(range(500, 500 + len(first.prompt_token_ids))), SP(max_tokens=3, ignore_eos=True), seed=1)
    sched.add(other)
    out = _step(sched)
    assert other.num_cached_tokens == 0  # nothing reused under the colliding name
    assert out.query_lens == [len(other.prompt_token_ids)]  # its whole prompt was computed
    same = _row(2)  # the first row's own prompt still hits its genuine block
    sched.add(same)
    _step(sched)
    assert same.num_cached_tokens == BLOCK


# -- admission (a scheduler with a fake model) -----------------------------------------------------

BLOCK = 4
TEMPLATE = list(range(100, 124))  # six full blocks shared by every row of a template


def _scheduler(num_blocks: int = 200, max_num_seqs: int = 16) -> Scheduler:
    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=4096, block_size=BLOCK)
    return Scheduler(config, num_blocks, max_model_len=10_000, kv_bytes_per_token=1)


def _row(i: int, template=TEMPLATE) -> Sequence:
    return Sequence(i, template + [1000 + i, 2000 + i, 3000 + i], SP(max_tokens=3, ignore_eos=True), seed=i)


def _step(sched: Scheduler):
    out = sched.schedule()
    sampled = [s for s, smp in zip(out.seqs, out.samples) if smp]
    sched.update(out, ModelRunnerOutput([s.request_id for s in sampled], [7] * len(sampled)), 0.0)
    return out


def test_siblings_wait_one_step_for_the_shared_prefix_instead_of_computing_it_twice():
    sched = _scheduler()
    rows = [_row(i) for i in range(6)]
    for seq in rows:
        sched.add(seq)
    out = _step(sched)
    assert [s.request_id for s in out.seqs] == [0]  # one row computes the template
    assert out.num_tokens == len(rows[0].prompt_token_ids)
    out = _step(sched)  # the template is cached now: the siblings start after it
    assert {s.request_id for s in out.seqs} >= {1, 2, 3, 4, 5}
    assert all(rows[i].num_cached_tokens == len(TEMPLATE) for i in range(1, 6))
    assert rows[0].num_cached_tokens == 0
    computed = sum(q for s, q in zip(out.seqs, out.query_lens) if s.request_id != 0)
    assert computed == 5 * 3  # only the row parts
    assert sched.stats.num_prefix_hit_tokens == 5 * len(TEMPLATE)


def test_longest_cached_prefix_first_and_arrival_order_when_nothing_is_shared():
    sched = _scheduler(max_num_seqs=1)
    other = list(range(500, 524))
    warm = _row(0)
    sched.add(warm)
    while sched.has_unfinished():
        _step(sched)  # the template is now cached (freed, kept)
    cold, hot = _row(1, other), _row(2)
    sched.add(cold)
    sched.add(hot)
    out = _step(sched)
    assert [s.request_id for s in out.seqs] == [2]  # arrived later, but its prefix is cached

    fresh = _scheduler(max_num_seqs=1)
    unshared = [Sequence(i, [10 * i + k for k in range(9)], SP(max_tokens=1), seed=i) for i in range(4)]
    for seq in unshared:
        fresh.add(seq)
    order = []
    while fresh.has_unfinished():
        order += [s.request_id for s in _step(fresh).seqs if s.request_id not in order]
    assert order == [0, 1, 2, 3]  # nothing shared: today's order


def test_a_deferred_sibling_starts_within_the_starvation_bound():
    sched = _scheduler(max_num_seqs=4)
    long_template = list(range(100, 100 + 4 * BLOCK * 8))  # 32 blocks, prefilled in chunks
    sched.config.max_num_batched_tokens = BLOCK  # one block per step: the sibling would wait 32
    first, sibling = _row(0, long_template), _row(1, long_template)
    sched.add(first)
    sched.add(sibling)
    steps = 0
    while sibling.status.name == "WAITING":
        _step(sched)
        steps += 1
    assert sibling.num_deferrals == MAX_DEFERRALS and steps == MAX_DEFERRALS + 1


# -- tokens with caching on and off (real models) --------------------------------------------------


def _templated_prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    templates = [[rng.randrange(4, 500) for _ in range(n)] for n in (37, 24, 9)]
    return [templates[i % 3] + [rng.randrange(4, 500) for _ in range(rng.randrange(1, 12))] for i in range(12)]


def _generate(folder, prompts, caching: bool, **config):
    engine = Engine(folder, EngineConfig(block_size=8, enable_prefix_caching=caching, **config))
    greedy = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    seeded = engine.generate(prompts, [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=i,
                                                      ignore_eos=True) for i in range(len(prompts))])
    return [o.token_ids for o in greedy + seeded], engine.stats(), greedy + seeded


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_tokens_are_identical_with_prefix_caching_on_and_off(tiny_checkpoint, arch):
    folder, _ = tiny_checkpoint(arch)
    prompts = _templated_prompts()
    off, off_stats, _ = _generate(folder, prompts, caching=False)
    on, on_stats, outs = _generate(folder, prompts, caching=True)
    assert on == off
    assert off_stats.prefix_cache_hits == 0 and on_stats.prefix_cache_hits > 0
    assert on_stats.num_forward_tokens < off_stats.num_forward_tokens
    assert any(o.num_cached_tokens >= 8 for o in outs)


def _kv_budget(folder, num_tokens: int, block_size: int = 8) -> int:
    specs = MoEModel.from_pretrained(folder).kv_specs
    return KVCache.bytes_per_block(specs, block_size) * (-(-num_tokens // block_size))


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
@pytest.mark.parametrize("swap", [False, True], ids=["recompute", "swap"])
def test_identical_under_a_kv_budget_that_evicts_cached_blocks_and_suspends(tiny_checkpoint, arch, swap):
    folder, _ = tiny_checkpoint(arch)
    prompts = _templated_prompts(seed=1)
    budget = _kv_budget(folder, 160)
    config = dict(max_num_seqs=6, attention_batch_size=3, max_num_batched_tokens=64, kv_cache_memory_bytes=budget,
                  swap_space_bytes=budget * 4 if swap else 0)
    off, _, _ = _generate(folder, prompts, caching=False, **config)
    on, stats, _ = _generate(folder, prompts, caching=True, **config)
    assert on == off
    assert stats.num_suspended > 0 and stats.prefix_cache_hits > 0


def test_an_imported_sequence_finds_its_prefix_in_the_receiving_engine(tiny_checkpoint):
    folder, _ = tiny_checkpoint("qwen3_moe")
    prompts = _templated_prompts(seed=2)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = [o.token_ids for o in Engine(folder, EngineConfig(block_size=8, enable_prefix_caching=False))
                .generate(prompts[:2], params)]
    source, target = (Engine(folder, EngineConfig(block_size=8)) for _ in range(2))
    target.generate([prompts[0]], params)  # the receiver has computed template 0 already
    moving = source.add_request(prompts[0], params)
    for _ in range(3):
        source.step()
    assert moving.num_generated > 0
    imported = target.import_sequence(source.export_sequence(moving))  # without KV: recomputed
    done = {}
    while target.has_unfinished_requests():
        done.update({s.request_id: s for s in target.step()})
    seq = done[imported.request_id]
    assert seq.output.token_ids == expected[0]
    assert seq.output.num_cached_tokens >= 8  # the recompute started after the cached template
    assert target.stats().num_recomputed_tokens < seq.num_tokens - 1
