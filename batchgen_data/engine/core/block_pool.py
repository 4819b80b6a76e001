"""The pool of KV blocks: free queue, reference counts, and the map of cached blocks. Pure Python.

NOTE: a block is shared by every sequence holding a reference; ``free`` drops one. At zero it
goes to the back of the free queue *with its cache entry kept*: it can still be found and
revived. A new block is taken from the front (the least recently freed), and only then loses
its entry. So cached blocks cost nothing until memory is needed, and they are evicted before any
running sequence has to yield.

A cache entry keeps what the block's name was computed from (the parent's name and the block's
own token ids), and a lookup accepts a block only if both match: a name is a SHA-256 digest, but
even a forced collision (two different blocks under one name) cannot hand one sequence another
one's KV. Only ``KVCacheManager`` (``kv_manager.py``) calls this class.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CachedBlock:
    """A computed full block registered under ``name``."""

    block_id: int
    parent: bytes | None  # the previous block's name (None for a sequence's first block)
    token_ids: tuple[int, ...]


class BlockPool:
    """``num_blocks`` KV blocks with reference counts and a name -> block map of computed blocks."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front: taken first
        self._refs = [0] * num_blocks
        self._name_of: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, CachedBlock] = {}

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds (some may still hold cached KV)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks whose KV is registered under a name (held or free)."""
        return len(self._cached)

    def take(self, num_blocks: int) -> list[int]:
        """Fresh blocks, each with one reference; a cached free block taken here loses its entry."""
        if num_blocks > len(self._free):
            raise RuntimeError(f"take({num_blocks}) with {len(self._free)} free blocks")
        taken = []
        for _ in range(num_blocks):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._refs[block] = 1
            taken.append(block)
        return taken

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; a block nobody holds joins the back of the free
        queue, its last blocks first (a sequence's tail is evicted before its prefix)."""
        for block in reversed(block_ids):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None
            elif self._refs[block] < 0:
                raise RuntimeError(f"block {block} freed more often than it was taken")

    def share(self, block_ids: list[int]) -> None:
        """Take one reference to each (cached) block."""
        for block in block_ids:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1

    def num_free_among(self, block_ids: list[int]) -> int:
        """How many of these blocks nobody holds (``share`` takes them off the free queue)."""
        return sum(1 for block in block_ids if self._refs[block] == 0)

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def find(self, name: bytes, parent: bytes | None, token_ids: tuple[int, ...]) -> int | None:
        """The cached block registered under ``name`` for exactly this parent and these tokens."""
        entry = self._cached.get(name)
        if entry is None or entry.parent != parent or entry.token_ids != token_ids:
            return None
        return entry.block_id

    def register(self, block: int, name: bytes, parent: bytes | None, token_ids: tuple[int, ...]) -> None:
        """Name a held block whose KV is now computed; a name registered already keeps its block."""
        if self._name_of[block] is None and name not in self._cached:
            self._name_of[block] = name
            self._cached[name] = CachedBlock(block, parent, token_ids)

    def _evict(self, block: int) -> None:
        name = self._name_of[block]
        if name is not None:
            del self._cached[name]
            self._name_of[block] = None
