"""Top-k routers with each architecture's exact semantics (``RouterConfig.kind``).

Shape legend: T = tokens, H = hidden, E = experts, K = experts per token, G = expert groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchgen_data.model.options import RouterConfig


@dataclass(slots=True)
class Routing:
    """Which experts each token goes to, and with what weight."""

    topk_ids: torch.Tensor  # [T, K] expert ids
    topk_weights: torch.Tensor  # [T, K] combine weights, in the hidden dtype


class Router:
    """One sparse layer's router.

    ``softmax_topk`` (Mixtral, Qwen, OLMoE): softmax over all experts in fp32, top-k, optionally
    renormalised. ``topk_softmax`` (gpt-oss): top-k of the (biased) logits, softmax over those k.
    ``greedy`` / ``group_limited_greedy`` (DeepSeek-V2): fp32 softmax scores; the latter keeps
    only the ``topk_group`` groups with the highest expert score. ``noaux_tc`` (DeepSeek-V3,
    GLM-4.5): fp32 sigmoid scores; ``correction_bias`` is added only to choose (groups ranked by
    the sum of their two best, then the top k within the kept groups); the weights are the
    unbiased scores of the chosen experts, optionally renormalised. DeepSeek-style routers then
    multiply by ``routed_scaling_factor``.
    """

    def __init__(self, weight: torch.Tensor, top_k: int, config: RouterConfig,
                 bias: torch.Tensor | None = None, correction_bias: torch.Tensor | None = None):
        self.weight = weight  # [E, H]
        self.top_k = top_k
        self.config = config
        self.bias = bias  # [E] on the logits (gpt-oss)
        self.correction_bias = correction_bias  # [E] fp32, choice only (noaux_tc)
        self._route = {
            "softmax_topk": self._softmax_topk,
            "topk_softmax": self._topk_softmax,
            "greedy": self._greedy,
            "group_limited_greedy": self._greedy,
            "noaux_tc": self._noaux_tc,
        }[config.kind]

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    @property
    def _group_size(self) -> int:
        return self.num_experts // self.config.n_group

    def __call__(self, x: torch.Tensor) -> Routing:
        weights, ids = self._route(x)
        return Routing(topk_ids=ids, topk_weights=weights.to(x.dtype))

    def _softmax_topk(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(F.linear(x, self.weight).float(), dim=-1)  # [T, E]
        weights, ids = torch.topk(probs, self.top_k, dim=-1)  # [T, K]
        if self.config.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def _topk_softmax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight, self.bias)  # [T, E]
        top, ids = torch.topk(logits, self.top_k, dim=-1)  # [T, K]
        return torch.softmax(top, dim=-1), ids

    def _fp32_logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())  # [T, E]

    def _greedy(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.softmax(self._fp32_logits(x), dim=-1)  # [T, E]
        if self.config.kind == "group_limited_greedy":
            group_best = scores.view(scores.shape[0], self.config.n_group, self._group_size).amax(dim=-1)  # [T, G]
            scores = scores.masked_fill(~self._kept_experts(group_best), 0.0)
        weights, ids = torch.topk(scores, self.top_k, dim=-1, sorted=False)
        return weights * self.config.routed_scaling_factor, ids

    def _noaux_tc(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(self._fp32_logits(x))  # [T, E]
        choice = scores if self.correction_bias is None else scores + self.correction_bias
        group_best = choice.view(choice.shape[0], self.config.n_group, self._group_size).topk(2, dim=-1).values.sum(-1)  # [T, G]
        choice = choice.masked_fill(~self._kept_experts(group_best), float("-inf"))
        ids = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices  # [T, K]
        weights = scores.gather(1, ids)
        if self.config.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.config.routed_scaling_factor, ids

    def _kept_experts(self, group_scores: torch.Tensor) -> torch.Tensor:
        """[T, G] group scores -> [T, E] bool: the experts of each token's ``topk_group`` best groups."""
        num_groups = self.config.n_group
        if num_groups == self.config.topk_group:
            return torch.ones(group_scores.shape[0], self.num_experts, dtype=torch.bool, device=group_scores.device)
        best = torch.topk(group_scores, self.config.topk_group, dim=-1, sorted=False).indices  # [T, topk_group]
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # [T, G]
        return kept[:, :, None].expand(-1, -1, self._group_size).reshape(-1, self.num_experts)
