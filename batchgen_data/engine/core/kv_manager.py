"""The KV manager: a sequence's KV blocks and the prefix cache behind one sequence-level API.
Pure Python; no tensors.

NOTE: the prefix cache (vLLM's automatic prefix caching, on whole blocks).
  * A full block is named by a chained digest, ``sha256(parent's name + its token ids + extra
    keys)`` (``block_name``; ``EngineConfig.prefix_caching_hash_algo``), so one name means one
    token prefix from position 0 to the block's end: equal KV, for any causal attention kind.
    The pool also checks the parent and tokens of a hit (``block_pool.py``).
  * ``computed_prefix(seq)`` finds the blocks of the longest cached prefix (never the block of
    the last token: its logits are needed); ``admit`` takes a reference on them and fresh blocks
    for the rest; ``commit`` names the blocks whose KV a forward has just completed; ``free``
    gives everything back, cached KV kept until the space is needed.
The scheduler calls only this class for blocks and decides policy (who is admitted, who yields);
this class alone writes a sequence's block fields (``block_ids``, ``block_names``,
``num_registered_blocks``).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence as SequenceABC
from typing import TYPE_CHECKING

from batchgen_data.config import PREFIX_CACHING_HASH_ALGOS
from batchgen_data.engine.core.block_pool import BlockPool
from batchgen_data.errors import ConfigError

if TYPE_CHECKING:
    from batchgen_data.engine.core.sequence import Sequence

def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks of ``block_size`` slots that ``num_tokens`` tokens take."""
    return -(-num_tokens // block_size)


def block_name(parent: bytes | None, token_ids: SequenceABC[int], extra_key: object = None) -> bytes:
    """SHA-256 over the parent block's name, the block's token ids and optional extra keys."""
    digest = hashlib.sha256(parent or b"\0")
    digest.update(array("q", token_ids).tobytes())
    if extra_key is not None:
        digest.update(repr(extra_key).encode())
    return digest.digest()


def hash_function(algo: str) -> Callable[[bytes | None, SequenceABC[int], object], bytes]:
    if algo not in PREFIX_CACHING_HASH_ALGOS:
        raise ConfigError(f"prefix_caching_hash_algo must be one of {PREFIX_CACHING_HASH_ALGOS}, got {algo!r}")
    return block_name


class KVCacheManager:
    """``num_blocks`` KV blocks of ``block_size`` token slots (see the module NOTE).

    Args:
        num_blocks, block_size: the pool.
        enable_caching: share computed blocks between sequences with the same prefix.
        hash_algo: how blocks are named (``PREFIX_CACHING_HASH_ALGOS``).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, hash_algo: str = "sha256"):
        self.pool = BlockPool(num_blocks)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._name = hash_function(hash_algo)

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.pool.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    # -- admission ----------------------------------------------------------------------------------

    def computed_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks holding the longest prefix of a sequence that has no KV yet (none
        when caching is off, or when it computes its whole prompt: prompt logprobs, pooling)."""
        if not self.enable_caching or seq.num_computed_tokens or seq.computes_whole_prompt:
            return []
        names = self.prefix_names(seq)
        found: list[int] = []
        parent = None
        size = self.block_size
        for i, name in enumerate(names):
            block = self.pool.find(name, parent, tuple(seq.token_ids_range(i * size, (i + 1) * size)))
            if block is None:
                break
            found.append(block)
            parent = name
        return found

    def prefix_names(self, seq: Sequence) -> list[bytes]:
        """Names of the full blocks a sequence may take from the cache: all but the block
        holding its last token, which is always computed (its logits are needed)."""
        limit = (seq.num_tokens - 1) // self.block_size
        self._name_blocks(seq, limit)
        return seq.block_names[:limit]

    def can_admit(self, seq: Sequence, computed: list[int], headroom: int) -> bool:
        """Whether blocks for all of the sequence's tokens fit, beside ``computed`` (its cached
        prefix) and ``headroom`` blocks kept free for the running set's growth."""
        needed = self.blocks_for(seq.num_tokens) - len(computed)
        return needed + self.pool.num_free_among(computed) + headroom <= self.pool.num_free

    def admit(self, seq: Sequence, computed: list[int]) -> int:
        """Give the sequence ``computed`` (shared) and fresh blocks for the rest of its tokens;
        returns how many of its tokens the shared blocks hold."""
        self.pool.share(computed)  # before taking: a fresh block must not evict these
        seq.block_ids = computed + self.pool.take(self.blocks_for(seq.num_tokens) - len(computed))
        seq.num_registered_blocks = len(computed)
        return len(computed) * self.block_size

    # -- running ------------------------------------------------------------------------------------

    def num_blocks_needed(self, seq: Sequence) -> int:
        """Blocks a running sequence lacks for its tokens so far (its next token's slot)."""
        return self.blocks_for(seq.num_tokens) - len(seq.block_ids)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.pool.num_free

    def append_slots(self, seq: Sequence, num_blocks: int) -> None:
        seq.block_ids += self.pool.take(num_blocks)

    def commit(self, seq: Sequence) -> None:
        """Name the sequence's blocks whose KV is now complete in the prefix cache."""
        full = seq.num_computed_tokens // self.block_size
        if not self.enable_caching or full <= seq.num_registered_blocks:
            return
        self._name_blocks(seq, full)
        size = self.block_size
        for i in range(seq.num_registered_blocks, full):
            parent = seq.block_names[i - 1] if i else None
            self.pool.register(seq.block_ids[i], seq.block_names[i], parent,
                               tuple(seq.token_ids_range(i * size, (i + 1) * size)))
        seq.num_registered_blocks = full

    def computing_names(self, seqs: list[Sequence]) -> set[bytes]:
        """Names of the blocks these (running) sequences are computing now: not yet cached."""
        return {name for seq in seqs for name in seq.block_names[seq.num_registered_blocks:]}

    def free(self, seq: Sequence) -> None:
        """Give back the sequence's blocks (cached ones keep their KV until the space is needed)."""
        self.pool.release(seq.block_ids)
        seq.block_ids = []
        seq.num_registered_blocks = 0

    def ref_count(self, block: int) -> int:
        return self.pool.ref_count(block)

    def _name_blocks(self, seq: Sequence, num_blocks: int) -> None:
        """Extend ``seq.block_names`` to its first ``num_blocks`` full blocks (tokens never
        change, so names survive suspension)."""
        names, size = seq.block_names, self.block_size
        for i in range(len(names), num_blocks):
            names.append(self._name(names[i - 1] if i else None, seq.token_ids_range(i * size, (i + 1) * size), None))
