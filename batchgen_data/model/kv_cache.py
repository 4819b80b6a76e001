"""The paged KV cache pool: fixed-size blocks of token slots, one K and one V tensor per layer."""

from __future__ import annotations

import torch

from batchgen_data.model.config import ModelConfig


class KVCache:
    """K/V storage for ``num_blocks`` blocks of ``block_size`` tokens, for every layer.

    Which sequence owns which block is the block manager's business; this class only holds
    tensors, [num_blocks, block_size, Nkv, D] per layer. Slot ``s`` (in the flattened view) is
    token ``s % block_size`` of block ``s // block_size``.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes across all layers (K and V)."""
        elem = torch.empty((), dtype=dtype).element_size()
        per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * elem
        return per_token * block_size
