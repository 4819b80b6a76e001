"""Tiny random MoE checkpoints written by ``transformers`` itself, plus a small trained tokenizer.

Random-init logits are flat (top-1/top-2 gaps ~0.02), so weights are re-drawn with a wider
normal to give clear margins; seeds are fixed.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB_SIZE = 512
_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    num_experts_per_tok=2,
    bos_token_id=None,
    eos_token_id=2,
    pad_token_id=0,
)

ARCHITECTURES = {
    # Mixtral: always-renormalised top-2, no biases, tied=False.
    "mixtral": dict(model_type="mixtral", intermediate_size=96, num_local_experts=4),
    # Qwen3-MoE: per-head q/k norm, yarn rope scaling, a dense layer, top-k not renormalised.
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        head_dim=16,
        moe_intermediate_size=48,
        intermediate_size=128,
        num_experts=6,
        norm_topk_prob=False,
        mlp_only_layers=[1],
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    # Qwen2-MoE: shared expert with its sigmoid gate, qkv bias, linear rope scaling.
    "qwen2_moe": dict(
        model_type="qwen2_moe",
        moe_intermediate_size=48,
        shared_expert_intermediate_size=80,
        intermediate_size=128,
        num_experts=6,
        norm_topk_prob=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    ),
    # OLMoE: q/k norm over all heads, clip_qkv, tied embeddings.
    "olmoe": dict(
        model_type="olmoe",
        intermediate_size=64,
        num_experts=8,
        norm_topk_prob=False,
        clip_qkv=4.0,
        tie_word_embeddings=True,
    ),
}
_MLA = dict(num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
            moe_intermediate_size=32, intermediate_size=96, n_shared_experts=1, first_k_dense_replace=1)
# The families added for reach, one entry per router variant and attention switch.
ARCHITECTURES.update({
    # DeepSeek-V3: low-rank q, interleaved RoPE, YaRN with mscale (softmax scale), noaux_tc routing
    # over 4 groups keeping 2, a shared expert, a leading dense layer.
    "deepseek_v3": dict(
        model_type="deepseek_v3", **_MLA, q_lora_rank=24, n_routed_experts=8, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                         "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0},
    ),
    # DeepSeek-V3 switches off: plain q_proj, rotate-half RoPE, default rope, one group, no renormalisation.
    "deepseek_v3_plain": dict(
        model_type="deepseek_v3", **_MLA, q_lora_rank=None, n_routed_experts=6, n_group=1, topk_group=1,
        norm_topk_prob=False, routed_scaling_factor=1.0, rope_interleave=False,
    ),
    # DeepSeek-V2-Lite: no q LoRA, greedy softmax routing, scaled weights.
    "deepseek_v2": dict(
        model_type="deepseek_v2", **_MLA, q_lora_rank=None, n_routed_experts=6, topk_method="greedy",
        routed_scaling_factor=1.5,
    ),
    # DeepSeek-V2: low-rank q, group-limited greedy routing (4 groups, keep 2), YaRN.
    "deepseek_v2_group": dict(
        model_type="deepseek_v2", **_MLA, q_lora_rank=24, n_routed_experts=8, topk_method="group_limited_greedy",
        n_group=4, topk_group=2,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                         "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32.0, "beta_slow": 1.0},
    ),
    # GLM-4.5: q/k/v biases, half the head rotated, q/k norm, noaux_tc over 2 groups keeping 1,
    # a shared expert, a leading dense layer.
    "glm4_moe": dict(
        model_type="glm4_moe", head_dim=16, partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True,
        n_routed_experts=8, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
        moe_intermediate_size=32, intermediate_size=96, norm_topk_prob=True, routed_scaling_factor=1.5,
    ),
    # GLM-4.5 without q/k norm and without a shared expert or dense layer.
    "glm4_moe_plain": dict(
        model_type="glm4_moe", head_dim=16, partial_rotary_factor=0.5, use_qk_norm=False, attention_bias=False,
        n_routed_experts=6, n_group=1, topk_group=1, n_shared_experts=0, first_k_dense_replace=0,
        moe_intermediate_size=32, intermediate_size=96, norm_topk_prob=False,
    ),
    # gpt-oss: sinks, sliding (window 6) / full alternation, biases everywhere, top-k-then-softmax
    # router, clamped SwiGLU (a low limit so the clamp bites), YaRN.
    "gpt_oss": dict(
        model_type="gpt_oss", head_dim=16, num_local_experts=4, intermediate_size=64, sliding_window=6,
        swiglu_limit=1.0, num_hidden_layers=4,
    ),
})
ALL_ARCHS = list(ARCHITECTURES)

CHAT_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Batch inference turns millions of rows into labels, summaries and answers.",
    "Mixture-of-Experts models route every token to a few experts.",
    "Data teams classify support tickets and product reviews at scale.",
] * 20


def build_tokenizer(folder: Path):
    """Train a byte-level BPE (<1 s) and save it as a fast HF tokenizer with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|pad|>", "<|endoftext|>", "<|im_end|>", "<|im_start|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        chat_template=CHAT_TEMPLATE,
    )
    hf.save_pretrained(str(folder))
    return hf


