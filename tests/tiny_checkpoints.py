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
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    spec = {**_COMMON, **ARCHITECTURES[arch], **config_overrides}
    model_type = spec.pop("model_type")
    config = AutoConfig.for_model(model_type, **spec)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, std)
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
