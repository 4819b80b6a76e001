"""Leases on events (``distributed/coordinator.py``), with scripted load reports and no model or
Ray: a lease call that gets nothing is held until an item is pending for it, a give-back is due,
a sequence of its engine ends, or the stage empties, and otherwise for a bounded wait; an actor
whose engine has room and nothing to take makes a call per wait bound, not one per poll."""

from __future__ import annotations

import asyncio
import time

import pytest
from pool_helpers import StalledEngine

from batchgen_data.engine.sampling_params import SamplingParams
from batchgen_data.rebalance.coordinator import Coordinator
from batchgen_data.rebalance.core.progress import SeqProgress, WorkerProgress
from batchgen_data.rebalance.core.step_model import StepModel, StepSums
from batchgen_data.rebalance.transport import InProcessTransport

pytestmark = pytest.mark.timeout(60)


def _rows(n: int, max_tokens: int = 4) -> list[tuple[str, dict]]:
    return [(f"prompt {i}", {"max_tokens": max_tokens}) for i in range(n)]


def _calibrated(base_s: float = 0.008, per_seq_s: float = 0.003) -> StepSums:
    sums = StepSums()
    sums.calibrate(StepModel(base_s, per_seq_s))
    return sums


def _report(running: int = 0, generated: int = 56, max_tokens: int = 256, slots: int = 8) -> WorkerProgress:
    seqs = tuple(SeqProgress(generated, max_tokens, 20 + generated, True, request_id=i) for i in range(running))
    return WorkerProgress(slots, seqs, _calibrated(), move_s_per_token=1e-5, move_latency_s=0.05)


async def _timed(awaitable):
    started = time.monotonic()
    reply = await awaitable
    return reply, time.monotonic() - started


def test_a_held_lease_returns_when_an_item_arrives_and_otherwise_at_its_bound():
    async def job():
        coordinator = Coordinator(lease_timeout_s=30.0)  # holds calls up to 10 s
        held = asyncio.ensure_future(_timed(coordinator.lease("w", 4, None, 5.0)))
        await asyncio.sleep(0.2)
        assert not held.done()  # nothing pending: no reply, no polling
        await coordinator.submit("running", "owner", _rows(8))  # the owner runs 8 rows of its own ...
        assert len((await coordinator.lease("owner", 8, None)).items) == 8
        await coordinator.lease("owner", 0, _report(running=8))  # ... its engine is full: new rows would wait
        await coordinator.submit("batch", "owner", _rows(2))
        reply, seconds = await held
        assert [i.item_id for i in reply.items] == ["batch/0", "batch/1"]
        assert 0.2 <= seconds < 0.5 and reply.held_s == pytest.approx(seconds, abs=0.05)
        # Nothing comes: the call returns empty at its bound, which the coordinator caps.
        reply, seconds = await _timed(coordinator.lease("w", 4, None, 0.3))
        assert reply.items == [] and 0.3 <= seconds < 0.6
        short = Coordinator(lease_timeout_s=0.6)  # a third of the lease timeout: 0.2 s
        reply, seconds = await _timed(short.lease("w", 4, None, 5.0))
        assert 0.2 <= seconds < 0.5

    asyncio.run(job())


def test_a_held_lease_returns_when_a_give_back_is_due():
    async def job():
        coordinator = Coordinator(lease_timeout_s=30.0)
        await coordinator.submit("batch", "busy", _rows(4, max_tokens=256))
        assert len((await coordinator.lease("busy", 4, None)).items) == 4
        # The busy worker's engine is full of long rows: it holds a call asking for nothing.
        held = asyncio.ensure_future(_timed(coordinator.lease("busy", 0, _report(running=4), 5.0)))
        await asyncio.sleep(0.2)
        assert not held.done()  # nobody to give to yet
        # An idle worker asks for work: halving the busy running set pays (calibrated slope).
        idle = asyncio.ensure_future(coordinator.lease("idle", 8, _report(running=0), 5.0))
        reply, seconds = await held
        assert len(reply.give_back) == 2 and seconds < 0.5
        assert coordinator.pool.counters.num_moves_planned == 2
        idle.cancel()

    asyncio.run(job())


