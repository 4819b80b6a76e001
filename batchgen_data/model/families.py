"""Each supported ``model_type``'s config.json, read into ``ModelConfig`` fields.

One reader per family. Every switch a family's checkpoints use is either read into an explicit
field or, where the engine does not implement it, rejected here with a ``CheckpointError`` that
names the field and the supported values: an unsupported checkpoint fails at load, never with
wrong tokens.
"""

from __future__ import annotations

from collections.abc import Callable

from batchgen_data.errors import CheckpointError, UnsupportedModelError
from batchgen_data.model.options import MLAConfig, RopeConfig, RouterConfig

_ROPE_TYPES = ("default", "linear", "yarn", "llama3")
_QUANTIZATIONS = {"gpt_oss": ("mxfp4",), "deepseek_v3": ("fp8",)}


def read_family(cfg: dict) -> dict:
    """``ModelConfig`` keyword arguments for a Hugging Face config dict."""
    model_type = cfg.get("model_type")
    reader = FAMILIES.get(model_type)
    if reader is None:
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported; supported: {sorted(FAMILIES)}")
    _check_quantization(cfg, model_type)
    return {**reader(cfg), **read_classifier(cfg)}


# A Hugging Face ``problem_type`` -> the activation turning the head's logits into scores
# (vLLM's ``get_classification_activation_function``, after transformers' loss per problem type).
_PROBLEM_ACTIVATIONS = {"regression": "identity", "multi_label_classification": "sigmoid"}


def read_classifier(cfg: dict) -> dict:
    """The sequence-classification head of a ``*ForSequenceClassification`` checkpoint (vLLM's
    ``as_seq_cls_model``: ``score``, hidden -> labels, on the last token): its label count (from
    ``id2label``, as transformers counts them) and its activation; nothing for a causal LM."""
    if not any(str(a).endswith("ForSequenceClassification") for a in cfg.get("architectures") or ()):
        return {}
    labels = cfg.get("id2label")
    num_labels = len(labels) if labels else int(cfg.get("num_labels", 2))
    problem = cfg.get("problem_type")
    activation = _PROBLEM_ACTIVATIONS.get(problem, "sigmoid" if num_labels < 2 else "softmax")
    return dict(num_labels=num_labels, classifier_activation=activation)


