"""Speculative decoding changes no token: every family, greedy and seeded, with logprobs, stop
rules, grammar rows, memory pressure, prefix caching and MIGRATE; the proposers and the policy."""

from __future__ import annotations

import random

import pytest
from tiny_checkpoints import ALL_ARCHS

from batchgen_data import Engine, EngineConfig, SamplingParams
from batchgen_data.engine.core.sequence import SequenceStatus
from batchgen_data.engine.spec.policy import PROBE_EVERY, RowAcceptance, StepCosts, choose_draft_lengths
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen_data.engine.spec.proposers import NgramIndex, SuffixProposer, TableProposer, longest_lookup, lookup
from batchgen_data.errors import ConfigError

SPEC = {"method": "ngram", "num_speculative_tokens": 4}


class PartlyRight:
    """Proposes the plain run's next tokens with one wrong token at a random place (or none),
    so steps accept every draft length from 0 to k."""

    def __init__(self, outputs: dict[tuple[int, ...], list[int]], seed: int = 0):
        self.outputs, self.rng = outputs, random.Random(seed)

    def propose(self, seq, k):
        known = self.outputs.get(tuple(seq.prompt_token_ids), [])[seq.num_generated : seq.num_generated + k]
        cut = self.rng.randrange(len(known) + 1)
        return known[:cut] + [(t + 7) % 50 + 4 for t in known[cut : cut + 1]] + known[cut + 1 :]


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 300) for _ in range(rng.choice([2, 5, 11, 30]))] for _ in range(n)]


def _run(folder, prompts, params, config: EngineConfig, proposer=None, fixed: int | None = 3):
    engine = Engine(folder, config)
    drafter = engine.executor.scheduler.drafter
    if drafter is not None:
        if proposer is not None:
            drafter.proposer = proposer
        drafter.fixed_length = fixed
    outs = engine.generate(prompts, params)
    stats = None if drafter is None else drafter.stats
    free = engine.executor.blocks.num_free == engine.executor.blocks.num_blocks
    engine.close()
    return outs, stats, free


def _table(outs, prompts):
    return {tuple(p): list(o.token_ids) for p, o in zip(prompts, outs)}


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_tokens_identical_with_speculation_every_family(tiny_checkpoint, arch):
    folder, _ = tiny_checkpoint(arch)
    prompts = _prompts(6)
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=20, seed=11, ignore_eos=True)] * 3
    plain, _, _ = _run(folder, prompts, params, EngineConfig(block_size=8))
    spec, stats, free = _run(folder, prompts, params, EngineConfig(block_size=8, speculative_config=SPEC),
                             PartlyRight(_table(plain, prompts)))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert stats.num_drafted_tokens > 0 and 0 < stats.num_accepted_tokens < stats.num_drafted_tokens
    assert free  # every page given back, draft pages included


def test_logprobs_stop_rules_and_grammar_rows_unchanged(tiny_checkpoint):
    folder, _ = tiny_checkpoint("qwen3_moe")
    prompts = _prompts(8, seed=1)
    params = [SamplingParams(max_tokens=20, temperature=0, logprobs=3, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.7, seed=5, stop_token_ids=[17, 33, 58, 91]),
              SamplingParams(max_tokens=20, temperature=0, min_tokens=3, ignore_eos=True),  # a processor: no drafts
              SamplingParams(max_tokens=12, temperature=0, structured_outputs={"regex": "[a-z]{3,9}"})] * 2
    plain, _, _ = _run(folder, prompts, params, EngineConfig(block_size=8))
    spec, stats, _ = _run(folder, prompts, params, EngineConfig(block_size=8, speculative_config=SPEC),
                          PartlyRight(_table(plain, prompts), seed=2))
    assert stats.num_accepted_tokens > 0
    for a, b in zip(plain, spec):
        assert (a.token_ids, a.finish_reason, a.text) == (b.token_ids, b.finish_reason, b.text)
        if a.logprobs is not None:
            for x, y in zip(a.logprobs, b.logprobs):
                assert list(x) == list(y)  # the same tokens listed, in the same order
                assert max(abs(x[t].logprob - y[t].logprob) for t in x) < 1e-4


