"""A bounded pool of expert slots, filled from a slower tier on demand and ahead of use.

For models larger than memory, the routed experts stay in a slower tier: the checkpoint's
memory-mapped safetensors on CPU (page cache or disk; file pages, not anonymous memory), or a
pinned host copy when the pool is on a GPU. Only ``capacity`` experts at a time occupy the
pool's preallocated slots, so the store's memory is fixed at load whatever the model's size.
Shape legend: S = slots, E = experts per layer, H and F as in ``experts.py``.

The store composes four parts and owns the request path that ties them: ``slot_pool.SlotPool``
(the slots and what each holds), ``eviction.EvictionPolicy`` (which slot gives way),
``prefetch.PrefetchPredictor`` (which experts each layer will ask for next) and
``fetcher.ExpertFetcher`` (the thread that copies); ``stream_stats.StreamStats`` counts.

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

import torch

from batchgen_data.model.moe.eviction import EvictionPolicy, check_eviction
from batchgen_data.model.moe.experts import ExpertWeights
from batchgen_data.model.moe.fetcher import ExpertFetcher, Fill
from batchgen_data.model.moe.prefetch import PrefetchPredictor
from batchgen_data.model.moe.slot_pool import QUEUED, Key, SlotPool
from batchgen_data.model.moe.stream_stats import StreamStats
from batchgen_data.model.native.expert_table import ExpertTable


class StreamedExpertStore:
    """``capacity`` expert slots over the sparse layers ``layer_ids``; ``fill`` copies one expert
    from the slower tier into a slot. Owns its parts (see the module docstring), the request
    path through them and the counters (``stats``, which the fetcher adds its copies to)."""

    shard = None  # every expert of its layers, never sharded across expert-parallel ranks

    def __init__(self, fill: Fill, layer_ids: list[int], num_experts: int, num_slots: int,
                 hidden: int, ffn: int, has_bias: bool, dtype: torch.dtype,
                 device: torch.device | str, eviction: str = "next_use", prefetch: bool = True,
                 in_place: dict[int, ExpertTable] | None = None):
        check_eviction(eviction)
        if num_slots < 1:
            raise ValueError(f"a streamed store needs at least one slot, got {num_slots}")
        self.num_experts, self.capacity = num_experts, num_slots
        self.prefetch = prefetch  # queue the upcoming layers' likely experts after each request
        self._in_place = in_place or {}
        self.read_in_place = bool(in_place)  # decode kernels read the mapped tier (settable before first use)
        self.stats = StreamStats()
        self._slots = SlotPool(num_slots, hidden, ffn, has_bias, dtype, device)
        self.pool = self._slots.weights  # [S, ...] every answer's rows
        self.bytes_per_expert = self._slots.bytes_per_slot
        self._layers = tuple(layer_ids)
        self._all = tuple(range(num_experts))
        self._eviction = EvictionPolicy(eviction, self._slots, self._layers)
        self._predictor = PrefetchPredictor(self._layers, num_experts)
        self._cond = threading.Condition()  # guards every part's bookkeeping
        self._fetcher = ExpertFetcher(fill, self._slots, self.stats, self._cond, device)

    @property
    def eviction(self) -> str:
        """The victim order, ``"next_use"`` or ``"lru"`` (settable: benchmarks compare them)."""
        return self._eviction.name

    @eviction.setter
    def eviction(self, name: str) -> None:
        with self._cond:
            self._eviction.name = name

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
            raise ValueError(
                f"a streamed store answers for at most {self.capacity} experts at a time, "
                f"asked for {asked}"
            )
        row_of = torch.full((self.num_experts,), -1, dtype=torch.long)  # [E]
        if expert_ids:
            with self._cond:
                self._fetcher.raise_if_failed()
                self._fetcher.release()
                self._slots.begin_request()
                self._eviction.begin_request(layer_id)
                for expert_id in sorted(expert_ids):
                    row_of[expert_id] = self._pin((layer_id, expert_id))
                self._predictor.note_request(layer_id, expert_ids)
                if self.prefetch:
                    self._queue_ahead()
                self._cond.notify_all()
        pool = self.pool
        return ExpertWeights(pool.w_gate_up, pool.w_down, pool.b_gate_up, pool.b_down, row_of,
                             self._fetcher.wait_row)

    def in_place_table(self, layer_id: int) -> ExpertTable | None:
        """The layer's experts in the slower tier itself, for the decode kernels to read in place
        (``moe/in_place.py``), or None: every read goes through the pool."""
        return self._in_place.get(layer_id) if self.read_in_place else None

    # -- load time ------------------------------------------------------------------------------

    def warm(self) -> float:
        """Fill every slot with the experts first in line (layer 0's first), timing the copies;
        returns the measured fetch rate in bytes/s (what the engine plans the running set with)."""
        keys = [(layer, e) for layer in self._layers for e in self._all][: self.capacity]
        seconds = self._fetcher.copy_now(keys)
        with self._cond:
            for slot, key in enumerate(keys):
                self._assign(slot, key)
                self._slots.mark_ready(slot)
        return len(keys) * self.bytes_per_expert / max(seconds, 1e-9)

    def close(self) -> None:
        """Stop the fetch thread (it also stops by itself once the store is garbage-collected)."""
        self._fetcher.close()

    # -- the request path (called with the lock held) -------------------------------------------

    def _pin(self, key: Key) -> int:
        slots = self._slots
        slot = slots.slot_of.get(key)
        if slot is None:
            self.stats.num_misses += 1
            slot = self._take(key)
            self._fetcher.queue(slot)
        elif slots.state[slot] == QUEUED and self._fetcher.promote(slot):
            self.stats.num_misses += 1  # asked for before its copy ahead began: now on demand
        else:
            self.stats.num_hits += 1
        slots.pin(slot)
        return slot

    def _take(self, key: Key) -> int:
        """A slot for ``key``: free or evictable, waiting for an in-flight copy to land if every
        unpinned slot is loading."""
        while (slot := self._eviction.next_victim()) is None:
            self._cond.wait()
            self._fetcher.raise_if_failed()
        self._assign(slot, key)
        return slot

    def _assign(self, slot: int, key: Key) -> None:
        if self._slots.state[slot] == QUEUED:  # a copy not started yet: cancelled
            self._fetcher.cancel(slot)
        self._slots.assign(slot, key)

    def _queue_ahead(self) -> None:
        """Queue the upcoming layers' likely experts (those asked for recently, hottest first),
        no more than the slots the current answer leaves, so each stays until it is used, and
        only into slots the policy lets them take; ``lru``: the next layer's, into LRU victims."""
        slots, policy, likely = self._slots, self._eviction, self._predictor.likely
        candidates = policy.victims()
        room, taken = self.capacity - len(slots.pinned), 0
        for step in policy.prefetch_steps():
            layer = policy.layer_at(step)
            for e in likely[layer]:
                if room == 0:
                    return  # the slots left are all spoken for by nearer layers' experts
                room -= 1
                if (layer, e) in slots.slot_of:
                    continue
                victim = candidates[taken] if taken < len(candidates) else None
                if victim is None or not policy.may_prefetch_into(victim, step):
                    return  # every slot left is needed no later than this expert
                taken += 1
                self._assign(victim, (layer, e))
                self._fetcher.queue_ahead(victim)
