"""KV page accounting: free blocks, reference counts and the prefix cache. Pure Python; no tensors.

NOTE: the prefix cache (vLLM's automatic prefix caching, on whole blocks).
  * A full block is named by a chained hash: ``hash((parent block's hash, its token ids,
    extra keys))`` (``block_hashes``), so equal hashes mean equal tokens from position 0 up
    to the block's end: equal KV, for any causal attention kind.
  * ``cache(block, hash)`` registers a block whose KV is computed; ``lookup(hashes)`` returns
    the blocks of the longest cached prefix, and ``touch`` takes a reference on them.
  * A block is shared by every sequence holding a reference; ``free`` drops one. At zero it goes
    to the back of the free queue *with its hash kept*: it can still be found and revived. A new
    block is taken from the front (the least recently freed), and only then loses its hash.
    So cached blocks cost nothing until memory is needed, and they are evicted before any
    running sequence has to yield.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks of ``block_size`` slots that ``num_tokens`` tokens take."""
    return -(-num_tokens // block_size)


def block_hashes(token_ids: Sequence[int], block_size: int, start: list[int], num_blocks: int,
                 extra_key: object = None) -> list[int]:
    """Extend ``start`` (the hashes of the first blocks, kept by the caller) to the first
    ``num_blocks`` full blocks of ``token_ids``; returns the extended list (the same object)."""
    for i in range(len(start), num_blocks):
        parent = start[i - 1] if i else None
        start.append(hash((parent, tuple(token_ids[i * block_size:(i + 1) * block_size]), extra_key)))
    return start


class BlockManager:
    """``num_blocks`` KV blocks of ``block_size`` token slots, with reference counts and a
    hash -> block map of computed full blocks (see the module NOTE)."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front: taken first
        self._refs = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}  # hash -> block

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds (some may still hold cached KV)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks whose KV is named by a hash (held or free)."""
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Fresh blocks, each with one reference; a cached free block taken here loses its hash."""
        if num_blocks > len(self._free):
            raise RuntimeError(f"allocate({num_blocks}) with {len(self._free)} free blocks")
        taken = []
        for _ in range(num_blocks):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._refs[block] = 1
            taken.append(block)
        return taken

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; a block nobody holds joins the back of the free
        queue, its last blocks first (a sequence's tail is evicted before its prefix)."""
        for block in reversed(block_ids):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None
            elif self._refs[block] < 0:
                raise RuntimeError(f"block {block} freed more often than it was taken")

    # -- the prefix cache -------------------------------------------------------------------------

    def lookup(self, hashes: list[int]) -> list[int]:
        """The blocks holding the longest prefix of ``hashes`` (no references taken)."""
        found = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def num_free_among(self, block_ids: list[int]) -> int:
        """How many of these blocks nobody holds (``touch`` takes them off the free queue)."""
        return sum(1 for block in block_ids if self._refs[block] == 0)

    def touch(self, block_ids: list[int]) -> None:
        """Take one reference to each (cached) block."""
        for block in block_ids:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1

    def cache(self, block: int, block_hash: int) -> None:
        """Name a held block whose KV is now computed; a hash cached already keeps its block."""
        if self._hash_of[block] is None and block_hash not in self._cached:
            self._hash_of[block] = block_hash
            self._cached[block_hash] = block

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def _evict(self, block: int) -> None:
        h = self._hash_of[block]
        if h is not None:
            del self._cached[h]
            self._hash_of[block] = None
