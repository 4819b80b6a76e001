"""DeepSpeed-MoE expert backend: the project's routing fed through ``deepspeed.moe``'s dispatch.

DeepSpeed's own ``TopKGate`` cannot express these architectures' routers (no
``norm_topk_prob=False``, no shared experts) and, with its defaults, drops 2-29% of tokens and adds
Gumbel noise even in eval. So the ``deepspeed.moe.layer.MoE`` built here is configured with
``drop_tokens=False``, ``use_rts=False``, ``top2_2nd_expert_sampling=False`` and no noisy gate, and
its gate is then replaced by ``_RoutingGate``, which hands DeepSpeed the routing computed by
``Router`` in DeepSpeed's sparse-route format with capacity = the busiest expert's load (nothing
dropped). Dispatch, the expert loop and the combine are DeepSpeed's; with ``ep_size > 1`` its
``_AllToAll`` moves each expert's capacity buffer to the rank that owns the expert and back, and
the gate first gathers every rank's per-expert token counts (one small all-to-all), which fixes
the capacity (the busiest expert on any rank, as DeepSpeed's own gate does without token
dropping) and tells each expert how many rows of each rank's buffer are tokens: an expert runs its
GEMMs on those rows only, never on the capacity padding, and an expert no token reached is skipped.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from batchgen_data.model.layers import linear
from batchgen_data.model.moe.experts import (
    SWIGLU,
    ExpertActivation,
    ExpertOutput,
    ExpertWeights,
    expert_ffn,
)
from batchgen_data.model.moe.router import Routing
from batchgen_data.model.moe.store import ExpertStore, in_batches


class _Expert(nn.Module):
    """One expert; its weights are read from the store's answer for the current call (no copy)."""

    def __init__(self, owner: DeepSpeedExperts, expert_id: int):
        super().__init__()
        self.owner, self.expert_id = owner, expert_id

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [ep_size, 1, C, H]: a buffer from each rank
        counts = self.owner.tokens_from_ranks(self.expert_id)  # the leading rows of each buffer that are tokens
        out = torch.zeros_like(x)
        if not any(counts):  # no token routed here this call (DeepSpeed still hands it capacity buffers)
            return out
        weights = self.owner.weights_for(self.expert_id)
        row = -1 if weights is None else weights.row(self.expert_id)
        if row < 0:
            raise RuntimeError(f"expert {self.expert_id} has tokens but the store holds no weights for it")
        parts = [x[rank, 0, :n] for rank, n in enumerate(counts) if n]
        rows = parts[0] if len(parts) == 1 else torch.cat(parts)
        y = expert_ffn(rows, weights, row, self.owner.activation, linear)  # [sum(counts), H]
        start = 0
        for rank, n in enumerate(counts):
            if n:
                out[rank, 0, :n] = y[start:start + n]
                start += n
        return out


