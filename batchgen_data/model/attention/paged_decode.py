"""When decode attention reads the KV pages in place (the compiled ``paged_decode_attention``).

A micro-batch of decoders (one query per sequence) on CPU in fp32 attends with the native
kernel (``model/native/paged_attention.cpp``): each key and value is read once from its page,
where the torch path gathers the pages into a buffer and runs SDPA over the copy. Everything
else (prefill chunks, other devices and dtypes, attention sinks) keeps the torch path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from batchgen_data.model.attention.metadata import AttentionMetadata
from batchgen_data.model.native import active_native

def paged_decode_kernel(q: torch.Tensor, pages: torch.Tensor, meta: AttentionMetadata) -> Callable | None:
    """The native decode kernel where it applies to this micro-batch, else None."""
    if meta.max_query_len != 1 or q.device.type != "cpu" or q.dtype != torch.float32 or pages.dtype != torch.float32:
        return None
    module = active_native()
    return None if module is None else module.paged_decode_attention
