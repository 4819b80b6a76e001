"""What a streamed expert store has done: hits, misses, copies and waits."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StreamStats:
    """Cumulative counters of a streamed store (``StreamedExpertStore.stats``): the store counts
    hits and misses, its fetcher the copies and waits."""

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