def test_constrained_rows_draft_within_their_grammar(tiny_checkpoint):
    """Only constrained rows: every draft is cut to what the grammar allows, each position is
    masked by the grammar state after the draft before it, and the outputs are plain decoding's
    (the grammar completes inside some drafts)."""
    folder, _ = tiny_checkpoint("qwen3_moe")
    prompts = _prompts(8, seed=8)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 6}},
              "required": ["a", "b"], "additionalProperties": False}
    params = [SamplingParams(max_tokens=30, temperature=0, structured_outputs={"regex": "[a-z]{4,30}"}),
              SamplingParams(max_tokens=30, temperature=0.8, seed=3, structured_outputs={"regex": "[a-z ]{4,30}"}),
              SamplingParams(max_tokens=30, temperature=0, structured_outputs={"json": schema}),
              SamplingParams(max_tokens=30, temperature=0.7, seed=8, structured_outputs={"json": schema})] * 2
    plain, _, _ = _run(folder, prompts, params, EngineConfig(block_size=8))
    assert all(o.error is None for o in plain)
    spec, stats, free = _run(folder, prompts, params, EngineConfig(block_size=8, speculative_config=SPEC),
                             PartlyRight(_table(plain, prompts), seed=9))
    assert [(o.token_ids, o.finish_reason) for o in spec] == [(o.token_ids, o.finish_reason) for o in plain]
    assert stats.num_accepted_tokens > 0 and free


def test_drafts_at_the_end_of_max_tokens_and_a_stop_inside_a_draft(tiny_checkpoint):
    """An oracle drafts through a stop token and up to max_tokens: the output ends where plain
    decoding ends it."""
    folder, _ = tiny_checkpoint("mixtral")
    prompts = _prompts(6, seed=3)
    free_run, _, _ = _run(folder, prompts, SamplingParams(max_tokens=14, temperature=0, ignore_eos=True),
                          EngineConfig(block_size=8))
    stops = sorted({o.token_ids[5] for o in free_run})  # every row meets a stop token mid-draft
    params = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, stop_token_ids=stops)
    plain, _, _ = _run(folder, prompts, params, EngineConfig(block_size=8))
    spec, stats, free = _run(folder, prompts, params, EngineConfig(block_size=8, speculative_config=SPEC),
                             TableProposer(_table(free_run, prompts), vocab_size=512), fixed=4)
    assert [(o.token_ids, o.finish_reason) for o in spec] == [(o.token_ids, o.finish_reason) for o in plain]
    assert stats.num_accepted_tokens == stats.num_drafted_tokens > 0 and free


@pytest.mark.parametrize("swap", [0, 1 << 30])
def test_identical_under_memory_pressure_and_with_a_warm_prefix_cache(tiny_checkpoint, swap):
    from batchgen_data.model import MoEModel
    from batchgen_data.model.kv_cache import KVCache

    folder, _ = tiny_checkpoint("qwen3_moe")
    shared = [9, 8, 7, 6, 5, 4, 3, 2] * 3
    prompts = [shared + p for p in _prompts(10, seed=4)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    budget = KVCache.bytes_per_block(MoEModel.from_pretrained(folder).kv_specs, 8) * 22
    config = dict(block_size=8, max_num_seqs=10, max_num_batched_tokens=64, kv_cache_memory_bytes=budget,
                  swap_space_bytes=swap, refill_threshold=1.0)
    plain, _, _ = _run(folder, prompts, params, EngineConfig(**config))
    engine = Engine(folder, EngineConfig(**config, speculative_config=SPEC))
    drafter = engine.executor.scheduler.drafter
    drafter.proposer, drafter.fixed_length = PartlyRight(_table(plain, prompts), seed=4), 3
    for _ in range(2):  # the second pass starts from the prefix cache the first one filled
        spec = engine.generate(prompts, params)
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert engine.stats().num_suspended > 0 and drafter.stats.num_accepted_tokens > 0
    engine.close()


def test_a_running_sequence_migrates_between_speculating_engines(tiny_checkpoint):
    folder, _ = tiny_checkpoint("qwen3_moe")
    prompts = _prompts(4, seed=5)
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=9, ignore_eos=True)
    plain, _, _ = _run(folder, prompts, params, EngineConfig(block_size=8))
    table = _table(plain, prompts)
    engines = []
    for _ in range(2):
        engine = Engine(folder, EngineConfig(block_size=8, speculative_config=SPEC))
        drafter = engine.executor.scheduler.drafter
        drafter.proposer, drafter.fixed_length = PartlyRight(table, seed=6), 3
        engines.append(engine)
    source, target = engines
    seqs = [source.add_request(p, params) for p in prompts]
    for _ in range(3):
        source.step()
    moving = [s for s in seqs if s.status is SequenceStatus.RUNNING and s.num_generated][:2]
    assert moving
    imported = [target.import_sequence(source.export_sequence(s, with_kv=True)) for s in moving]
    done = {}
    for engine in engines:
        while engine.has_unfinished_requests():
            for s in engine.step():
                done[(engine is target, s.request_id)] = s.output.token_ids
    for old, new in zip(moving, imported):
        assert done[(True, new.request_id)] == table[tuple(old.prompt_token_ids)]
    for s in seqs:
        if s not in moving:
            assert done[(False, s.request_id)] == table[tuple(s.prompt_token_ids)]