def _common(cfg: dict, num_experts_key: str) -> dict:
    hidden = _need(cfg, "hidden_size")
    num_heads = _need(cfg, "num_attention_heads")
    num_experts = cfg.get(num_experts_key) or cfg.get("num_local_experts") or cfg.get("num_experts")
    if not num_experts:
        raise CheckpointError(f"config.json names no experts ({num_experts_key})")
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    hidden_act = cfg.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise UnsupportedModelError(f"hidden_act {hidden_act!r} is not supported; supported: ['silu']")
    return dict(
        model_type=cfg["model_type"],
        vocab_size=_need(cfg, "vocab_size"),
        hidden_size=hidden,
        num_hidden_layers=_need(cfg, "num_hidden_layers"),
        num_attention_heads=num_heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or hidden // num_heads,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope=read_rope(cfg),
        num_experts=num_experts,
        num_experts_per_tok=_need(cfg, "num_experts_per_tok"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        hidden_act=hidden_act,
        eos_token_ids=eos_ids,
        bos_token_id=cfg.get("bos_token_id"),
        pad_token_id=cfg.get("pad_token_id"),
        num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers") or 0),
        raw=cfg,
    )


def _mixtral(cfg: dict) -> dict:
    common = _common(cfg, "num_local_experts")
    layers = common["num_hidden_layers"]
    return dict(
        **common,
        moe_intermediate_size=_need(cfg, "intermediate_size"),
        intermediate_size=0,
        router=RouterConfig("softmax_topk", norm_topk_prob=True),  # always renormalised
        sparse_layer_ids=tuple(range(layers)),
        sliding_windows=(cfg.get("sliding_window"),) * layers,
        **_rotary(cfg, common["head_dim"], 1.0),
    )


def _olmoe(cfg: dict) -> dict:
    common = _common(cfg, "num_experts")
    layers = common["num_hidden_layers"]
    bias = bool(cfg.get("attention_bias", False))
    return dict(
        **common,
        moe_intermediate_size=_need(cfg, "intermediate_size"),
        intermediate_size=0,
        router=RouterConfig("softmax_topk", norm_topk_prob=bool(cfg.get("norm_topk_prob", False))),
        attention_qkv_bias=bias,
        attention_out_bias=bias,
        qk_norm="full",
        clip_qkv=cfg.get("clip_qkv"),
        sparse_layer_ids=tuple(range(layers)),
        sliding_windows=(None,) * layers,
        **_rotary(cfg, common["head_dim"], 1.0),
    )


def _qwen_moe(cfg: dict) -> dict:
    """Qwen2-MoE and Qwen3-MoE: dense layers via ``mlp_only_layers`` / ``decoder_sparse_step``."""
    common = _common(cfg, "num_experts")
    layers = common["num_hidden_layers"]
    step = cfg.get("decoder_sparse_step", 1) or 1
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    sparse = tuple(i for i in range(layers) if i not in mlp_only and (i + 1) % step == 0)
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
    router = RouterConfig("softmax_topk", norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
    shared = dict(moe_intermediate_size=_need(cfg, "moe_intermediate_size"),
                  intermediate_size=cfg.get("intermediate_size", 0), router=router, sparse_layer_ids=sparse,
                  **_rotary(cfg, common["head_dim"], 1.0))
    if cfg["model_type"] == "qwen3_moe":
        bias = bool(cfg.get("attention_bias", False))
        return dict(**common, **shared, attention_qkv_bias=bias, attention_out_bias=bias, qk_norm="head",
                    sliding_windows=(window,) * layers)
    layer_types = cfg.get("layer_types") or ["full_attention"] * layers
    return dict(
        **common,
        **shared,
        attention_qkv_bias=bool(cfg.get("qkv_bias", True)),
        shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0),
        shared_expert_gated=True,
        sliding_windows=tuple(window if t == "sliding_attention" and window else None for t in layer_types),
    )


def _deepseek(cfg: dict) -> dict:
    """DeepSeek-V2 (``deepseek_v2``) and DeepSeek-V3 / R1 / Kimi-K2 (``deepseek_v3``): MLA."""
    common = _common(cfg, "n_routed_experts")
    layers = common["num_hidden_layers"]
    mla = MLAConfig(
        q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=_need(cfg, "kv_lora_rank"),
        qk_nope_head_dim=_need(cfg, "qk_nope_head_dim"),
        qk_rope_head_dim=_need(cfg, "qk_rope_head_dim"),
        v_head_dim=_need(cfg, "v_head_dim"),
    )
    common.update(head_dim=mla.qk_head_dim, num_key_value_heads=common["num_attention_heads"])
    is_v3 = cfg["model_type"] == "deepseek_v3"
    if is_v3:
        router = _noaux_tc_router(cfg, "deepseek_v3")
        # transformers' V2 always rotates interleaved pairs; V3 says so with rope_interleave.
        interleave = bool(cfg.get("rope_interleave", True))
    else:
        method = _choice(cfg, "topk_method", "greedy", ("greedy", "group_limited_greedy"))
        _choice(cfg, "scoring_func", "softmax", ("softmax",))
        if cfg.get("norm_topk_prob"):
            raise UnsupportedModelError(
                "norm_topk_prob=True is not supported for deepseek_v2 (transformers ignores it and its "
                "checkpoints ship False); supported: [False]"
            )
        router = RouterConfig(method, n_group=cfg.get("n_group") or 1, topk_group=cfg.get("topk_group") or 1,
                              routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)))
        interleave = True
    fp8 = _fp8_block_size(cfg)
    freq = cfg.get("moe_layer_freq", 1) or 1
    first_dense = cfg.get("first_k_dense_replace", 0) or 0
    bias = bool(cfg.get("attention_bias", False))
    return dict(
        **common,
        attention_kind="mla",
        mla=mla,
        moe_intermediate_size=_need(cfg, "moe_intermediate_size"),
        intermediate_size=cfg.get("intermediate_size", 0),
        router=router,
        attention_qkv_bias=bias,
        attention_out_bias=bias,
        rotary_dim=mla.qk_rope_head_dim,
        rope_interleave=interleave,
        shared_expert_intermediate_size=_need(cfg, "moe_intermediate_size") * (cfg.get("n_shared_experts") or 0),
        sparse_layer_ids=tuple(i for i in range(layers) if i >= first_dense and i % freq == 0),
        sliding_windows=(None,) * layers,
        quantization="fp8" if fp8 else None,
        fp8_block_size=fp8,
    )


