"""Scheduler properties with a fake model (no torch): exactly-once, budget, no starvation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen_data.config import EngineConfig
from batchgen_data.engine.core.runner_output import ModelRunnerOutput
from batchgen_data.engine.sampling_params import SamplingParams
from batchgen_data.engine.core.scheduler import Scheduler
from batchgen_data.engine.core.sequence import Sequence, SequenceStatus
from batchgen_data.engine.core.suspend_policy import pick_victim

EOS = 3


def _fake_tokens(out) -> list[int]:
    """A deterministic 'model': the next token depends only on the sequence and its progress."""
    return [
        EOS if (s.request_id * 7 + s.num_generated) % 23 == 0 else 10 + (s.request_id + s.num_generated) % 50
        for s, smp in zip(out.seqs, out.samples)
        if smp
    ]


def _fake_run(out, tokens: list[int] | None = None) -> ModelRunnerOutput:
    """A fake runner's answer: the tokens, and host KV for what it swapped out (unless swapped
    back in within the same step, which must find the KV it just read)."""
    read = {seq.request_id: object() for seq, _ in out.swap_out}
    for seq, kv in out.swap_in:
        assert kv is not None or seq.request_id in read, "swapped in without its KV"
        read.pop(seq.request_id, None)
    tokens = _fake_tokens(out) if tokens is None else tokens
    return ModelRunnerOutput(req_ids=[s.request_id for s, smp in zip(out.seqs, out.samples) if smp],
                             sampled_token_ids=tokens, host_kv=read)


@st.composite
def scenarios(draw):
    block_size = draw(st.integers(1, 8))
    num_blocks = draw(st.integers(2, 40))
    capacity = num_blocks * block_size
    max_num_seqs = draw(st.integers(1, 12))
    config = EngineConfig(
        max_num_seqs=max_num_seqs,
        attention_batch_size=draw(st.integers(1, 12)),
        max_num_batched_tokens=draw(st.integers(max_num_seqs, 64)),
        block_size=block_size,
        swap_space_bytes=draw(st.sampled_from([0, 50, 10_000])),
        suspend_policy=draw(st.sampled_from(["most_progress", "shortest_first"])),
        refill_threshold=draw(st.sampled_from([0.25, 0.75, 1.0])),
        enable_prefix_caching=draw(st.booleans()),
    )
    requests = []
    for _ in range(draw(st.integers(1, 25))):
        prompt_len = draw(st.integers(1, max(1, capacity - 1)))
        max_tokens = draw(st.integers(1, max(1, capacity - prompt_len)))
        requests.append((prompt_len, max_tokens, draw(st.booleans())))
    return config, num_blocks, requests


def _check_invariants(sched: Scheduler, out, num_blocks: int) -> None:
    owned = [b for s in sched.running for b in s.block_ids]
    if sched.config.enable_prefix_caching:  # a cached block is shared: one reference per owner
        assert all(sched.kv.ref_count(b) == owned.count(b) for b in set(owned)), "reference counts drift"
        shared = [b for b in set(owned) if owned.count(b) > 1]
        assert all(sched.kv.pool._name_of[b] is not None for b in shared), "an uncached block is shared"
    else:
        assert len(owned) == len(set(owned)), "a KV block is owned twice"
    assert len(set(owned)) + sched.kv.num_free == num_blocks, "blocks leaked or double-freed"
    assert len(sched.running) <= sched.config.max_num_seqs
    assert out.num_tokens <= sched.config.max_num_batched_tokens
    for seq, qlen in zip(out.seqs, out.query_lens):
        assert seq.status is SequenceStatus.RUNNING
        assert len(seq.block_ids) * sched.kv.block_size >= seq.num_computed_tokens + qlen
    for seq in sched.suspended:
        assert not seq.block_ids


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_every_sequence_finishes_exactly_once_within_budget(scenario):
    config, num_blocks, requests = scenario
    sched = Scheduler(config, num_blocks, max_model_len=10**6, kv_bytes_per_token=1, eos_token_ids=frozenset({EOS}))
    seqs = []
    for i, (prompt_len, max_tokens, ignore_eos) in enumerate(requests):
        seq = Sequence(i, [5] * prompt_len, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos), seed=i)
        sched.add(seq)
        seqs.append(seq)
    total_work = sum(p + m for p, m, _ in requests)
    finished: list[Sequence] = []
    for step in range(20 * total_work + 100):  # bound: nothing may starve or livelock
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        _check_invariants(sched, out, num_blocks)
        assert out.is_progress, "a step with unfinished work scheduled nothing"
        # Swapped-out KV must be captured before its pages are reused: model the runner.
        finished += sched.update(out, _fake_run(out), now_s=float(step))
        for seq in sched.suspended:
            assert (seq.host_kv is not None) == (seq.num_computed_tokens > 0), "host KV lost or stale"
    else:
        raise AssertionError("scheduler did not finish the workload in the step bound")
    assert sorted(s.request_id for s in finished) == list(range(len(requests)))
    assert sched.kv.num_free == num_blocks
    for seq, (_, max_tokens, ignore_eos) in zip(seqs, requests):
        assert seq.status is SequenceStatus.FINISHED
        assert 1 <= seq.num_generated <= max_tokens
        if seq.finish_reason == "length":
            assert seq.num_generated == max_tokens
        else:
            assert seq.output_token_ids[-1] == EOS and not ignore_eos


def test_sequence_transitions_are_enforced():
    seq = Sequence(0, [1], SamplingParams(), seed=0)
    seq.transition(SequenceStatus.RUNNING)
    seq.transition(SequenceStatus.SUSPENDED)
    seq.transition(SequenceStatus.RUNNING)
    seq.finish("stop", 1.0)
    try:
        seq.transition(SequenceStatus.RUNNING)
    except RuntimeError as err:
        assert "FINISHED -> RUNNING" in str(err)
    else:
        raise AssertionError("a finished sequence was allowed to run again")


def test_most_progress_policy_suspends_least_advanced_and_resumes_most_advanced_first():
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, block_size=1, suspend_policy="most_progress")
    sched = Scheduler(config, 8, max_model_len=100, kv_bytes_per_token=1)
    a = Sequence(0, [5], SamplingParams(max_tokens=50, ignore_eos=True), seed=0)
    b = Sequence(1, [5], SamplingParams(max_tokens=50, ignore_eos=True), seed=1)
    for s in (a, b):
        sched.add(s)
    out = sched.schedule()
    sched.update(out, _fake_run(out, [7, 7]), 0.0)
    a.output_token_ids += [7, 7, 7]  # a has made more progress than b
    a.num_computed_tokens = a.num_tokens - 1
    sched.kv.append_slots(a, 3)
    victim = pick_victim(sched.running, config.suspend_policy)
    assert victim is b


def test_waiting_work_that_all_fits_starts_without_waiting_for_the_refill_threshold():
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, block_size=4, refill_threshold=0.5)
    sched = Scheduler(config, 64, max_model_len=100, kv_bytes_per_token=1)
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    for i in range(3):
        sched.add(Sequence(i, [5, 6], params, seed=i))
    out = sched.schedule()
    sched.update(out, _fake_run(out, [7] * len(out.seqs)), 0.0)
    assert len(sched.running) == 3
    # 3 of 4 running is above the threshold (2), but the one waiting row fits the free slot:
    # it starts now instead of when the running set falls to 2.
    sched.add(Sequence(3, [5, 6], params, seed=3))
    sched.add(Sequence(4, [5, 6], params, seed=4))
    out = sched.schedule()
    assert len(sched.running) == 3  # two waiting rows do not fit one slot: the threshold holds
    sched.update(out, _fake_run(out, [7] * len(out.seqs)), 0.0)
    sched.abort(sched.waiting[-1], "test", 0.0)
    sched.schedule()
    assert len(sched.running) == 4


def _small_scheduler(num_blocks=16, swap_space_bytes=10_000) -> Scheduler:
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, block_size=2, swap_space_bytes=swap_space_bytes)
    return Scheduler(config, num_blocks, max_model_len=100, kv_bytes_per_token=3)


def test_export_takes_a_sequence_out_of_any_queue_and_frees_what_it_held():
    sched = _small_scheduler()
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    running, waiting = Sequence(0, [5, 6, 7], params, seed=0), Sequence(1, [5], params, seed=1)
    sched.add(running)
    out = sched.schedule()
    sched.update(out, _fake_run(out, [9]), 0.0)
    sched.add(waiting)
    assert running.status is SequenceStatus.RUNNING and running.block_ids

    state = sched.export(running, with_kv=True, kv="pages")
    assert state.kv == "pages" and state.output_token_ids == [9] and state.prompt_token_ids == [5, 6, 7]
    assert running.status is SequenceStatus.EXPORTED and not running.block_ids
    assert sched.kv.num_free == sched.kv.num_blocks and running not in sched.running

    assert sched.export(waiting).kv is None
    assert waiting.status is SequenceStatus.EXPORTED and not sched.has_unfinished()
    with pytest.raises(RuntimeError, match="EXPORTED"):
        sched.export(waiting)


def test_imported_kv_that_does_not_fit_the_host_pool_is_recomputed_instead():
    """An import's KV counts against ``swap_space_bytes`` like a swap-out's (it used to be added
    to the host pool unchecked, past the budget) when it cannot get pages at once."""
    from batchgen_data.engine.core.sequence import SequenceState

    class FakeKV:
        shape = (3, 8)

    sched = _small_scheduler(swap_space_bytes=10)  # 3 bytes per token: room for 3 tokens, not 6
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    for i in range(sched.config.max_num_seqs):  # every running slot taken: imports must wait
        sched.add(Sequence(100 + i, [5], params, seed=i))
    sched.schedule()
    first = sched.import_state(SequenceState(9, [1, 2], [3, 4], params, 5, kv=FakeKV()), request_id=1, now_s=0.0)
    second = sched.import_state(SequenceState(9, [1, 2], [3, 4], params, 5, kv=FakeKV()), request_id=2, now_s=0.0)
    assert first.status is second.status is SequenceStatus.SUSPENDED
    assert first.num_computed_tokens == 3 and first.host_kv is not None
    assert second.num_computed_tokens == 0 and second.host_kv is None  # recomputed: it did not fit
    assert sched.host_bytes_used == 9 <= sched.config.swap_space_bytes


def test_import_resumes_mid_generation_through_swap_in_or_recompute_and_counts_host_bytes():
    from batchgen_data.engine.core.sequence import SequenceState

    class FakeKV:  # what a real KV tensor reports: [tokens, values per token]
        shape = (3, 8)

    sched = _small_scheduler()
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    fresh = sched.import_state(SequenceState(9, [1, 2], [], params, 5), request_id=40, now_s=1.0)
    assert fresh.status is SequenceStatus.WAITING and fresh.request_id == 40
    with_kv = sched.import_state(SequenceState(9, [1, 2], [3, 4], params, 5, kv=FakeKV()), request_id=41, now_s=1.0)
    # A slot and pages are free: it gets its pages now, and the next step restores its KV into
    # them (nothing held in the host pool meanwhile).
    assert with_kv.status is SequenceStatus.RUNNING and with_kv.num_computed_tokens == 3
    assert sched.host_bytes_used == 0 and with_kv.host_kv is None
    without = sched.import_state(SequenceState(9, [1, 2], [3], params, 5), request_id=42, now_s=1.0)
    assert without.status is SequenceStatus.SUSPENDED and without.num_computed_tokens == 0

    out = sched.schedule()  # the swap-in restores the imported KV, the rest recompute
    assert [(seq, kv.shape) for seq, kv in out.swap_in] == [(with_kv, (3, 8))]
    assert sched.host_bytes_used == 0
    assert {s.request_id for s in out.seqs} == {40, 41, 42}
    assert sched.stats.num_resumed_swap == 1 and sched.stats.num_resumed_recompute == 1


def test_abort_frees_pages_and_host_bytes_whatever_the_queue():
    sched = _small_scheduler()
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    running = Sequence(0, [5, 6, 7], params, seed=0)
    sched.add(running)
    sched.schedule()

    class FakeKV:
        shape = (2, 8)

    from batchgen_data.engine.core.sequence import SequenceState

    suspended = sched.import_state(SequenceState(1, [1, 2], [3], params, 5, kv=FakeKV()), request_id=1, now_s=0.0)
    waiting = Sequence(2, [5], params, seed=2)
    sched.add(waiting)
    for seq in (running, suspended, waiting):
        sched.abort(seq, "cancelled", 2.0)
        assert seq.status is SequenceStatus.FINISHED and seq.finish_reason == "error" and seq.error == "cancelled"
    assert not sched.has_unfinished() and sched.host_bytes_used == 0
    assert sched.kv.num_free == sched.kv.num_blocks


def test_transition_table_declares_every_move_the_engine_makes_and_no_other():
    from batchgen_data.engine.core.sequence import EXPORTABLE, TRANSITIONS

    S = SequenceStatus
    allowed = {(a, b) for a, targets in TRANSITIONS.items() for b in targets}
    assert allowed == {
        (S.WAITING, S.WAITING_FOR_GRAMMAR),
        (S.WAITING_FOR_GRAMMAR, S.WAITING), (S.WAITING_FOR_GRAMMAR, S.SUSPENDED),
        (S.WAITING_FOR_GRAMMAR, S.FINISHED), (S.WAITING_FOR_GRAMMAR, S.EXPORTED),
        (S.WAITING, S.RUNNING), (S.WAITING, S.SUSPENDED), (S.WAITING, S.FINISHED), (S.WAITING, S.EXPORTED),
        (S.RUNNING, S.SUSPENDED), (S.RUNNING, S.FINISHED), (S.RUNNING, S.EXPORTED),
        (S.SUSPENDED, S.RUNNING), (S.SUSPENDED, S.FINISHED), (S.SUSPENDED, S.EXPORTED),
    }
    assert EXPORTABLE == {S.WAITING_FOR_GRAMMAR, S.WAITING, S.RUNNING, S.SUSPENDED}
    for status in (S.FINISHED, S.EXPORTED):  # final
        seq = Sequence(0, [1], SamplingParams(), seed=0)
        seq.status = status
        for target in S:
            with pytest.raises(RuntimeError, match="illegal transition"):
                seq.transition(target)
