"""The paged KV cache pool: fixed-size blocks of token slots, laid out per layer by its ``KVSpec``."""

from __future__ import annotations

import torch

from batchgen_data.model.attention.spec import KVSpec, LayerKV


class KVCache:
    """KV storage for ``num_blocks`` blocks of ``block_size`` tokens, for every layer.

    Which sequence owns which block is the block manager's business; this class only holds
    tensors: for layer ``l``, one [num_blocks, block_size, *shape] tensor per entry of
    ``specs[l].shapes``. Slot ``s`` (in a flattened view) is token ``s % block_size`` of block
    ``s // block_size``. A token's KV in portable form (swap, export) is one row of
    ``values_per_token`` values: every layer's tensors, flattened, in layer order.
    """

    def __init__(self, specs: list[KVSpec], num_blocks: int, block_size: int, device: torch.device | str = "cpu"):
        self.specs = specs
        self.num_blocks, self.block_size = num_blocks, block_size
        self.device = torch.device(device)
        self.layers: list[LayerKV] = [
            tuple(torch.zeros((num_blocks, block_size, *shape), dtype=spec.dtype, device=device) for shape in spec.shapes)
            for spec in specs
        ]
        self._gather: dict[tuple, tuple[torch.Tensor, ...]] = {}  # page-gather workspace per layout

    @staticmethod
    def bytes_per_block(specs: list[KVSpec], block_size: int) -> int:
        """Bytes one block takes across all layers."""
        return sum(spec.bytes_per_token for spec in specs) * block_size

    @property
    def values_per_token(self) -> int:
        return sum(spec.values_per_token for spec in self.specs)

    def gather_buffers(self, num_blocks: int) -> dict[tuple, tuple[torch.Tensor, ...]]:
        """Workspaces of at least ``num_blocks`` pages per layout (grown on demand, reused)."""
        for spec in self.specs:
            have = self._gather.get(spec.layout)
            if have is None or have[0].shape[0] < num_blocks:
                rows = num_blocks + num_blocks // 4
                self._gather[spec.layout] = tuple(
                    torch.empty((rows, self.block_size, *shape), dtype=spec.dtype, device=self.device)
                    for shape in spec.shapes
                )
        return self._gather

    def _slots(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        pos = torch.arange(num_tokens)
        blocks = torch.tensor(block_ids, dtype=torch.long)[pos // self.block_size]
        return (blocks * self.block_size + pos % self.block_size).to(self.device)

    def read_tokens(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """Copy a sequence's first ``num_tokens`` tokens out of the pool: [num_tokens, values] on the host."""
        slots = self._slots(block_ids, num_tokens)
        rows = [page.view(-1, *page.shape[2:])[slots].reshape(num_tokens, -1) for layer in self.layers for page in layer]
        return torch.cat(rows, dim=1).to("cpu")

    def write_tokens(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Restore ``read_tokens`` output ([num_tokens, values]) into the sequence's pages."""
        num_tokens = data.shape[0]
        if data.shape[1] != self.values_per_token:
            raise ValueError(f"KV rows hold {data.shape[1]} values per token; this cache stores {self.values_per_token}")
        slots = self._slots(block_ids, num_tokens)
        start = 0
        for layer in self.layers:
            for page in layer:
                flat = page.view(-1, *page.shape[2:])  # [num_slots, *shape]
                width = flat[0].numel()
                flat[slots] = data[:, start : start + width].to(self.device, page.dtype).view(num_tokens, *flat.shape[1:])
                start += width
