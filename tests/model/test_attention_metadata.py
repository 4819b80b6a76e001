"""The decode-step path of ``build_attention_metadata`` builds the same metadata as the general one."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen_data.model.attention.metadata import _decode_metadata, _general_metadata


@settings(max_examples=80, deadline=None)
@given(contexts=st.lists(st.integers(1, 70), min_size=1, max_size=9), block_size=st.sampled_from([1, 4, 16]),
       seed=st.integers(0, 2**16))
def test_decode_metadata_equals_the_general_path(contexts, block_size, seed):
    g = torch.Generator().manual_seed(seed)
    pages = (max(contexts) + block_size - 1) // block_size
    tables = [torch.randperm(500, generator=g)[: (c + block_size - 1) // block_size].tolist() for c in contexts]
    padded = [t + [0] * (pages - len(t)) for t in tables]
    fast = _decode_metadata(contexts, padded, block_size, "cpu")
    general = _general_metadata([1] * len(contexts), contexts, padded, block_size, "cpu")
    for name in ("positions", "slot_mapping", "query_index", "block_table", "query_positions", "context_lens"):
        a, b = getattr(fast, name), getattr(general, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert (fast.num_seqs, fast.max_query_len, fast.block_size) == (general.num_seqs, 1, block_size)