def _fp8_block_size(cfg: dict) -> tuple[int, int] | None:
    """DeepSeek's block-scaled FP8 release format: e4m3 weights, scales per weight block."""
    quant = cfg.get("quantization_config") or {}
    if quant.get("quant_method") != "fp8":
        return None
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UnsupportedModelError(f"quantization_config.fmt {fmt!r} is not supported; supported: ['e4m3']")
    block = quant.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise UnsupportedModelError(
            f"quantization_config.weight_block_size {block!r} is not supported; supported: two positive ints "
            "(per-block scales, as DeepSeek-V3 ships)"
        )
    return (block[0], block[1])


def _glm4_moe(cfg: dict) -> dict:
    """GLM-4.5 / 4.6: GQA with q/k/v biases, partial rotary, optional q/k norm; DeepSeek-V3 routing."""
    common = _common(cfg, "n_routed_experts")
    layers = common["num_hidden_layers"]
    first_dense = cfg.get("first_k_dense_replace", 1)
    return dict(
        **common,
        moe_intermediate_size=_need(cfg, "moe_intermediate_size"),
        intermediate_size=cfg.get("intermediate_size", 0),
        router=_noaux_tc_router(cfg, "glm4_moe"),
        attention_qkv_bias=bool(cfg.get("attention_bias", False)),
        attention_out_bias=False,
        qk_norm="head" if cfg.get("use_qk_norm", False) else None,
        shared_expert_intermediate_size=_need(cfg, "moe_intermediate_size") * (cfg.get("n_shared_experts") or 0),
        sparse_layer_ids=tuple(i for i in range(layers) if i >= first_dense),
        sliding_windows=(None,) * layers,
        **_rotary(cfg, common["head_dim"], 0.5),
    )


def _gpt_oss(cfg: dict) -> dict:
    """gpt-oss: sinks, alternating sliding/full attention, biased router and experts, clamped SwiGLU."""
    common = _common(cfg, "num_local_experts")
    layers = common["num_hidden_layers"]
    layer_types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    bad = sorted({t for t in layer_types} - {"sliding_attention", "full_attention"})
    if bad:
        raise UnsupportedModelError(f"layer_types {bad} are not supported; supported: ['sliding_attention', 'full_attention']")
    window = cfg.get("sliding_window")
    bias = bool(cfg.get("attention_bias", True))
    quant = (cfg.get("quantization_config") or {}).get("quant_method")
    return dict(
        **common,
        moe_intermediate_size=_need(cfg, "intermediate_size"),
        intermediate_size=0,
        router=RouterConfig("topk_softmax", has_bias=True),
        attention_qkv_bias=bias,
        attention_out_bias=bias,
        attention_sinks=True,
        expert_bias=True,
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
        expert_layout="in_out",
        quantization=quant,
        sparse_layer_ids=tuple(range(layers)),
        sliding_windows=tuple(window if t == "sliding_attention" else None for t in layer_types),
        **_rotary(cfg, common["head_dim"], 1.0),
    )


