"""A streamed store's slots: the preallocated pool rows and what each slot holds.

Shape legend: S = slots, H and F as in ``experts.py``.
"""

from __future__ import annotations

import torch

from batchgen_data.model.moe.experts import ExpertWeights

Key = tuple[int, int]  # (layer id, expert id)

# A slot's state: empty; given to an expert whose copy has not started; being copied into; ready.
FREE, QUEUED, LOADING, READY = range(4)


class SlotPool:
    """``num_slots`` preallocated expert rows (``weights``) and, per slot, the expert it holds,
    its state, its last request and whether the answer in use pins it.

    Only this class writes that bookkeeping; the eviction policy and the fetcher read its lists,
    which keep their identity and length, without a call (they are read once per slot per
    request). Every method runs with the store's lock held.
    """

    def __init__(self, num_slots: int, hidden: int, ffn: int, has_bias: bool, dtype: torch.dtype,
                 device: torch.device | str):
        self.num_slots = num_slots
        w = ExpertWeights.empty(num_slots, hidden, ffn, has_bias, dtype, device)
        self.weights = w  # [S, 2F, H] / [S, H, F] (+ biases [S, 2F] / [S, H])
        for tensor in (w.w_gate_up, w.w_down, w.b_gate_up, w.b_down):
            if tensor is not None:
                tensor.zero_()  # touch every page now: the pool's memory is resident from load on
        self.bytes_per_slot = w.nbytes // num_slots
        self.key: list[Key | None] = [None] * num_slots
        self.state = [FREE] * num_slots
        self.used = [0] * num_slots  # tick of the slot's last request
        self.slot_of: dict[Key, int] = {}
        self.pinned: set[int] = set()  # slots of the answer in use
        self.tick = 0  # requests so far

    def begin_request(self) -> None:
        """The previous answer is done with: its slots may be evicted; a new request starts."""
        self.pinned.clear()
        self.tick += 1

    def pin(self, slot: int) -> None:
        """The request in hand reads ``slot``: keep it until the next request."""
        self.pinned.add(slot)
        self.used[slot] = self.tick

    def is_evictable(self, slot: int) -> bool:
        """Neither pinned nor being copied into."""
        return slot not in self.pinned and self.state[slot] != LOADING

    def evictable(self) -> list[int]:
        """Every evictable slot (``is_evictable``, inlined: this runs over every slot)."""
        pinned, state = self.pinned, self.state
        return [s for s in range(self.num_slots) if s not in pinned and state[s] != LOADING]

    def assign(self, slot: int, key: Key) -> None:
        """Give ``slot`` to ``key``, whose copy is to be queued; the expert it held is gone."""
        old = self.key[slot]
        if old is not None:
            del self.slot_of[old]
        self.key[slot], self.state[slot] = key, QUEUED
        self.slot_of[key] = slot

    def mark_loading(self, slot: int) -> None:
        self.state[slot] = LOADING

    def mark_ready(self, slot: int) -> None:
        self.state[slot] = READY

    def free(self, slot: int) -> None:
        """Its copy failed: the slot holds nothing."""
        del self.slot_of[self.key[slot]]
        self.key[slot], self.state[slot] = None, FREE
