"""Parts of a model's config: RoPE, multi-head latent attention and router options."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RopeConfig:
    """Rotary position embedding parameters (``rope_parameters`` / legacy ``rope_scaling``)."""

    rope_type: str = "default"  # default | linear | yarn | llama3
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    # yarn
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0


@dataclass(slots=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): what one token's KV is compressed into."""

    q_lora_rank: int | None  # None: a plain q_proj (DeepSeek-V2-Lite)
    kv_lora_rank: int  # R, the compressed latent the KV cache stores
    qk_nope_head_dim: int  # Dn, per-head key dims without RoPE (from the latent)
    qk_rope_head_dim: int  # Dr, the RoPE key shared by all heads (stored beside the latent)
    v_head_dim: int  # Dv

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


ROUTER_KINDS = ("softmax_topk", "topk_softmax", "greedy", "group_limited_greedy", "noaux_tc")


@dataclass(slots=True)
class RouterConfig:
    """How a token picks its experts and their weights.

    ``softmax_topk``: softmax over all experts, top-k (Mixtral, Qwen, OLMoE). ``topk_softmax``:
    top-k of the logits, softmax over those k (gpt-oss). ``greedy`` / ``group_limited_greedy``:
    DeepSeek-V2 (softmax; the latter first keeps the ``topk_group`` groups with the largest
    expert score). ``noaux_tc``: DeepSeek-V3 / GLM-4.5 (sigmoid scores; a correction bias
    chooses, groups ranked by the sum of their top two; weights from the unbiased scores).
    """

    kind: str = "softmax_topk"
    norm_topk_prob: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    has_bias: bool = False  # a bias on the router logits (gpt-oss)