class _RoutingGate(nn.Module):
    """Stands in for ``TopKGate``: returns precomputed routes in DeepSpeed's sparse format."""

    def __init__(self, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.routing: Routing | None = None
        self.ep_group = None
        self.comm_s = 0.0  # seconds spent gathering the other ranks' counts
        self.span: tuple[float, float] | None = None  # (arrived, left) the last gather, wall-clock seconds
        self.rank_counts: list[list[int]] = []  # [ep_size][E] tokens each rank routed to each expert

    def _set_ep_group(self, ep_group) -> None:  # called by MOELayer under expert parallelism
        self.ep_group = ep_group

    def _gather_counts(self, local: torch.Tensor) -> list[list[int]]:
        """Every rank's tokens per expert ([ep_size][E]); the capacity is their maximum, so all
        capacity buffers match."""
        if self.ep_group is None:
            return [local.tolist()]
        import deepspeed.comm as dist

        start, arrived = time.perf_counter(), time.time()
        world = dist.get_world_size(group=self.ep_group)
        # An all-gather written as an all-to-all of the counts repeated per rank: as fast or
        # faster in gloo (0.28-0.44 ms against 0.44-0.66 ms between two CPU processes,
        # benchmarks/gloo_latency.py), and not deprecated like ``all_gather_into_tensor``.
        gathered = local.new_empty(world * local.numel())
        dist.all_to_all_single(gathered, local.repeat(world), group=self.ep_group)
        self.comm_s += time.perf_counter() - start
        self.span = (arrived, time.time())
        return gathered.view(world, -1).tolist()

    def forward(self, x, used_token=None, sparse_routes=True, use_tutel=False):
        routing, self.routing = self.routing, None
        ids = routing.topk_ids  # [S, K]
        num_experts = self.num_experts
        one_hot = F.one_hot(ids.reshape(-1), num_experts)  # [S*K, E], route order = token-major
        # Position of each route in its expert's buffer: routes before it to the same expert.
        locations = ((torch.cumsum(one_hot, dim=0) - 1) * one_hot).sum(-1).view_as(ids)  # [S, K]
        exp_counts = one_hot.sum(0)  # [E]
        self.rank_counts = self._gather_counts(exp_counts)
        capacity = max(max(max(counts) for counts in self.rank_counts), 1)
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
    """Expert backend running ``deepspeed.moe.layer.MoE``; with ``ep_size`` > 1 (the process
    group initialised by ``deepspeed.init_distributed``) this rank runs only its store's experts
    and the ranks exchange tokens by all-to-all in every call, which every rank must join."""

    name = "deepspeed"

    def __init__(self, store: ExpertStore, layer_id: int, activation: ExpertActivation = SWIGLU, ep_size: int = 1):
        from deepspeed.moe.layer import MoE

        self.store, self.layer_id, self.activation = store, layer_id, activation
        num_experts = store.num_experts
        hidden = store.weights(layer_id, []).w_gate_up.shape[2]
        self.call_weights: ExpertWeights | None = None  # the store's answer for the call in flight
        self._used: set[int] = set()  # experts with tokens in the call in flight
        self._batches: Iterator[list[int]] = iter(())  # the runs of them not asked for yet
        self._batch: set[int] = set()  # the run ``call_weights`` holds
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
        layer.experts.deepspeed_experts = nn.ModuleList(_Expert(self, e) for e in store.owned(layer_id))
        if ep_size > 1:
            moe.set_deepspeed_parallelism()  # the expert-parallel group (created once, by every rank)
            layer.wall_clock_breakdown = True  # DeepSpeed times its two all-to-alls per call
        self.moe = moe.eval()
        self.ep_size = ep_size
        self.comm_s = 0.0  # cumulative seconds in the all-to-alls and the counts exchange
        # (arrived, left) of each collective this layer joined, in wall-clock seconds (one clock
        # for every process of the node), until taken: with every rank's spans, the time a rank
        # spent waiting for a slower one splits from the time the exchange itself took.
        self.comm_spans: list[tuple[float, float]] = []

    def __call__(self, x: torch.Tensor, routing: Routing) -> ExpertOutput:
        counts = torch.bincount(routing.topk_ids.reshape(-1), minlength=self.store.num_experts).tolist()
        used = [e for e, n in enumerate(counts) if n]
        if self.store.capacity is None:  # one answer holds every owned expert, also those only
            self.call_weights = self.store.weights(self.layer_id, used)  # other ranks' tokens reach
        else:
            self._used, self._batches, self._batch = set(used), iter(in_batches(self.store, used)), set()
        self.moe.deepspeed_moe.gate.routing = routing
        try:
            out, _, exp_counts = self.moe(x)
        finally:
            self.call_weights, self._used, self._batch = None, set(), set()
        if self.ep_size > 1:
            self.comm_s += self._take_all_to_all_s()
        return ExpertOutput(hidden=out, tokens_per_expert=exp_counts.to("cpu", torch.int64))

    def tokens_from_ranks(self, expert_id: int) -> list[int]:
        """How many tokens each rank sent ``expert_id`` in the call in flight."""
        return [counts[expert_id] for counts in self.moe.deepspeed_moe.gate.rank_counts]

    def weights_for(self, expert_id: int) -> ExpertWeights | None:
        """The store's answer holding ``expert_id`` in the call in flight (None: it got no
        tokens). DeepSpeed runs the experts in id order, so when the current answer does not hold
        the expert, the next run of experts (at most the store's ``capacity``) is asked for."""
        if self.store.capacity is None:
            return self.call_weights
        if expert_id not in self._used:
            return None
        while expert_id not in self._batch:
            self._batch = set(next(self._batches))
            self.call_weights = self.store.weights(self.layer_id, sorted(self._batch))
        return self.call_weights

    def _take_all_to_all_s(self) -> float:
        """Seconds of this call's two all-to-alls (DeepSpeed's timers, read and reset) and of
        the gate's counts exchange."""
        from deepspeed.moe.sharded_moe import FIRST_ALLTOALL_TIMER, MOE_TIMER, SECOND_ALLTOALL_TIMER

        layer = self.moe.deepspeed_moe
        seconds = (layer.time_falltoall + layer.time_salltoall) / 1000.0 + layer.gate.comm_s
        first, second = layer.timers(FIRST_ALLTOALL_TIMER), layer.timers(SECOND_ALLTOALL_TIMER)
        if layer.gate.span is not None and getattr(first, "use_host_timer", False):  # host clocks (CPU)
            self.comm_spans += [layer.gate.span, (first.start_time, first.end_time), (second.start_time, second.end_time)]
        for name in (FIRST_ALLTOALL_TIMER, SECOND_ALLTOALL_TIMER, MOE_TIMER):  # they accumulate otherwise
            layer.timers(name).reset()
        layer.gate.comm_s, layer.gate.span = 0.0, None
        return seconds