def test_prompt_lookup_takes_the_longest_suffix_ngram_at_its_earliest_place():
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3]
    assert lookup(tokens, 1, 3, 2) == [9, 1]  # "1 2 3" first occurs at 0, followed by 9 1
    assert lookup(tokens, 1, 2, 3) == [9, 1, 2]  # "2 3" first at 1, followed by 9 1 2
    assert lookup([5, 6, 7], 1, 3, 2) == []  # no suffix recurs
    assert lookup([4, 4], 2, 3, 2) == []  # below prompt_lookup_min
    assert lookup([7, 8, 7], 1, 2, 5) == [8, 7]  # fewer tokens than asked follow the match


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 5), min_size=1, max_size=60), cuts=st.lists(st.integers(1, 60), max_size=4),
       min_n=st.integers(1, 3), extra=st.integers(0, 3), k=st.integers(1, 5))
def test_the_ngram_index_finds_what_the_scan_finds(tokens, cuts, min_n, extra, k):
    """The incremental index answers as the scan does, after the tokens grow in steps."""
    index = NgramIndex(min_n, min_n + extra)
    for cut in sorted(set(cuts)) + [len(tokens)]:
        seen = tokens[:cut]
        assert index.lookup(seen, k) == longest_lookup(seen, min_n, min_n + extra, k)


def test_suffix_decoding_learns_the_jobs_outputs():
    class Row:
        def __init__(self, prompt, output):
            self.prompt_token_ids, self.output_token_ids = prompt, output
            self.draft_index = None

    proposer = SuffixProposer(max_depth=4, max_cached=3)
    skeleton = [50, 51, 52, 53, 54, 55]  # every row's output shares this structure
    assert proposer.propose(Row([1, 2, 3], [50, 51]), 3) == []  # nothing learned, no self-repeat
    for row in range(3):
        proposer.observe(Row([row], skeleton[:3] + [90 + row] + skeleton[3:]))
    assert proposer.propose(Row([7, 8], [50, 51]), 3)[:1] == [52]  # the job's continuation of "50 51"
    assert proposer.propose(Row([7, 8], [95, 54]), 2) == [55]  # after "54": 55, then nothing known
    own = Row([5, 6, 7, 8, 9, 5, 6, 7], [])  # the row's own prompt matches a longer suffix
    assert proposer.propose(own, 2) == [8, 9]
    for row in range(4):  # past max_cached the older half is forgotten
        proposer.observe(Row([row], [70, 71, 72]))
    assert proposer.propose(Row([1], [70, 71]), 1) == [72]