def build_checkpoint(arch: str, folder: Path, seed: int = 0, std: float = 0.15, **config_overrides):
    """Build a random ``transformers`` model of ``arch``, save it to ``folder``; return the model."""
    from transformers import AutoModelForCausalLM

    return _build(AutoModelForCausalLM, arch, folder, seed, std, config_overrides)


def build_classifier_checkpoint(arch: str, folder: Path, num_labels: int = 3, seed: int = 0, std: float = 0.15,
                                **config_overrides):
    """A random ``*ForSequenceClassification`` model of ``arch`` (its ``score`` head has
    ``num_labels`` outputs, labels named in ``id2label``), saved to ``folder``; returns it."""
    from transformers import AutoModelForSequenceClassification

    labels = {i: f"label_{i}" for i in range(num_labels)}
    overrides = {"num_labels": num_labels, "id2label": labels, "label2id": {v: k for k, v in labels.items()},
                 **config_overrides}
    return _build(AutoModelForSequenceClassification, arch, folder, seed, std, overrides)


def _build(auto_class, arch: str, folder: Path, seed: int, std: float, config_overrides: dict):
    from transformers import AutoConfig

    torch.manual_seed(seed)
    spec = {**_COMMON, **ARCHITECTURES[arch], **config_overrides}
    model_type = spec.pop("model_type")
    config = AutoConfig.for_model(model_type, **spec)
    model = auto_class.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, std)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # choice-only bias: nonzero, so it matters
                buffer.normal_(0.0, 0.1)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    tokenizer = build_tokenizer(folder)
    # Make the tokenizer's eos the model's eos so stop behaviour matches transformers.
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    return model


def hf_greedy_continuations(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """``transformers`` greedy ``generate``, one prompt at a time, EOS ignored (full length)."""
    model.generation_config.eos_token_id = None
    refs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
            refs.append(out[0, len(prompt) :].tolist())
    return refs


def build_mtp_checkpoint(arch: str, folder: Path, seed: int = 0, std: float = 0.15):
    """``build_checkpoint`` plus one Multi-Token-Prediction layer as DeepSeek-V3 ships it
    (``benchmarks.workload.add_mtp_layer``), its decoder block drawn as ``build_checkpoint``
    draws weights. Returns (the main ``transformers`` model, a ``transformers`` model of N + 1
    layers whose last layer is the MTP block, the MTP-only tensors by name)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks.workload import add_mtp_layer

    main = build_checkpoint(arch, folder, seed, std)
    n = main.config.num_hidden_layers
    torch.manual_seed(seed + 1)
    spec = {**_COMMON, **ARCHITECTURES[arch], "num_hidden_layers": n + 1}
    model_type = spec.pop("model_type")
    longer = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **spec), dtype=torch.float32).eval()
    prefix = f"model.layers.{n}."
    with torch.no_grad():
        for name, param in longer.named_parameters():
            if name.startswith(prefix):
                is_norm = name.endswith("norm.weight") or "layernorm" in name
                param.copy_(1.0 + 0.1 * torch.randn_like(param)) if is_norm else param.normal_(0.0, std)
        for name, buffer in longer.named_buffers():
            if name.startswith(prefix) and name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    return main, longer, add_mtp_layer(folder, longer, std)
