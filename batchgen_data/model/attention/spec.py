"""The attention contract: what a layer stores per token (``KVSpec``) and how it is called.

Everything outside an attention kind — the block manager, the KV byte budget, suspension to host,
swap, ``export_sequence`` / ``import_sequence`` — works from the ``KVSpec`` of each layer, so a
layer may hold K and V (GQA), a compressed latent (MLA) or a sliding window without the engine
knowing which.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from batchgen_data.model.attention.metadata import AttentionBatch

# One layer's KV pages: one tensor per ``KVSpec.shapes`` entry, [num_blocks, block_size, *shape].
LayerKV = tuple[torch.Tensor, ...]


@dataclass(frozen=True, slots=True)
class KVSpec:
    """What one token costs in one layer's KV cache.

    ``shapes`` holds one per-token shape per stored tensor: GQA stores K and V,
    ``((Nkv, D), (Nkv, D))``; MLA stores its compressed latent and shared RoPE key. A layer with
    ``sliding_window`` attends only over its last ``sliding_window`` tokens.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    sliding_window: int | None = None

    @property
    def layout(self) -> tuple:
        """What the pages of a layer look like (layers of one layout share gather buffers)."""
        return self.shapes, self.dtype

    @property
    def values_per_token(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes)

    @property
    def bytes_per_token(self) -> int:
        return self.values_per_token * self.dtype.itemsize


class AttentionLayer(Protocol):
    """One layer's attention over a flat token batch and its paged KV.

    ``__call__`` writes the batch's new tokens into ``kv`` (at ``batch.slot_mapping``) and
    attends each micro-batch over its own pages, prefill chunks and decode tokens alike;
    x: [T, H] -> [T, H].
    """

    kv_spec: KVSpec

    def __call__(self, x: torch.Tensor, batch: AttentionBatch, kv: LayerKV) -> torch.Tensor: ...

    def projection_weights(self) -> list[torch.Tensor]:
        """The [N, K] weights it multiplies through ``layers.linear`` (for GEMM tuning)."""
        ...
