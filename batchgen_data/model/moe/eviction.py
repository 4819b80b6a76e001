"""Which slot of a streamed store gives way to an expert it does not hold.

Layers run in a fixed cycle. ``next_use`` evicts the unpinned slot whose layer comes back latest
in the cycle, least recently used among equals, and lets a prefetch evict only a slot used later
than the expert it fetches, so fetching ahead never evicts what is needed sooner. ``lru`` evicts
the least recently used slot and prefetches only the next layer; once the model is larger than
the pool, LRU over a fixed cycle evicts exactly the experts needed soonest. Free slots go first.
"""

from __future__ import annotations

from collections import deque

from batchgen_data.model.moe.slot_pool import SlotPool

EVICTION_POLICIES = ("next_use", "lru")


def check_eviction(name: str) -> str:
    """``name`` if it is one of ``EVICTION_POLICIES``; else a ValueError naming them."""
    if name not in EVICTION_POLICIES:
        raise ValueError(f"eviction must be one of {EVICTION_POLICIES}, got {name!r}")
    return name


class EvictionPolicy:
    """The victim order over a ``SlotPool``: owns the policy's name, where the layer cycle
    stands (the layer asked for last) and the victims left for the request in hand. Every
    method runs with the store's lock held."""

    def __init__(self, name: str, slots: SlotPool, layer_ids: tuple[int, ...]):
        self.name = name
        self._slots = slots
        self._key, self._used = slots.key, slots.used  # read per slot in every sort: no call
        self._layers = layer_ids
        self._pos = {layer: i for i, layer in enumerate(layer_ids)}
        self._current = len(layer_ids) - 1  # position of the last layer asked for: layer 0 next
        self._candidates: deque[int] | None = None  # victims of the request in hand, first first

    @property
    def name(self) -> str:
        """``"next_use"`` or ``"lru"``; settable between requests."""
        return "lru" if self._is_lru else "next_use"

    @name.setter
    def name(self, name: str) -> None:
        self._is_lru = check_eviction(name) == "lru"

    def begin_request(self, layer_id: int) -> None:
        """``layer_id`` is asked for now: the cycle stands there; victims are ordered afresh."""
        self._current = self._pos[layer_id]
        self._candidates = None

    def next_victim(self) -> int | None:
        """The slot to give a missing expert of the request in hand; None when every unpinned
        slot is being copied into (wait for a copy to land, then ask again)."""
        if self._candidates is None:
            self._candidates = deque(self.victims())
        while self._candidates:
            slot = self._candidates.popleft()
            if self._slots.is_evictable(slot):
                return slot
        self._candidates = None
        return None

    def victims(self) -> list[int]:
        """Evictable slots, the first to evict first."""
        return sorted(self._slots.evictable(), key=self.order, reverse=True)

    def order(self, slot: int) -> tuple[float, int]:
        """Sort key of a victim, largest evicted first: free, then farthest next use
        (``next_use``), then least recently used."""
        key = self._key[slot]
        if key is None:
            return (float("inf"), 0)
        if self._is_lru:
            return (0.0, -self._used[slot])
        return (float(self.distance(key[0])), -self._used[slot])

    def distance(self, layer_id: int) -> int:
        """Layers from the current one until ``layer_id`` runs again (1 .. number of layers)."""
        return (self._pos[layer_id] - self._current - 1) % len(self._layers) + 1

    def prefetch_steps(self) -> range:
        """How many layers ahead (1, 2, ...) a prefetch may fetch for: ``lru``, only the next."""
        return range(1, 2 if self._is_lru else len(self._layers))

    def layer_at(self, step: int) -> int:
        """The layer ``step`` layers after the current one in the cycle."""
        return self._layers[(self._current + step) % len(self._layers)]

    def may_prefetch_into(self, victim: int, step: int) -> bool:
        """Whether an expert needed ``step`` layers ahead may evict ``victim`` (``next_use``:
        only a slot whose next use comes later)."""
        return self._is_lru or self.order(victim)[0] > step
