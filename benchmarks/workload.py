"""The benchmark's model and skewed workload, shared by the throughput and skew benchmarks.

Output lengths follow the shape of the BatchGen paper's production trace: P99 = 3.8 x P95 and
max = 9 x P95, with a lognormal body. Lengths are placed exactly by the quantile function (then
shuffled), so every run has the same tail ratios.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

BENCH_MODEL_CONFIG = dict(
    model_type="mixtral",
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=4,
    num_attention_heads=12,
    num_key_value_heads=4,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)
# A DeepSeek-V3-shaped model of similar size: MLA (latent 256 + RoPE key 32 per token and layer),
# a leading dense layer, 16 routed experts in 4 groups (top-2 groups, top-4 experts) and a shared
# expert, sigmoid noaux_tc routing with a correction bias.
BENCH_DEEPSEEK_V3_CONFIG = dict(
    model_type="deepseek_v3",
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=2048,
    moe_intermediate_size=512,
    num_hidden_layers=4,
    first_k_dense_replace=1,
    num_attention_heads=12,
    num_key_value_heads=12,
    q_lora_rank=384,
    kv_lora_rank=256,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    n_routed_experts=16,
    n_shared_experts=1,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)
# For offloading: the same layer shapes with 16 experts and a small vocabulary, so the routed
# experts (1.2 GB in fp32) are ~94% of the weights and a budget of a third of them still holds
# the dense part (~80 MB) and a pool.
BENCH_OFFLOAD_CONFIG = dict(BENCH_MODEL_CONFIG, vocab_size=8000, num_local_experts=16)
# For prefix caching: a small Mixtral (hidden 512, 8 experts, vocabulary 2,048), where a
# templated job's time is mostly prefill of the shared instruction.
BENCH_PREFIX_CONFIG = dict(BENCH_MODEL_CONFIG, vocab_size=2048, hidden_size=512, intermediate_size=1408,
                           num_attention_heads=8, num_key_value_heads=4)
# For decode steps against llama.cpp (issue #35): the prefix model's layers with 16 experts and a
# vocabulary of 8,192; one sequence's step reads ~94 MiB of weights (attention, 2 of 16 experts
# per layer, the LM head).
BENCH_DECODE_CONFIG = dict(BENCH_PREFIX_CONFIG, vocab_size=8192, num_local_experts=16)
# For prompt_logprobs (issue #36): the prefix model's layers, 32 of them as in Mixtral 8x7B, with
# its 32k vocabulary, so the LM head is ~9% of a token's FLOPs as in real MoE models (Mixtral
# 8x7B ~1%, Qwen3-30B-A3B ~10%) where the demo's is 92%; ~610 M parameters, 2.4 GB in fp32.
BENCH_DEEP_CONFIG = dict(BENCH_PREFIX_CONFIG, vocab_size=32000, num_hidden_layers=32)
BENCH_MODELS = {"mixtral": ("bench-mixtral-206m", BENCH_MODEL_CONFIG),
                "mixtral_deep": ("bench-mixtral-deep-32l", BENCH_DEEP_CONFIG),
                "mixtral_decode": ("bench-mixtral-decode-16e", BENCH_DECODE_CONFIG),
                "mixtral_small": ("bench-mixtral-small-prefix", BENCH_PREFIX_CONFIG),
                "deepseek_v3": ("bench-deepseek-v3-mla", BENCH_DEEPSEEK_V3_CONFIG),
                "mixtral_16e": ("bench-mixtral-16e-320m", BENCH_OFFLOAD_CONFIG)}


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def output_length_quantile(u: float, p95: int) -> float:
    """Lognormal body up to P95; a Pareto tail with P99 = 3.8 x P95, capped at 9 x P95."""
    if u <= 0.95:
        sigma = 0.6
        median = p95 / math.exp(1.645 * sigma)
        z = _norm_ppf(u)
        return median * math.exp(sigma * z)
    alpha = math.log(3.8) / math.log(5.0)  # (0.05 / 0.01) ** alpha == 3.8
    return min(p95 * (0.05 / (1.0 - u)) ** alpha, 9 * p95)


def make_workload(num_requests: int, p95_output: int, median_prompt: int, vocab: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    lens = [max(1, round(output_length_quantile((i + 0.5) / num_requests, p95_output))) for i in range(num_requests)]
    lens[-1] = 9 * p95_output  # the longest request sits exactly at the trace's max ratio
    rng.shuffle(lens)
    prompts = []
    for _ in range(num_requests):
        length = int(min(max(4, rng.lognormvariate(math.log(median_prompt), 0.7)), 8 * median_prompt))
        prompts.append([rng.randrange(3, vocab) for _ in range(length)])
    return Workload(prompts, lens)


def percentile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _norm_ppf(p: float) -> float:
    """Inverse normal CDF (Acklam's rational approximation, |error| < 1.2e-9)."""
    a = [-3.969683028665376e01, 2.209460984245205e02, -2.759285104469687e02, 1.383577518672690e02, -3.066479806614716e01, 2.506628277459239e00]
    b = [-5.447609879822406e01, 1.615858368580409e02, -1.556989798598866e02, 6.680131188771972e01, -1.328068155288572e01]
    c = [-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e00, -2.549732539343734e00, 4.374664141464968e00, 2.938163982698783e00]
    d = [7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e00, 3.754408661907416e00]
    lo = 0.02425
    if p < lo:
        q = math.sqrt(-2 * math.log(p))
        return (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) / ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1)
    if p > 1 - lo:
        return -_norm_ppf(1 - p)
    q = p - 0.5
    r = q * q
    return (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q / (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1)


def build_bench_model(folder: Path, seed: int = 0, arch: str = "mixtral"):
    """The benchmark MoE of ``arch`` (``BENCH_MODELS``; Mixtral: ~206 M parameters), fp32,
    saved once into ``folder``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(BENCH_MODELS[arch][1])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    if (folder / "config.json").is_file():
        return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # random routers pick groups by it too
                buffer.normal_(0.0, 0.02)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    return model


def add_mtp_layer(folder: Path, longer, std: float = 0.02) -> dict:
    """Make the checkpoint in ``folder`` (N layers) one with a Multi-Token-Prediction layer, as
    DeepSeek-V3 ships it: ``longer`` (a ``transformers`` model of the same family with N + 1
    layers) gives layer N's decoder block; ``enorm``, ``hnorm``, ``eh_proj`` and
    ``shared_head.norm`` are drawn here (norms near 1, ``eh_proj`` normal with ``std``), the copies
    of the embedding and head the release format stores are added, and config.json gets
    ``num_nextn_predict_layers: 1``. Returns the drawn MTP-only tensors by name."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((folder / "config.json").read_text())
    n, hidden = config["num_hidden_layers"], config["hidden_size"]
    prefix = f"model.layers.{n}."
    weights = load_file(str(folder / "model.safetensors"))
    block = {name: t.detach().clone().contiguous() for name, t in longer.state_dict().items() if name.startswith(prefix)}
    drawn = {
        f"{prefix}enorm.weight": 1.0 + 0.1 * torch.randn(hidden),
        f"{prefix}hnorm.weight": 1.0 + 0.1 * torch.randn(hidden),
        f"{prefix}eh_proj.weight": std * torch.randn(hidden, 2 * hidden),
        f"{prefix}shared_head.norm.weight": 1.0 + 0.1 * torch.randn(hidden),
    }
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    copies = {f"{prefix}embed_tokens.weight": weights["model.embed_tokens.weight"].clone(),
              f"{prefix}shared_head.head.weight": head.clone()}
    save_file({**weights, **block, **drawn, **copies}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return drawn


def build_bench_mtp_model(folder: Path, arch: str = "deepseek_v3", seed: int = 0) -> Path:
    """``build_bench_model(arch)`` with a random MTP layer (``add_mtp_layer``), saved once into
    ``folder``: the same main weights as the benchmark model of that seed."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if (folder / "config.json").is_file():
        return folder
    build_bench_model(folder, seed, arch)
    spec = dict(BENCH_MODELS[arch][1])
    spec["num_hidden_layers"] += 1
    torch.manual_seed(seed + 1)
    longer = AutoModelForCausalLM.from_config(AutoConfig.for_model(spec.pop("model_type"), **spec), dtype=torch.float32)
    add_mtp_layer(folder, longer)
    return folder
