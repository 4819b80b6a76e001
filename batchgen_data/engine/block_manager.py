"""KV page accounting: which blocks are free. Pure Python; no tensors."""

from __future__ import annotations


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks of ``block_size`` slots that ``num_tokens`` tokens take."""
    return -(-num_tokens // block_size)


class BlockManager:
    """A free list of ``num_blocks`` KV blocks of ``block_size`` token slots each."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free):
            raise RuntimeError(f"allocate({num_blocks}) with {len(self._free)} free blocks")
        return [self._free.pop() for _ in range(num_blocks)]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(reversed(block_ids))
