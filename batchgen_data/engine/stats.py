"""What an engine reports about itself: ``EngineStats``, and ``RankStats`` per expert-parallel rank."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchgen_data.engine.worker.offload import OffloadStats


@dataclass(slots=True)
class RankStats:
    """One expert-parallel rank's counters (``EngineStats.ranks``)."""

    rank: int
    num_generated_tokens: int
    num_forward_tokens: int
    num_forwards: int
    num_idle_forwards: int  # steps it joined with nothing to run
    busy_s: float  # wall time inside its steps
    expert_comm_s: float  # of which in the all-to-alls and the counts exchange
    expert_weight_bytes: int  # its own experts only
    peak_rss_bytes: int
    kernel_s: float = 0.0  # of its busy time, inside model modules and the sampler
    num_suspended: int = 0
    num_resumed_swap: int = 0
    num_resumed_recompute: int = 0
    num_recomputed_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    expert_calls: int = 0  # (layer, expert) GEMM pairs its experts ran
    expert_tokens: int = 0  # routed token rows over those calls
    num_migrated_in: int = 0
    num_migrated_out: int = 0
    num_draft_tokens: int = 0  # speculative decoding: tokens drafted
    num_accepted_tokens: int = 0  # of which accepted


@dataclass(slots=True)
class EngineStats:
    """A snapshot of the engine's counters."""

    num_requests: int
    num_finished: int
    num_generated_tokens: int
    num_forwards: int
    num_forward_tokens: int
    mean_tokens_per_expert_call: float
    kernel_s: float
    busy_s: float  # wall time inside step()
    num_suspended: int
    num_resumed_swap: int
    num_resumed_recompute: int
    num_recomputed_tokens: int
    num_kv_blocks: int  # per rank under expert parallelism
    num_idle_forwards: int = 0  # zero-token forwards run to keep expert-parallel ranks in lockstep
    expert_comm_s: float = 0.0  # seconds the MoE layers spent exchanging tokens between ranks
    expert_weight_bytes: int = 0  # routed-expert weights resident in this process (each rank's own)
    ranks: list[RankStats] = field(default_factory=list)  # one per expert-parallel rank
    offload: OffloadStats | None = None  # streamed experts (EngineConfig.weight_memory_bytes)
    prefix_cache_queries: int = 0  # tokens of sequences admitted with prefix caching on
    prefix_cache_hits: int = 0  # of which their KV came from the prefix cache
    num_draft_tokens: int = 0  # speculative decoding (vLLM's metric names): tokens drafted
    num_accepted_tokens: int = 0  # of which accepted (each accepted one saves a step for its row)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of queried tokens found in the prefix cache."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def runtime_overhead(self) -> float:
        """Share of step() wall time spent outside model modules and the sampler."""
        return 1.0 - self.kernel_s / self.busy_s if self.busy_s else 0.0