FAMILIES: dict[str, Callable[[dict], dict]] = {
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
    "glm4_moe": _glm4_moe,
    "gpt_oss": _gpt_oss,
    "mixtral": _mixtral,
    "olmoe": _olmoe,
    "qwen2_moe": _qwen_moe,
    "qwen3_moe": _qwen_moe,
}


def _noaux_tc_router(cfg: dict, family: str) -> RouterConfig:
    _choice(cfg, "topk_method", "noaux_tc", ("noaux_tc",))
    _choice(cfg, "scoring_func", "sigmoid", ("sigmoid",))
    n_group, topk_group = cfg.get("n_group") or 1, cfg.get("topk_group") or 1
    num_experts = cfg.get("n_routed_experts") or cfg.get("num_local_experts")
    if num_experts % n_group or not 1 <= topk_group <= n_group:
        raise CheckpointError(f"{family}: n_group={n_group} must divide n_routed_experts={num_experts} "
                              f"and topk_group={topk_group} must be in [1, n_group]")
    return RouterConfig("noaux_tc", norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), n_group=n_group,
                        topk_group=topk_group, routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)))


def _rotary(cfg: dict, head_dim: int, default_partial: float) -> dict:
    """``rotary_dim`` from ``partial_rotary_factor`` (top level or inside ``rope_parameters``)."""
    params = cfg.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", default_partial))
    rotary_dim = int(head_dim * factor)
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
        raise CheckpointError(f"partial_rotary_factor {factor} gives {rotary_dim} rotary dims of head_dim "
                              f"{head_dim}; it must give an even number in [2, head_dim]")
    return {"rotary_dim": rotary_dim}


def read_rope(cfg: dict) -> RopeConfig:
    """Read rope parameters from transformers-5 ``rope_parameters`` or legacy ``rope_scaling``."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    params = {**legacy, **params}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in _ROPE_TYPES:
        raise UnsupportedModelError(f"rope type {rope_type!r} is not supported; supported: {list(_ROPE_TYPES)}")
    opt = params.get
    factor = opt("factor")
    original = opt("original_max_position_embeddings") or cfg.get("max_position_embeddings")
    if factor is None and rope_type == "yarn" and original:
        factor = cfg.get("max_position_embeddings", original) / original  # transformers' fallback
    return RopeConfig(
        rope_type=rope_type,
        theta=float(theta),
        factor=float(factor or 1.0),
        original_max_position_embeddings=original,
        attention_factor=opt("attention_factor"),
        beta_fast=float(opt("beta_fast") or 32.0),
        beta_slow=float(opt("beta_slow") or 1.0),
        mscale=opt("mscale"),
        mscale_all_dim=opt("mscale_all_dim"),
        truncate=bool(opt("truncate", True)),
        low_freq_factor=float(opt("low_freq_factor") or 1.0),
        high_freq_factor=float(opt("high_freq_factor") or 4.0),
    )


def _check_quantization(cfg: dict, model_type: str) -> None:
    quant = cfg.get("quantization_config")
    if not quant:
        return
    method = quant.get("quant_method")
    supported = _QUANTIZATIONS.get(model_type, ())
    if method not in supported:
        raise UnsupportedModelError(
            f"quantization_config.quant_method {method!r} is not supported for {model_type}; supported: "
            f"{list(supported) or 'none (unquantized weights only)'}"
        )


def _choice(cfg: dict, key: str, default: str, supported: tuple[str, ...]) -> str:
    value = cfg.get(key) or default
    if value not in supported:
        raise UnsupportedModelError(f"{key} {value!r} is not supported for {cfg['model_type']}; supported: {list(supported)}")
    return value


def _need(cfg: dict, key: str):
    if cfg.get(key) is None:
        raise CheckpointError(f"config.json ({cfg.get('model_type')}) has no {key!r}")
    return cfg[key]
