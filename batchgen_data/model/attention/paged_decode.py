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

_ENABLED = {"native": False}


def use_native_decode_attention(enabled: bool) -> None:
    """Turned on by the engine once the native kernels load (``model/native``)."""
    _ENABLED["native"] = enabled


def paged_decode_kernel(q: torch.Tensor, pages: torch.Tensor, meta: AttentionMetadata) -> Callable | None:
    """The native decode kernel where it applies to this micro-batch, else None."""
    if not _ENABLED["native"] or meta.max_query_len != 1:
        return None
    if q.device.type != "cpu" or q.dtype != torch.float32 or pages.dtype != torch.float32:
        return None
    from batchgen_data.model.native import load_native

    module = load_native()
    return None if module is None else module.paged_decode_attention
