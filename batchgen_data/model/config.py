"""The model's shape and options, read from a Hugging Face ``config.json``.

One dataclass for all supported MoE architectures; the architecture-specific differences
(router semantics, q/k norm, shared expert, dense layers) are explicit fields, so the modules
never branch on the architecture name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from batchgen_data.errors import CheckpointError, UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe")


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
    intermediate_size: int  # dense-MLP layers (Qwen2/3-MoE ``mlp_only_layers``)
    norm_topk_prob: bool
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    attention_qkv_bias: bool = False
    attention_out_bias: bool = False
    # "head": RMSNorm over each head's D (Qwen3); "full": over all heads' Nq*D / Nkv*D (OLMoE).
    qk_norm: str | None = None
    clip_qkv: float | None = None
    shared_expert_intermediate_size: int = 0
    sparse_layer_ids: tuple[int, ...] = ()
    sliding_windows: tuple[int | None, ...] = ()  # per layer; None = full attention
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    raw: dict = field(default_factory=dict, repr=False)

    def is_sparse_layer(self, layer_id: int) -> bool:
        return layer_id in self.sparse_layer_ids

    @property
    def num_params(self) -> int:
        """Parameter count (all experts), for reporting."""
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self._layer_params(self.num_experts) + embed

    @property
    def active_params_per_token(self) -> int:
        """Parameters touched per token (top-k experts only): the FLOPs basis (2 FLOPs each)."""
        return self._layer_params(self.num_experts_per_tok) + self.vocab_size * self.hidden_size

    def _layer_params(self, experts_per_layer: int) -> int:
        """All layers' parameters, counting ``experts_per_layer`` routed experts in each sparse one."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
        moe = experts_per_layer * 3 * h * self.moe_intermediate_size + self.num_experts * h
        moe += 3 * h * self.shared_expert_intermediate_size
        dense = 3 * h * self.intermediate_size
        return sum(attn + (moe if self.is_sparse_layer(i) else dense) for i in range(self.num_hidden_layers))

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise CheckpointError(f"no config.json in checkpoint folder {str(folder)!r}")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, cfg: dict) -> ModelConfig:
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; supported: {list(SUPPORTED_MODEL_TYPES)}"
            )
        hidden = cfg["hidden_size"]
        num_heads = cfg["num_attention_heads"]
        num_layers = cfg["num_hidden_layers"]
        head_dim = cfg.get("head_dim") or hidden // num_heads
        if cfg.get("partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedModelError("partial_rotary_factor != 1 is not supported")
        num_experts = cfg.get("num_local_experts") or cfg.get("num_experts")
        if not num_experts:
            raise CheckpointError("config.json names no experts (num_local_experts / num_experts)")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))

        common = dict(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope=_read_rope(cfg),
            num_experts=num_experts,
            num_experts_per_tok=cfg["num_experts_per_tok"],
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            hidden_act=cfg.get("hidden_act", "silu"),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            pad_token_id=cfg.get("pad_token_id"),
            raw=cfg,
        )
        if common["hidden_act"] != "silu":
            raise UnsupportedModelError(f"hidden_act {common['hidden_act']!r} is not supported (silu only)")
        all_layers = tuple(range(num_layers))
        if model_type == "mixtral":
            window = cfg.get("sliding_window")
            return cls(
                **common,
                moe_intermediate_size=cfg["intermediate_size"],
                intermediate_size=0,
                norm_topk_prob=True,  # Mixtral always renormalises over the selected experts
                sparse_layer_ids=all_layers,
                sliding_windows=(window,) * num_layers,
            )
        if model_type == "olmoe":
            bias = bool(cfg.get("attention_bias", False))
            return cls(
                **common,
                moe_intermediate_size=cfg["intermediate_size"],
                intermediate_size=0,
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                attention_qkv_bias=bias,
                attention_out_bias=bias,
                qk_norm="full",
                clip_qkv=cfg.get("clip_qkv"),
                sparse_layer_ids=all_layers,
                sliding_windows=(None,) * num_layers,
            )
        # Qwen2-MoE and Qwen3-MoE: dense layers via mlp_only_layers / decoder_sparse_step.
        step = cfg.get("decoder_sparse_step", 1) or 1
        mlp_only = set(cfg.get("mlp_only_layers") or [])
        sparse = tuple(i for i in all_layers if i not in mlp_only and (i + 1) % step == 0)
        if model_type == "qwen3_moe":
            bias = bool(cfg.get("attention_bias", False))
            window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
            return cls(
                **common,
                moe_intermediate_size=cfg["moe_intermediate_size"],
                intermediate_size=cfg.get("intermediate_size", 0),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                attention_qkv_bias=bias,
                attention_out_bias=bias,
                qk_norm="head",
                sparse_layer_ids=sparse,
                sliding_windows=(window,) * num_layers,
            )
        # qwen2_moe
        layer_types = cfg.get("layer_types") or ["full_attention"] * num_layers
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
        return cls(
            **common,
            moe_intermediate_size=cfg["moe_intermediate_size"],
            intermediate_size=cfg.get("intermediate_size", 0),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            attention_qkv_bias=bool(cfg.get("qkv_bias", True)),
            shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0),
            sparse_layer_ids=sparse,
            sliding_windows=tuple(
                window if t == "sliding_attention" and window else None for t in layer_types
            ),
        )


def _read_rope(cfg: dict) -> RopeConfig:
    """Read rope parameters from transformers-5 ``rope_parameters`` or legacy ``rope_scaling``."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    params = {**legacy, **params}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ("default", "linear", "yarn", "llama3"):
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported; supported: default, linear, yarn, llama3"
        )
    opt = params.get
    return RopeConfig(
        rope_type=rope_type,
        theta=float(theta),
        factor=float(opt("factor") or 1.0),
        original_max_position_embeddings=opt("original_max_position_embeddings")
        or cfg.get("max_position_embeddings"),
        attention_factor=opt("attention_factor"),
        beta_fast=float(opt("beta_fast") or 32.0),
        beta_slow=float(opt("beta_slow") or 1.0),
        mscale=opt("mscale"),
        mscale_all_dim=opt("mscale_all_dim"),
        truncate=bool(opt("truncate", True)),
        low_freq_factor=float(opt("low_freq_factor") or 1.0),
        high_freq_factor=float(opt("high_freq_factor") or 4.0),
    )
