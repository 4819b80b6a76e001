"""The native MoE block (the router, then every routed expert in two parallel regions: gate, up
and SiLU split by FFN columns, the down projection by output rows) against the torch maths, at
FFN widths that split into several chunks and at the row counts of decode steps (issue #35)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen_data.model.native.expert_table import stacked_table, views_table


def _reference(h, norm_w, eps, w_router, top_k, renormalize, w_gate_up, w_down, row_of):
    x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm_w
    probs = torch.softmax(x @ w_router.T, dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            gate, up = (x[t] @ w_gate_up[row_of[e]].T).chunk(2)
            out[t] += w * ((F.silu(gate) * up) @ w_down[row_of[e]].T)
    return h + out


@settings(max_examples=12, deadline=None)
@given(tokens=st.integers(1, 32), ffn=st.sampled_from([1024, 1408, 1500, 2304, 8200]), hidden=st.sampled_from([16, 48, 130]),
       experts=st.integers(2, 9), top_k=st.integers(1, 2), renormalize=st.booleans(), seed=st.integers(0, 2**16),
       gate_scale=st.sampled_from([1.0, 300.0]))
def test_the_moe_block_matches_the_torch_maths_across_ffn_chunks(native, tokens, ffn, hidden, experts, top_k,
                                                                  renormalize, seed, gate_scale):
    """``gate_scale`` 300 puts gate values far beyond exp's range on both sides (the vector SiLU)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g)
    norm_w = torch.rand(hidden, generator=g) + 0.5
    w_router = torch.randn(experts, hidden, generator=g)
    w_gate_up = torch.randn(experts + 1, 2 * ffn, hidden, generator=g) / hidden**0.5
    w_gate_up[:, :ffn] *= gate_scale
    w_down = torch.randn(experts + 1, hidden, ffn, generator=g) / ffn**0.5
    row_of = torch.randperm(experts + 1, generator=g)[:experts]  # rows need not equal expert ids
    out, counts = native.decode_layer.moe_block(h, norm_w, 1e-5, w_router, top_k, renormalize,
                                                stacked_table(w_gate_up, w_down, row_of))
    expected = _reference(h, norm_w, 1e-5, w_router, top_k, renormalize, w_gate_up, w_down, row_of.tolist())
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4 * gate_scale)
    assert int(counts.sum()) == tokens * top_k


def test_a_nan_gate_reaches_the_output(native):
    hidden, ffn, experts = 32, 1024, 2
    w_gate_up = torch.randn(experts, 2 * ffn, hidden)
    w_gate_up[1, 5] = float("nan")  # expert 1's gate column 5
    out, _ = native.decode_layer.moe_block(torch.randn(1, hidden), torch.ones(hidden), 1e-5,
                                           torch.tensor([[0.0] * hidden, [1.0] * hidden]), 2, True,
                                           stacked_table(w_gate_up, torch.randn(experts, hidden, ffn)))
    assert out.isnan().all()


def test_the_moe_block_does_not_depend_on_the_thread_count(native):
    g = torch.Generator().manual_seed(0)
    tokens, hidden, ffn, experts = 8, 64, 1408, 6
    args = (torch.randn(tokens, hidden, generator=g), torch.ones(hidden), 1e-5, torch.randn(experts, hidden, generator=g),
            2, True, stacked_table(torch.randn(experts, 2 * ffn, hidden, generator=g),
                                   torch.randn(experts, hidden, ffn, generator=g)))
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(native.decode_layer.moe_block(*args)[0])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_experts_in_separate_unaligned_tensors_give_the_stacked_experts_bits(native):
    """A memory-mapped checkpoint's per-expert w1, w3 and w2 sit at any 4-byte offset in the file;
    the kernel reads them through the address table and must give the stacked rows' exact bits."""
    g = torch.Generator().manual_seed(3)
    tokens, hidden, ffn, experts = 5, 64, 1408, 6
    w_gate_up = torch.randn(experts, 2 * ffn, hidden, generator=g) / hidden**0.5
    w_down = torch.randn(experts, hidden, ffn, generator=g) / ffn**0.5
    flat = torch.empty(3 * experts * ffn * hidden + 3)  # one buffer, every tensor at an odd float offset
    views, at = [], 3
    for e in range(experts):
        parts = []
        for source in (w_gate_up[e, :ffn], w_gate_up[e, ffn:], w_down[e]):
            view = flat[at : at + source.numel()].view(source.shape)
            view.copy_(source)
            parts.append(view)
            at += source.numel()
        views.append(tuple(parts))
    args = (torch.randn(tokens, hidden, generator=g), torch.rand(hidden, generator=g) + 0.5, 1e-5,
            torch.randn(experts, hidden, generator=g), 2, True)
    stacked, counts = native.decode_layer.moe_block(*args, stacked_table(w_gate_up, w_down))
    separate, counts_too = native.decode_layer.moe_block(*args, views_table(views))
    assert torch.equal(stacked, separate) and torch.equal(counts, counts_too)


def test_a_token_routed_to_an_expert_not_held_is_refused(native):
    hidden, ffn = 32, 64
    w_gate_up, w_down = torch.randn(2, 2 * ffn, hidden), torch.randn(2, hidden, ffn)
    held_one = stacked_table(w_gate_up, w_down, torch.tensor([0, -1]))  # expert 1 not held
    router = torch.tensor([[0.0] * hidden, [1.0] * hidden])  # every positive token picks expert 1
    with pytest.raises(ValueError, match="not held"):
        native.decode_layer.moe_block(torch.ones(1, hidden), torch.ones(hidden), 1e-5, router, 1, True, held_one)
