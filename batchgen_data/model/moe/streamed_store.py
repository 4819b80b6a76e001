"""A bounded pool of expert slots, filled from a slower tier on demand and ahead of use.

For models larger than memory, the routed experts stay in a slower tier: the checkpoint's
memory-mapped safetensors on CPU (page cache or disk; file pages, not anonymous memory), or a
pinned host copy when the pool is on a GPU. Only ``capacity`` experts at a time occupy the
pool's preallocated slots, so the store's memory is fixed at load whatever the model's size.
Shape legend: S = slots, E = experts per layer, H and F as in ``experts.py``.

NOTE: the fetch loop. ``weights(l, ids)`` pins the slots already holding layer l's requested
experts (hits, including copies fetched ahead and still in flight), takes a victim slot for each
missing one and queues its copy on the demand queue in id order (both backends run experts in id
order), then queues prefetches: the experts each upcoming layer asked for last time, hottest first,
as many as the slots the current layer leaves hold. It returns at once; the answer's ``row(e)``
blocks until expert e's copy has landed, so the backend computes expert e while later ones are
still being copied. One background thread does every copy (demand queue first), so fetching also
overlaps attention, routers and the other layers' GEMMs. Victims (``eviction="next_use"``): the
unpinned slot whose layer comes back latest in the layer cycle, least recently used among equals; a
prefetch may only evict a slot used later than the expert it fetches, so fetching ahead never
evicts what is needed sooner. Layers run in a fixed cycle, for which plain LRU (``eviction="lru"``,
prefetching only the next layer) evicts exactly the experts needed soonest once the model is larger
than the pool.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchgen_data.errors import CheckpointError
from batchgen_data.model.moe.experts import ExpertWeights

# (layer id, expert id, pool, slot): copy that expert from the slower tier into the pool's slot.
Fill = Callable[[int, int, ExpertWeights, int], None]
Key = tuple[int, int]  # (layer id, expert id)
EVICTION_POLICIES = ("next_use", "lru")

_FREE, _QUEUED, _LOADING, _READY = range(4)  # a slot's state
_IDLE_CHECK_S = 1.0  # an idle fetch thread notices within this long that its store is gone
_HEAT_DECAY = 0.5  # per call of a layer: how fast an expert's request history fades
_PREDICT_HEAT = 1.0  # prefetch the experts asked for in the last call of their layer


@dataclass(slots=True)
class StreamStats:
    """Cumulative counters of a streamed store."""

    num_hits: int = 0  # requested experts already in a slot, or being copied there ahead of use
    num_misses: int = 0  # requested experts copied on demand
    num_prefetched: int = 0  # copies made ahead of a request
    bytes_fetched: int = 0
    fetch_s: float = 0.0  # seconds the fetch thread spent copying
    wait_s: float = 0.0  # seconds compute waited for a copy to land

    @property
    def hit_rate(self) -> float:
        total = self.num_hits + self.num_misses
        return self.num_hits / total if total else 0.0


class StreamedExpertStore:
    """``capacity`` expert slots over the sparse layers ``layer_ids``; ``fill`` copies one expert
    from the slower tier into a slot. See the module docstring for the fetch loop."""

    def __init__(self, fill: Fill, layer_ids: list[int], num_experts: int, num_slots: int, hidden: int, ffn: int,
                 has_bias: bool, dtype: torch.dtype, device: torch.device | str, eviction: str = "next_use",
                 prefetch: bool = True):
        if eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {EVICTION_POLICIES}, got {eviction!r}")
        if num_slots < 1:
            raise ValueError(f"a streamed store needs at least one slot, got {num_slots}")
        self.num_experts, self.capacity = num_experts, num_slots
        self.eviction, self.prefetch = eviction, prefetch
        self._fill = fill
        self.pool = ExpertWeights.empty(num_slots, hidden, ffn, has_bias, dtype, device)
        for tensor in (self.pool.w_gate_up, self.pool.w_down, self.pool.b_gate_up, self.pool.b_down):
            if tensor is not None:
                tensor.zero_()  # touch every page now: the pool's memory is resident from load on
        self.bytes_per_expert = self.pool.nbytes // num_slots
        self._layers = tuple(layer_ids)
        self._pos = {layer: i for i, layer in enumerate(self._layers)}
        self._all = tuple(range(num_experts))
        self._key: list[Key | None] = [None] * num_slots
        self._state = [_FREE] * num_slots
        self._used = [0] * num_slots  # tick of the slot's last request
        self._slot_of: dict[Key, int] = {}
        self._pinned: set[int] = set()  # slots of the answer in use
        self._demand: deque[int] = deque()  # slots to fill now, in the order they will be read
        self._ahead: deque[int] = deque()  # slots to fill ahead of their request
        self._heat = {layer: [0.0] * num_experts for layer in self._layers}
        self._likely: dict[int, list[int]] = {layer: [] for layer in self._layers}  # prefetch order per layer
        self._candidates: deque[int] | None = None  # victims for the request in hand, first to evict first
        self._current = len(self._layers) - 1  # position of the last layer asked for: layer 0 comes next
        self._tick = 0
        self.stats = StreamStats()
        self._error: BaseException | None = None
        self._closed = False
        self._cond = threading.Condition()
        device = torch.device(device)
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._landed: list[torch.cuda.Event | None] = [None] * num_slots  # CUDA: the copy's event
        self._released: torch.cuda.Event | None = None  # CUDA: compute done with the last answer
        self._thread = threading.Thread(target=_fetch_loop, args=(weakref.ref(self), self._cond), daemon=True,
                                        name="batchgen-expert-fetch")
        self._thread.start()

    # -- the ExpertStore contract ---------------------------------------------------------------

    def owned(self, layer_id: int) -> tuple[int, ...]:
        return self._all

    def layer_ids(self) -> tuple[int, ...]:
        return self._layers

    @property
    def nbytes(self) -> int:
        """The pool's bytes (fixed at load)."""
        return self.pool.nbytes

    def weights(self, layer_id: int, expert_ids: list[int] | None = None) -> ExpertWeights:
        if expert_ids is None or len(expert_ids) > self.capacity:
            asked = "every expert" if expert_ids is None else f"{len(expert_ids)} experts"
            raise ValueError(f"a streamed store answers for at most {self.capacity} experts at a time, asked for {asked}")
        row_of = torch.full((self.num_experts,), -1, dtype=torch.long)  # [E]
        if expert_ids:
            with self._cond:
                self._raise_if_failed()
                self._release()
                self._current, self._tick = self._pos[layer_id], self._tick + 1
                self._candidates = None  # ordered at the first miss
                for expert_id in sorted(expert_ids):
                    row_of[expert_id] = self._pin((layer_id, expert_id))
                self._note_request(layer_id, expert_ids)
                if self.prefetch:
                    self._queue_ahead()
                self._cond.notify_all()
        pool = self.pool
        return ExpertWeights(pool.w_gate_up, pool.w_down, pool.b_gate_up, pool.b_down, row_of, self._wait_row)

    # -- load time ------------------------------------------------------------------------------

    def warm(self) -> float:
        """Fill every slot with the experts first in line (layer 0's first), timing the copies;
        returns the measured fetch rate in bytes/s (what the engine plans the running set with)."""
        keys = [(layer, e) for layer in self._layers for e in self._all][: self.capacity]
        start = time.perf_counter()
        for slot, key in enumerate(keys):
            self._fill(*key, self.pool, slot)
        if self._stream is not None:
            torch.cuda.synchronize(self.pool.w_down.device)
        seconds = time.perf_counter() - start
        with self._cond:
            for slot, key in enumerate(keys):
                self._assign(slot, key)
                self._state[slot] = _READY
        return len(keys) * self.bytes_per_expert / max(seconds, 1e-9)

    def close(self) -> None:
        """Stop the fetch thread (it also stops by itself once the store is garbage-collected)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    # -- slots (called with the lock held) ------------------------------------------------------

    def _pin(self, key: Key) -> int:
        slot = self._slot_of.get(key)
        if slot is None:
            self.stats.num_misses += 1
            slot = self._take(key)
            self._demand.append(slot)
        elif self._state[slot] == _QUEUED and slot in self._ahead:  # asked for before its copy began
            self.stats.num_misses += 1
            self._ahead.remove(slot)
            self._demand.append(slot)
        else:
            self.stats.num_hits += 1
        self._pinned.add(slot)
        self._used[slot] = self._tick
        return slot

    def _take(self, key: Key) -> int:
        """A slot for ``key``: free or evictable, waiting for an in-flight copy to land if every
        unpinned slot is loading."""
        while True:
            if self._candidates is None:
                self._candidates = deque(self._victims())
            while self._candidates:
                slot = self._candidates.popleft()
                if slot not in self._pinned and self._state[slot] != _LOADING:
                    self._assign(slot, key)
                    return slot
            self._candidates = None
            self._cond.wait()
            self._raise_if_failed()

    def _victims(self) -> list[int]:
        """Unpinned slots not being copied into, the first to evict first."""
        slots = [s for s in range(self.capacity) if s not in self._pinned and self._state[s] != _LOADING]
        return sorted(slots, key=self._evict_order, reverse=True)

    def _evict_order(self, slot: int) -> tuple[float, int]:
        if self._key[slot] is None:
            return (float("inf"), 0)
        if self.eviction == "lru":
            return (0.0, -self._used[slot])
        return (float(self._distance(self._key[slot][0])), -self._used[slot])

    def _distance(self, layer_id: int) -> int:
        """Layers from the current one until ``layer_id`` runs again (1 .. number of layers)."""
        return (self._pos[layer_id] - self._current - 1) % len(self._layers) + 1

    def _assign(self, slot: int, key: Key) -> None:
        old = self._key[slot]
        if old is not None:
            del self._slot_of[old]
        if self._state[slot] == _QUEUED:  # a copy not started yet: cancelled
            for queue in (self._ahead, self._demand):
                if slot in queue:
                    queue.remove(slot)
        self._key[slot], self._state[slot] = key, _QUEUED
        self._slot_of[key] = slot

    def _note_request(self, layer_id: int, expert_ids: list[int]) -> None:
        heat = self._heat[layer_id]
        for e in self._all:
            heat[e] *= _HEAT_DECAY
        for e in expert_ids:
            heat[e] += 1.0
        self._likely[layer_id] = sorted((e for e in self._all if heat[e] >= _PREDICT_HEAT), key=lambda e: -heat[e])

    def _queue_ahead(self) -> None:
        """Queue the upcoming layers' likely experts (those asked for recently, hottest first),
        no more than the slots the current answer leaves, so each stays until it is used, and
        only into slots whose next use comes later; ``lru``: the next layer's, into LRU victims."""
        candidates = self._victims()
        num_layers = len(self._layers)
        horizon = 2 if self.eviction == "lru" else num_layers
        room, taken = self.capacity - len(self._pinned), 0
        for step in range(1, horizon):
            layer = self._layers[(self._current + step) % num_layers]
            for e in self._likely[layer]:
                if room == 0:
                    return  # the slots left are all spoken for by nearer layers' experts
                room -= 1
                if (layer, e) in self._slot_of:
                    continue
                victim = candidates[taken] if taken < len(candidates) else None
                if victim is None or (self.eviction == "next_use" and self._evict_order(victim)[0] <= step):
                    return  # every slot left is needed no later than this expert
                taken += 1
                self._assign(victim, (layer, e))
                self._ahead.append(victim)

    def _release(self) -> None:
        """The previous answer is done with: its slots may be evicted (on CUDA, once the compute
        stream has passed this point)."""
        self._pinned.clear()
        if self._stream is not None:
            self._released = torch.cuda.current_stream(self.pool.w_down.device).record_event()

    def _raise_if_failed(self) -> None:
        if self._closed:  # no fetch thread would serve the request: fail instead of waiting forever
            raise RuntimeError("the streamed expert store is closed (Engine.close()); load the model again")
        if self._error is not None:
            raise CheckpointError(f"fetching an expert from the checkpoint failed: {self._error}") from self._error

    # -- the fetch thread -----------------------------------------------------------------------

    def _next_job(self) -> tuple[int, Key, bool] | None:
        for queue, ahead in ((self._demand, False), (self._ahead, True)):
            while queue:
                slot = queue.popleft()
                if self._state[slot] == _QUEUED:
                    self._state[slot] = _LOADING
                    return slot, self._key[slot], ahead
        return None

    def _copy(self, slot: int, key: Key, ahead: bool) -> None:
        start, error = time.perf_counter(), None
        try:
            if self._stream is None:
                self._fill(*key, self.pool, slot)
            else:
                with torch.cuda.stream(self._stream):
                    if self._released is not None:
                        self._stream.wait_event(self._released)  # compute has finished reading the slot
                    self._fill(*key, self.pool, slot)
                    self._landed[slot] = self._stream.record_event()
        except Exception as err:  # surfaced to the compute thread by the next wait or request
            error = err
        seconds = time.perf_counter() - start
        with self._cond:
            if error is not None:
                self._error = error
                del self._slot_of[key]
                self._key[slot], self._state[slot] = None, _FREE
            else:
                self._state[slot] = _READY
                self.stats.bytes_fetched += self.bytes_per_expert
                self.stats.fetch_s += seconds
                self.stats.num_prefetched += ahead
            self._cond.notify_all()

    def _wait_row(self, slot: int) -> None:
        """Block until the slot's copy has landed (on CUDA: make the compute stream wait for it)."""
        if self._state[slot] != _READY:
            start = time.perf_counter()
            with self._cond:
                while self._state[slot] != _READY:
                    self._raise_if_failed()
                    self._cond.wait()
            self.stats.wait_s += time.perf_counter() - start
        event = self._landed[slot]
        if event is not None:
            torch.cuda.current_stream(self.pool.w_down.device).wait_event(event)


def _fetch_loop(store_ref: weakref.ref, cond: threading.Condition) -> None:
    """The fetch thread: copy queued experts, demand first. It holds no reference to the store
    while idle, so a dropped store is collected and its thread exits."""
    while True:
        with cond:
            store = store_ref()
            if store is None or store._closed:
                return
            job = store._next_job()
            if job is None:
                del store
                cond.wait(_IDLE_CHECK_S)
                continue
        store._copy(*job)
        del store
