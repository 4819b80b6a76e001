"""Top-k routers with each architecture's exact semantics."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class Routing:
    """Which experts each token goes to, and with what weight."""

    topk_ids: torch.Tensor  # [T, K] expert ids
    topk_weights: torch.Tensor  # [T, K] combine weights, in the hidden dtype


class Router:
    """Softmax over all experts in fp32, top-k, then (``norm_topk_prob``) renormalise the k weights.

    This is the Mixtral (always renormalised), Qwen2-MoE, Qwen3-MoE and OLMoE semantics.
    """

    def __init__(self, weight: torch.Tensor, top_k: int, norm_topk_prob: bool):
        self.weight = weight  # [E, H]
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> Routing:
        logits = F.linear(x, self.weight)  # [T, E]
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)  # [T, K]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(topk_ids=ids, topk_weights=weights.to(x.dtype))