def test_a_full_engines_held_lease_returns_when_one_of_its_sequences_ends():
    async def job():
        coordinator = Coordinator(lease_timeout_s=30.0)
        await coordinator.submit("batch", "w", _rows(3))
        first, second, third = (await coordinator.lease("w", 3, None)).items
        assert (await coordinator.lease("w", 1, None)).num_outstanding == 3
        await coordinator.submit("running", "owner", _rows(8))  # the owner runs 8 rows of its own:
        owners = (await coordinator.lease("owner", 8, None)).items
        await coordinator.lease("owner", 0, _report(running=8))  # full, its next row would wait there
        await coordinator.submit("more", "owner", _rows(1))  # pending, but w has no room for it
        held = asyncio.ensure_future(_timed(coordinator.lease("w", 0, None, 5.0, 4)))
        await asyncio.sleep(0.2)
        assert not held.done()
        await coordinator.complete("w", first.item_id, "r")  # a slot freed: w asks again, with room
        reply, seconds = await held
        assert reply.items == [] and seconds < 0.5
        assert [i.item_id for i in (await coordinator.lease("w", 1, None)).items] == ["more/0"]
        for item in owners:
            await coordinator.complete("owner", item.item_id, "r")
        # The stage empties: a held call of a worker that last saw work outstanding returns.
        held = asyncio.ensure_future(_timed(coordinator.lease("w", 4, None, 5.0, 3)))
        await asyncio.sleep(0.05)  # held before the results come (one arriving first ends the next call)
        for item in (second, third):
            await coordinator.complete("w", item.item_id, "r")
        await asyncio.sleep(0.1)
        assert not held.done()  # one still outstanding
        await coordinator.complete("w", "more/0", "r")
        reply, seconds = await held
        assert reply.num_outstanding == 0 and seconds < 0.5

    asyncio.run(job())


def test_an_actor_with_room_and_nothing_to_take_does_not_poll():
    """Issue #33: with the engine never full, an actor asked the coordinator every 50 ms
    (148-262 lease calls a run). Now it waits in one held call per wait bound, and an item
    submitted reaches it in one message."""
    from batchgen_data.rebalance.client import RebalanceClient

    async def job():
        coordinator = Coordinator(lease_timeout_s=3.0)  # holds calls up to 1 s
        engine = StalledEngine(max_running_seqs=8)
        client = RebalanceClient(engine, "stage", 3.0, InProcessTransport(coordinator), calibrate=False)
        params = [SamplingParams(max_tokens=4)]
        call = asyncio.ensure_future(client.run_batch(["its own row"], params))  # runs, never ends
        await asyncio.sleep(0.3)
        assert engine.prompts == ["its own row"]
        calls_before = coordinator.num_lease_calls
        await asyncio.sleep(2.5)  # room for 7 more, nothing pending
        idle_calls = coordinator.num_lease_calls - calls_before
        assert idle_calls <= 4, idle_calls  # one per held bound (~1 s); polling every 50 ms made 50
        await coordinator.submit("running", "other", _rows(8))  # another actor runs 8 rows of its own:
        assert len((await coordinator.lease("other", 8, None)).items) == 8
        await coordinator.lease("other", 0, _report(running=8))  # full, its next row would wait there
        submitted = time.monotonic()
        await coordinator.submit("theirs", "other", _rows(1))
        while len(engine.prompts) < 2 and time.monotonic() - submitted < 2.0:
            await asyncio.sleep(0.005)
        assert engine.prompts[-1] == "prompt 0" and time.monotonic() - submitted < 0.2
        tasks = client.background_tasks()
        for task in (call, *tasks):
            task.cancel()
        await asyncio.sleep(0.01)
        call.cancel()  # again: its last open call waits for its (stalled) items in a finally
        await asyncio.gather(call, *tasks, return_exceptions=True)

    asyncio.run(job())


def test_a_wake_that_arrives_before_its_call_is_held_still_ends_it():
    """An async actor may start a caller's calls out of order: a wake the worker sent after its
    lease call (its rows outside the pool ended) can run first. Seen on the skew grid as a 5 s
    idle hold with rows pending; now the call returns as soon as it is held, and only that one."""
    async def job():
        coordinator = Coordinator(lease_timeout_s=30.0)
        await coordinator.wake("w")
        reply, seconds = await _timed(coordinator.lease("w", 0, None, 5.0))
        assert reply.items == [] and seconds < 0.2
        reply, seconds = await _timed(coordinator.lease("w", 0, None, 0.3))  # consumed: held again
        assert 0.3 <= seconds < 0.6

    asyncio.run(job())


def test_a_result_that_arrives_before_the_next_call_still_ends_it():
    """A worker's result reaches the coordinator before its next lease call, which counted its
    room from a snapshot taken before that sequence ended (room 0): the call returns at once
    instead of holding for its bound with the slot free."""
    async def job():
        coordinator = Coordinator(lease_timeout_s=30.0)
        await coordinator.submit("batch", "w", _rows(2))
        first, _ = (await coordinator.lease("w", 2, None)).items
        await coordinator.complete("w", first.item_id, "r")  # no call of w is held now
        reply, seconds = await _timed(coordinator.lease("w", 0, None, 5.0))
        assert reply.items == [] and seconds < 0.2

    asyncio.run(job())
