"""Where experts live: the ``ExpertStore`` contract and the resident store.

A store answers "give me layer l's weights for experts S" and says which experts this process
owns. The expert backends read weights only through it, so the rest of the engine does not know
whether an expert is a resident tensor (``ResidentExpertStore``), held by another rank (expert
parallelism: a store that owns a subset, its ``shard`` set), or fetched from a slower tier into a
bounded pool (offloading: ``streamed_store.StreamedExpertStore``, which copies on demand and
evicts). Callers ask what kind a store is through the contract, never its class:
``store.shard is not None`` (sharded) and ``isinstance(store, StreamedStore)`` (streamed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from batchgen_data.errors import ConfigError
from batchgen_data.model.moe.experts import ExpertWeights
from batchgen_data.model.moe.stream_stats import StreamStats


class ExpertStore(Protocol):
    """Expert weights by (layer, experts)."""

    num_experts: int  # E, every layer's expert count (global ids 0 .. E-1)
    capacity: int | None  # most experts one answer can hold (None: every owned one)
    shard: ExpertShard | None  # this expert-parallel rank's share (None: not sharded)

    def owned(self, layer_id: int) -> tuple[int, ...]:
        """Global ids of the experts of ``layer_id`` this process computes."""
        ...

    def weights(self, layer_id: int, expert_ids: list[int] | None = None) -> ExpertWeights:
        """Weights holding at least ``expert_ids`` of ``layer_id`` (None: every owned one; at most
        ``capacity``); find an expert's row with ``ExpertWeights.row``. Valid until the next call
        (a bounded store reuses its rows); ``[]`` asks only for the tensors' shapes and device."""
        ...

    def layer_ids(self) -> tuple[int, ...]:
        """The sparse layers the store holds experts for."""
        ...


@runtime_checkable
class StreamedStore(ExpertStore, Protocol):
    """A store streaming its experts through a bounded pool of slots (``StreamedExpertStore``):
    what the engine plans and reports offloading with. ``isinstance`` checks that every member
    exists (not their types); only a streamed store has ``bytes_per_expert`` and ``stats``."""

    capacity: int
    bytes_per_expert: int
    stats: StreamStats  # cumulative hits, misses, copies and waits
    pool: ExpertWeights  # [S, ...] the slots every answer reads

    @property
    def nbytes(self) -> int:
        """The pool's bytes (fixed at load)."""
        ...

    def warm(self) -> float:
        """Fill the pool at load; the measured fetch rate in bytes/s."""
        ...

    def in_place_table(self, layer_id: int) -> ExpertTable | None:
        """The layer's experts where the decode kernels may read them in place, or None."""
        ...

    def close(self) -> None:
        """Stop the fetch thread."""
        ...


def in_batches(store: ExpertStore, expert_ids: list[int]) -> list[list[int]]:
    """``expert_ids`` (ascending) in runs of at most ``store.capacity``: one answer each."""
    size = store.capacity or max(len(expert_ids), 1)
    return [expert_ids[i : i + size] for i in range(0, len(expert_ids), size)] or [[]]


class ResidentExpertStore:
    """Every expert of every sparse layer as a resident tensor in this process (zero-copy reads)."""

    capacity = None
    shard: ExpertShard | None = None  # every expert: not sharded (``ShardedExpertStore`` sets it)

    def __init__(self, layers: dict[int, ExpertWeights], num_experts: int):
        self._layers = layers
        self.num_experts = num_experts
        self._all = tuple(range(num_experts))

    def owned(self, layer_id: int) -> tuple[int, ...]:
        return self._all

    def weights(self, layer_id: int, expert_ids: list[int] | None = None) -> ExpertWeights:
        return self._layers[layer_id]

    def layer_ids(self) -> tuple[int, ...]:
        return tuple(self._layers)

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self._layers.values())


@dataclass(frozen=True, slots=True)
class ExpertShard:
    """Rank ``rank`` of ``world_size`` expert-parallel ranks owns the contiguous block of
    ``E / world_size`` experts of every sparse layer that DeepSpeed-MoE's all-to-all sends it."""

    rank: int
    world_size: int

    def owned(self, num_experts: int) -> range:
        if num_experts % self.world_size:
            raise ConfigError(
                f"expert_parallel_size={self.world_size} must divide the model's {num_experts} "
                "experts per layer"
            )
        per_rank = num_experts // self.world_size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)


class ShardedExpertStore(ResidentExpertStore):
    """Only this rank's experts of every sparse layer, resident; ``row_of`` maps global ids to
    local rows (-1 for the other ranks' experts, which this process never loads)."""

    capacity = None

    def __init__(self, layers: dict[int, ExpertWeights], num_experts: int, shard: ExpertShard):
        super().__init__(layers, num_experts)
        self.shard = shard
        self._all = tuple(shard.owned(num_experts))
        row_of = torch.full((num_experts,), -1, dtype=torch.long)  # [E] global id -> local row
        row_of[list(self._all)] = torch.arange(len(self._all))
        for weights in layers.values():
            if weights.num_rows != len(self._all):
                raise ValueError(
                    f"a shard holds {weights.num_rows} experts, expected {len(self._all)}"
                )
            weights.row_of = row_of
