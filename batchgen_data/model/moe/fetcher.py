"""A streamed store's fetch thread: copies queued experts from the slower tier into their slots.

NOTE: one background thread does every copy, the demand queue (experts a request is waiting for,
in the order they will be read) before the ahead queue (prefetches). It takes a job under the
store's lock, copies without it (on CUDA on its own stream, after compute has finished reading the
slot's previous expert) and marks the slot ready; ``wait_row`` blocks compute until a slot is
ready. A failed copy frees its slot and is raised by the next wait or request.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable

import torch

from batchgen_data.errors import CheckpointError
from batchgen_data.model.moe.experts import ExpertWeights
from batchgen_data.model.moe.slot_pool import QUEUED, READY, Key, SlotPool
from batchgen_data.model.moe.stream_stats import StreamStats

# (layer id, expert id, pool, slot): copy that expert from the slower tier into the pool's slot.
Fill = Callable[[int, int, ExpertWeights, int], None]

_IDLE_CHECK_S = 1.0  # an idle fetch thread notices within this long that its fetcher is gone


class ExpertFetcher:
    """The fetch thread and what it works from: the demand and ahead queues of slots to fill,
    the CUDA copy stream and its events, the first copy error and whether it is closed. Shares
    the store's lock (``cond``) and adds its copy counters to the store's ``stats``."""

    def __init__(self, fill: Fill, slots: SlotPool, stats: StreamStats, cond: threading.Condition,
                 device: torch.device | str):
        self._fill = fill
        self._slots = slots
        self._pool = slots.weights
        self._state = slots.state  # read at every row of an answer: no call
        self._stats = stats
        self._cond = cond
        self._demand: deque[int] = deque()  # slots to fill now, in the order they will be read
        self._ahead: deque[int] = deque()  # slots to fill ahead of their request
        self.error: BaseException | None = None
        self.closed = False
        device = torch.device(device)
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._landed: list[torch.cuda.Event | None] = [None] * slots.num_slots  # CUDA: copy done
        self._released: torch.cuda.Event | None = None  # CUDA: compute done with the last answer
        self._thread = threading.Thread(target=_fetch_loop, args=(weakref.ref(self), cond),
                                        daemon=True, name="batchgen-expert-fetch")
        self._thread.start()

    # -- the compute thread (with the lock held, but for ``wait_row``, ``copy_now``, ``close``) --

    def queue(self, slot: int) -> None:
        """Copy into ``slot`` now: a request waits for it."""
        self._demand.append(slot)

    def queue_ahead(self, slot: int) -> None:
        """Copy into ``slot`` once the demand queue is empty."""
        self._ahead.append(slot)

    def promote(self, slot: int) -> bool:
        """Move ``slot`` from the ahead queue to the demand queue; False if it was not there."""
        if slot not in self._ahead:
            return False
        self._ahead.remove(slot)
        self._demand.append(slot)
        return True

    def cancel(self, slot: int) -> None:
        """Drop ``slot``'s copy if it has not started."""
        for queue in (self._ahead, self._demand):
            if slot in queue:
                queue.remove(slot)

    def release(self) -> None:
        """Compute is done with the previous answer: on CUDA, copies into its slots wait for the
        compute stream to pass this point."""
        if self._stream is not None:
            self._released = torch.cuda.current_stream(self._pool.w_down.device).record_event()

    def raise_if_failed(self) -> None:
        if self.closed:  # no fetch thread would serve the request: fail instead of waiting forever
            raise RuntimeError(
                "the streamed expert store is closed (Engine.close()); load the model again"
            )
        if self.error is not None:
            raise CheckpointError(
                f"fetching an expert from the checkpoint failed: {self.error}"
            ) from self.error

    def wait_row(self, slot: int) -> None:
        """Block until the slot's copy has landed (on CUDA: make the compute stream wait for it)."""
        if self._state[slot] != READY:
            start = time.perf_counter()
            with self._cond:
                while self._state[slot] != READY:
                    self.raise_if_failed()
                    self._cond.wait()
            self._stats.wait_s += time.perf_counter() - start
        event = self._landed[slot]
        if event is not None:
            torch.cuda.current_stream(self._pool.w_down.device).wait_event(event)

    def copy_now(self, keys: list[Key]) -> float:
        """Copy ``keys`` into slots 0, 1, ... on the calling thread, past the queues (load time,
        before any request); returns the seconds the copies took."""
        start = time.perf_counter()
        for slot, key in enumerate(keys):
            self._fill(*key, self._pool, slot)
        if self._stream is not None:
            torch.cuda.synchronize(self._pool.w_down.device)
        return time.perf_counter() - start

    def close(self) -> None:
        """Stop the thread (it also stops by itself once the fetcher is garbage-collected)."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    # -- the fetch thread -----------------------------------------------------------------------

    def next_job(self) -> tuple[int, Key, bool] | None:
        """(slot, key, ahead) of the next queued copy, marked loading; None if none is queued."""
        for queue, ahead in ((self._demand, False), (self._ahead, True)):
            while queue:
                slot = queue.popleft()
                if self._state[slot] == QUEUED:
                    self._slots.mark_loading(slot)
                    return slot, self._slots.key[slot], ahead
        return None

    def copy(self, slot: int, key: Key, ahead: bool) -> None:
        """Run one job, without the lock while copying."""
        start, error = time.perf_counter(), None
        try:
            if self._stream is None:
                self._fill(*key, self._pool, slot)
            else:
                with torch.cuda.stream(self._stream):
                    if self._released is not None:
                        self._stream.wait_event(self._released)  # compute has read the slot
                    self._fill(*key, self._pool, slot)
                    self._landed[slot] = self._stream.record_event()
        except Exception as err:  # surfaced to the compute thread by the next wait or request
            error = err
        seconds = time.perf_counter() - start
        with self._cond:
            if error is not None:
                self.error = error
                self._slots.free(slot)
            else:
                self._slots.mark_ready(slot)
                self._stats.bytes_fetched += self._slots.bytes_per_slot
                self._stats.fetch_s += seconds
                self._stats.num_prefetched += ahead
            self._cond.notify_all()


def _fetch_loop(fetcher_ref: weakref.ref, cond: threading.Condition) -> None:
    """The fetch thread: run queued jobs, demand first. It holds no reference to the fetcher
    while idle, so a dropped store (and its fetcher) is collected and the thread exits."""
    while True:
        with cond:
            fetcher = fetcher_ref()
            if fetcher is None or fetcher.closed:
                return
            job = fetcher.next_job()
            if job is None:
                del fetcher
                cond.wait(_IDLE_CHECK_S)
                continue
        fetcher.copy(*job)
        del fetcher