def test_suffix_method_keeps_tokens_and_accepts_drafts_on_a_repetitive_job(tiny_checkpoint):
    folder, _ = tiny_checkpoint("mixtral")
    prompts = _prompts(12, seed=7)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain, _, _ = _run(folder, prompts, params, EngineConfig(block_size=8, max_num_seqs=3))
    config = EngineConfig(block_size=8, max_num_seqs=3, speculative_config={"method": "suffix",
                                                                             "num_speculative_tokens": 3})
    spec, stats, free = _run(folder, prompts, params, config, fixed=3)  # the engine's own suffix proposer
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert stats.num_accepted_tokens > 0 and free


def test_the_policy_drafts_where_it_pays_and_stops_where_it_fails():
    costs = StepCosts()
    for q in range(1, 65):  # a memory-bound step at few tokens, compute-bound at many
        costs.observe(q, 0.002 + 0.0006 * q)
    good = [RowAcceptance(accepted=9, rejected=1) for _ in range(1)]
    assert choose_draft_lengths(good, [4], costs, 4) == [4]  # one row, drafts that usually hold
    many = [RowAcceptance(accepted=9, rejected=1) for _ in range(48)]
    assert sum(choose_draft_lengths(many, [4] * 48, costs, 4)) == 0  # a large running set drafts nothing
    row = RowAcceptance()
    for _ in range(6):  # a proposer that is never right
        lengths = choose_draft_lengths([row], [4], costs, 4)
        if lengths[0]:
            row.update(lengths[0], 0)
    assert choose_draft_lengths([row], [4], costs, 4) == [0]
    probes = [choose_draft_lengths([row], [4], costs, 4)[0] for _ in range(PROBE_EVERY)]
    assert probes.count(1) == 1 and probes.count(0) == PROBE_EVERY - 1  # probed once in a while
    fresh = [RowAcceptance() for _ in range(3)]  # new rows of a job whose drafts have failed
    assert choose_draft_lengths(fresh, [4] * 3, costs, 4, prior=0.02) == [0, 0, 0]
    assert sum(choose_draft_lengths(fresh, [4] * 3, costs, 4, prior=0.5)) > 0  # of a job at even odds: they do
    idle = [RowAcceptance(rejected=5, steps_since_draft=PROBE_EVERY) for _ in range(3)]
    assert choose_draft_lengths(idle, [4] * 3, costs, 4, prior=0.0) == [1, 0, 0]  # one probe per step at most
    assert choose_draft_lengths(idle, [4] * 3, costs, 4, prior=0.0, may_probe=False) == [0, 0, 0]


def test_speculative_config_is_checked():
    assert EngineConfig(speculative_config=SPEC).speculative_config.num_speculative_tokens == 4
    assert EngineConfig(speculative_config={"method": "suffix"}).speculative_config.suffix_decoding_max_tree_depth == 8
    for bad in ({"method": "eagle"}, {"method": "ngram", "num_speculative_tokens": 0},
                {"method": "suffix", "suffix_decoding_min_token_prob": 2},
                {"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, {"num_speculative_tokens": 2},
                {"method": "ngram", "draft_model": "x"}, "ngram"):
        with pytest.raises(ConfigError):
            EngineConfig(speculative_config=bad)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_expert_parallel_ranks_speculate_with_the_same_tokens(tiny_checkpoint, mtp_checkpoint, method):
    """N=2 ranks, each with its own scheduler and drafts against one process without
    speculation: n-gram (repetitive prompts so the lookup finds matches), and the MTP layer,
    which each rank loads whole and runs for its own rows."""
    folder = tiny_checkpoint("qwen3_moe")[0] if method == "ngram" else mtp_checkpoint("deepseek_v3")[0]
    spec = SPEC if method == "ngram" else {"method": "mtp", "num_speculative_tokens": 3}
    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5, [40, 41] * 6, [100, 101, 102, 103, 104] * 3]
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.8, seed=4, ignore_eos=True)] * 2
    plain = Engine(folder, EngineConfig(block_size=8)).generate(prompts, params)
    engine = Engine(folder, EngineConfig(expert_parallel_size=2, block_size=8, speculative_config=spec))
    try:
        spec = engine.generate(prompts, params)
        stats = engine.stats()
    finally:
        engine.close()
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert stats.num_draft_tokens > 0, "the ranks' drafts were checked"
