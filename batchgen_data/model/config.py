"""The model's shape and options, read from a Hugging Face ``config.json``.

One dataclass for all supported MoE architectures; the architecture-specific differences
(attention kind, router semantics, q/k norm, shared experts, dense layers, expert activation) are
explicit fields, so the modules never branch on the architecture name. ``families.py`` reads
each ``model_type``'s config.json into these fields.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from batchgen_data.errors import CheckpointError
from batchgen_data.model.families import read_family
from batchgen_data.model.options import MLAConfig, RopeConfig, RouterConfig

__all__ = ["MLAConfig", "ModelConfig", "RopeConfig", "RouterConfig"]


@dataclass(slots=True)
class ModelConfig:
    """Everything the modules need to know about a checkpoint.

    Shape legend used across the model package: T = tokens, H = hidden size, E = experts,
    K = experts per token (top-k), F = expert FFN size, Nq/Nkv = query/key-value heads, D = head dim.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    intermediate_size: int  # dense-MLP layers (Qwen ``mlp_only_layers``, DeepSeek ``first_k_dense_replace``)
    router: RouterConfig = field(default_factory=RouterConfig)
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    attention_kind: str = "gqa"  # "gqa" | "mla"
    mla: MLAConfig | None = None
    attention_qkv_bias: bool = False
    attention_out_bias: bool = False
    # "head": RMSNorm over each head's D (Qwen3, GLM); "full": over all heads' Nq*D / Nkv*D (OLMoE).
    qk_norm: str | None = None
    clip_qkv: float | None = None
    rotary_dim: int = 0  # dims of each head that RoPE rotates (0: all of head_dim; GLM rotates half)
    rope_interleave: bool = False  # RoPE over (x0, x1), (x2, x3) pairs instead of halves (DeepSeek)
    attention_sinks: bool = False  # a learned per-head logit in the softmax denominator (gpt-oss)
    shared_expert_intermediate_size: int = 0
    shared_expert_gated: bool = False  # Qwen2-MoE scales the shared expert by sigmoid(x @ w_gate)
    expert_bias: bool = False  # biases on the experts' projections (gpt-oss)
    # None: SwiGLU. Otherwise gpt-oss's clamped SwiGLU: (clamp(up) + 1) * g * sigmoid(alpha * g).
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    # How a fused expert tensor stores its matrices: "auto" guesses from the shapes ([E, out, in]
    # or the transpose); "in_out" is [E, in, out] with gate and up interleaved (gpt-oss).
    expert_layout: str = "auto"
    quantization: str | None = None  # "mxfp4" (gpt-oss experts) or "fp8" (block-scaled, DeepSeek-V3)
    fp8_block_size: tuple[int, int] | None = None  # quantization_config.weight_block_size for "fp8"
    sparse_layer_ids: tuple[int, ...] = ()
    sliding_windows: tuple[int | None, ...] = ()  # per layer; None = full attention
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    # A sequence-classification head (``*ForSequenceClassification``: ``score.weight`` [L, H]):
    # its label count L (0: none) and the activation that turns its logits into probabilities
    # ("softmax", "sigmoid" or "identity"; see ``families.read_classifier``).
    num_labels: int = 0
    classifier_activation: str = "softmax"
    # Multi-Token-Prediction layers after the main ones (``model.layers.{num_hidden_layers}...``;
    # DeepSeek-V3, GLM-4.5): a draft model for speculative decoding (``model/mtp.py``).
    num_nextn_predict_layers: int = 0
    raw: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.rotary_dim:
            self.rotary_dim = self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    def is_sparse_layer(self, layer_id: int) -> bool:
        return layer_id in self.sparse_layer_ids

    @property
    def matryoshka_dimensions(self) -> list[int] | None:
        """The embedding sizes the checkpoint was trained to be truncated to (config.json)."""
        return self.raw.get("matryoshka_dimensions") or None

    @property
    def is_matryoshka(self) -> bool:
        """Whether its embeddings may be truncated (``PoolingParams.dimensions``), as vLLM reads it."""
        return bool(self.matryoshka_dimensions) or bool(self.raw.get("is_matryoshka", False))

    @property
    def norm_topk_prob(self) -> bool:
        return self.router.norm_topk_prob

    @property
    def num_params(self) -> int:
        """Parameter count (all experts), for reporting."""
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self._layer_params(self.num_experts) + embed

    @property
    def active_params_per_token(self) -> int:
        """Parameters touched per token (top-k experts only): the FLOPs basis (2 FLOPs each)."""
        return self._layer_params(self.num_experts_per_tok) + self.vocab_size * self.hidden_size

    @property
    def attention_params(self) -> int:
        """One layer's attention projection weights."""
        h = self.hidden_size
        if self.mla is None:
            return h * self.head_dim * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
        m, heads = self.mla, self.num_attention_heads
        q = h * heads * m.qk_head_dim if m.q_lora_rank is None else m.q_lora_rank * (h + heads * m.qk_head_dim)
        kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
        return q + kv + heads * m.v_head_dim * h

    @property
    def kv_values_per_token(self) -> int:
        """Values one token stores in the KV cache, all layers (each attention kind's ``KVSpec``)."""
        if self.mla is None:
            per_layer = 2 * self.num_key_value_heads * self.head_dim
        else:
            per_layer = self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
        return per_layer * self.num_hidden_layers

    @property
    def attention_flops_per_key(self) -> int:
        """Matmul FLOPs of one (query, key) pair in one layer: scores and the weighted values.
        MLA counts its decode form, attention in the latent space (keys R + Dr, values R)."""
        if self.mla is None:
            return 4 * self.num_attention_heads * self.head_dim
        m = self.mla
        return 2 * self.num_attention_heads * (2 * m.kv_lora_rank + m.qk_rope_head_dim)

    def _layer_params(self, experts_per_layer: int) -> int:
        """All layers' parameters, counting ``experts_per_layer`` routed experts in each sparse one."""
        h = self.hidden_size
        moe = experts_per_layer * 3 * h * self.moe_intermediate_size + self.num_experts * h
        moe += 3 * h * self.shared_expert_intermediate_size
        dense = 3 * h * self.intermediate_size
        return sum(self.attention_params + (moe if self.is_sparse_layer(i) else dense)
                   for i in range(self.num_hidden_layers))

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> "ModelConfig":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise CheckpointError(f"no config.json in checkpoint folder {str(folder)!r}")
        try:
            cfg = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise CheckpointError(f"cannot read {path}: {err}") from None
        return cls.from_dict(cfg)

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        return cls(**read_family(cfg))
