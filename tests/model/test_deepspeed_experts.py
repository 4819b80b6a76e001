"""The DeepSpeed-MoE backend at one rank: the native backend's output, with each expert's GEMMs
run on its routed tokens only (not on DeepSpeed's capacity padding) and unrouted experts skipped."""

from __future__ import annotations

import pytest
import torch

from batchgen_data.model.moe import deepspeed_backend
from batchgen_data.model.moe.deepspeed_backend import DeepSpeedExperts
from batchgen_data.model.moe.experts import ExpertWeights
from batchgen_data.model.moe.native_backend import NativeExperts
from batchgen_data.model.moe.router import Routing
from batchgen_data.model.moe.store import ResidentExpertStore

pytest.importorskip("deepspeed")

E, H, F_, T = 6, 16, 24, 10


def _store() -> ResidentExpertStore:
    g = torch.Generator().manual_seed(0)
    weights = ExpertWeights(torch.randn(E, 2 * F_, H, generator=g) / 4, torch.randn(E, H, F_, generator=g) / 4)
    return ResidentExpertStore({0: weights}, E)


def test_experts_see_only_their_routed_rows_and_match_the_native_backend(monkeypatch):
    store = _store()
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1))
    # Skewed: expert 0 takes every token (capacity 10), experts 1 and 3 a few, 2, 4, 5 none.
    ids = torch.tensor([[0, 1]] * 4 + [[0, 3]] * 6)
    weights = torch.rand(T, 2, generator=torch.Generator().manual_seed(2))
    routing = Routing(ids, weights)
    expected = NativeExperts(store, 0)(x, routing).hidden

    rows_seen = []
    real_linear = deepspeed_backend.linear

    def counting_linear(inp, w, b=None):
        rows_seen.append(inp.shape[0])
        return real_linear(inp, w, b)

    monkeypatch.setattr(deepspeed_backend, "linear", counting_linear)
    out = DeepSpeedExperts(store, 0)(x, routing)
    torch.testing.assert_close(out.hidden, expected, rtol=1e-5, atol=1e-5)
    assert out.tokens_per_expert.tolist() == [10, 4, 0, 6, 0, 0]
    # Two GEMMs (gate_up, down) per routed expert, on exactly its tokens: 20 routed rows in all,
    # where the capacity buffers hold 6 experts x 10 rows.
    assert sorted(rows_seen) == [4, 4, 6, 6, 10, 10]
