"""DeepSpeed-MoE expert backend: the project's routing fed through ``deepspeed.moe``'s dispatch.

DeepSpeed's own ``TopKGate`` cannot express these architectures' routers (no
``norm_topk_prob=False``, no shared experts) and, with its defaults, drops 2-29% of tokens and adds
Gumbel noise even in eval. So the ``deepspeed.moe.layer.MoE`` built here is configured with
``drop_tokens=False``, ``use_rts=False``, ``top2_2nd_expert_sampling=False`` and no noisy gate, and
its gate is then replaced by ``_RoutingGate``, which hands DeepSpeed the routing computed by
``Router`` in DeepSpeed's sparse-route format with capacity = the busiest expert's load (nothing
dropped). Dispatch, the expert loop and the combine are DeepSpeed's; with ``ep_size > 1`` its
all-to-all (a later issue) moves tokens between ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchgen_data.model.experts import ExpertOutput, ExpertWeights
from batchgen_data.model.router import Routing


class _Expert(nn.Module):
    """One SwiGLU expert over views into the stacked weights (no copy)."""

    def __init__(self, w_gate_up: torch.Tensor, w_down: torch.Tensor):
        super().__init__()
        self.w_gate_up, self.w_down = w_gate_up, w_down

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., C, H]
        gate, up = F.linear(x, self.w_gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.w_down)


class _RoutingGate(nn.Module):
    """Stands in for ``TopKGate``: returns precomputed routes in DeepSpeed's sparse format."""

    def __init__(self, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.routing: Routing | None = None

    def _set_ep_group(self, ep_group) -> None:  # called by MOELayer under expert parallelism
        self.ep_group = ep_group

    def forward(self, x, used_token=None, sparse_routes=True, use_tutel=False):
        routing, self.routing = self.routing, None
        ids = routing.topk_ids  # [S, K]
        num_experts = self.num_experts
        one_hot = F.one_hot(ids.reshape(-1), num_experts)  # [S*K, E], route order = token-major
        # Position of each route in its expert's buffer: routes before it to the same expert.
        locations = ((torch.cumsum(one_hot, dim=0) - 1) * one_hot).sum(-1).view_as(ids)  # [S, K]
        exp_counts = one_hot.sum(0)  # [E]
        capacity = max(int(exp_counts.max()), 1)
        l_aux = x.new_zeros(())
        return (
            l_aux,
            capacity,
            num_experts,
            ids.t().contiguous().to(torch.int32),  # [K, S]
            locations.t().contiguous().to(torch.int32),  # [K, S]
            routing.topk_weights.t().float().contiguous(),  # [K, S]
            exp_counts,
        )


class DeepSpeedExperts:
    """Expert backend running ``deepspeed.moe.layer.MoE`` (``ep_size=1`` here)."""

    name = "deepspeed"

    def __init__(self, weights: ExpertWeights, ep_size: int = 1):
        from deepspeed.moe.layer import MoE

        num_experts, _, hidden = weights.w_gate_up.shape
        moe = MoE(
            hidden_size=hidden,
            expert=nn.Identity(),  # replaced below; MoE deep-copies it once per expert
            num_experts=num_experts,
            ep_size=ep_size,
            k=1,
            drop_tokens=False,
            use_rts=False,
            noisy_gate_policy=None,
            top2_2nd_expert_sampling=False,
        )
        layer = moe.deepspeed_moe
        layer.gate = _RoutingGate(num_experts)
        layer.experts.deepspeed_experts = nn.ModuleList(
            _Expert(weights.w_gate_up[e], weights.w_down[e]) for e in range(num_experts)
        )
        self.moe = moe.eval()
        self.weights = weights

    def __call__(self, x: torch.Tensor, routing: Routing) -> ExpertOutput:
        self.moe.deepspeed_moe.gate.routing = routing
        out, _, exp_counts = self.moe(x)
        return ExpertOutput(hidden=out, tokens_per_expert=exp_counts.to("cpu", torch.int64))
