"""The client's transport to its stage's coordinator (``rebalance/transport.py``): both transports
make every coordinator call the client needs, with the coordinator's own parameters, and the
in-process one behaves as a Ray actor call does (a call whose caller stops waiting still runs)."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from batchgen_data.rebalance.coordinator import Coordinator
from batchgen_data.rebalance.transport import InProcessTransport, PoolTransport, RayTransport

pytestmark = pytest.mark.timeout(60)


def _params(fn) -> list[str]:
    # (``ray.remote`` adds a ``_ray_trace_ctx`` parameter to the class it wraps, in place.)
    return [name for name in inspect.signature(fn).parameters if name != "self" and not name.startswith("_ray")]


def test_every_transport_call_is_a_coordinator_call_with_its_parameters():
    calls = sorted(PoolTransport.__abstractmethods__)
    assert {"submit", "wait_batch", "lease", "give_back", "adopt", "complete", "release"} <= set(calls)
    for name in calls:
        assert _params(getattr(PoolTransport, name)) == _params(getattr(Coordinator, name)), name
        for transport in (RayTransport, InProcessTransport):
            assert _params(getattr(transport, name)) == _params(getattr(Coordinator, name)), (transport, name)
            # Sent without waiting (not a coroutine) exactly where the interface says so.
            assert (inspect.iscoroutinefunction(getattr(transport, name))
                    == inspect.iscoroutinefunction(getattr(PoolTransport, name))), (transport, name)


def test_in_process_a_batch_goes_round_and_a_wait_given_up_still_ends_in_the_coordinator():
    async def job():
        coordinator = Coordinator(lease_timeout_s=5.0)
        pool = InProcessTransport(coordinator)
        pool.register("w", True, 0.5)
        await pool.submit("b", "w", [("p", {"max_tokens": 4})])
        reply = await pool.lease("w", 4, None, 0.0, None)
        assert [item.item_id for item in reply.items] == ["b/0"]
        assert await pool.complete("w", "b/0", {"text": "r"}, 3)
        assert await pool.wait_batch("b") == [{"text": "r"}]
        # A caller that stops waiting does not cancel the coordinator's call (as over Ray): the
        # batch stays until the caller says it gave up, and then leaves.
        await pool.submit("c", "w", [("p", {"max_tokens": 4})])
        waiter = asyncio.ensure_future(pool.wait_batch("c"))
        await asyncio.sleep(0.01)
        waiter.cancel()
        await asyncio.sleep(0.01)
        assert "c" in coordinator._done_events and "c" in coordinator.pool.batches
        pool.forget_batch("c")
        await asyncio.sleep(0.01)
        assert not coordinator.pool.batches and (await pool.counters())["num_batches_dropped"] == 1

    asyncio.run(job())
