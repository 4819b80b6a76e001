"""The families added for reach — DeepSeek-V2/V3 (MLA), GLM-4.5, gpt-oss — beyond the parity
tests every architecture shares (``test_model_parity.py``): tokens under KV pressure, the
compressed MLA cache, config switches that must fail loudly, MXFP4 experts and chat templates."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_checkpoints import _COMMON, ARCHITECTURES, hf_greedy_continuations

from batchgen_data import CheckpointError, Engine, EngineConfig, SamplingParams
from batchgen_data.model import ModelConfig, MoEModel
from batchgen_data.model.kv_cache import KVCache

NEW_ARCHS = [a for a, spec in ARCHITECTURES.items() if spec["model_type"] in ("deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss")]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 75)), [100], [7, 300, 42, 17, 99],
           list(range(200, 236)), [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12, 13]]
MAX_NEW = 20


def _kv_budget(folder, num_tokens: int, block_size: int = 8) -> int:
    specs = MoEModel.from_pretrained(folder).kv_specs
    return KVCache.bytes_per_block(specs, block_size) * (-(-num_tokens // block_size))


@pytest.mark.parametrize("arch", NEW_ARCHS)
@pytest.mark.parametrize("swap", [False, True], ids=["recompute", "swap"])
def test_tokens_identical_under_a_tight_kv_budget(tiny_checkpoint, arch, swap):
    folder, hf = tiny_checkpoint(arch)
    refs = hf_greedy_continuations(hf, PROMPTS, MAX_NEW)
    budget = _kv_budget(folder, 120)  # far below the ~300 tokens the prompts hold at once
    config = EngineConfig(block_size=8, max_num_seqs=6, attention_batch_size=3, max_num_batched_tokens=64,
                          kv_cache_memory_bytes=budget, swap_space_bytes=budget * 4 if swap else 0)
    engine = Engine(folder, config)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == refs
    stats = engine.stats()
    assert stats.num_suspended > 0, "the budget must force suspensions"
    assert (stats.num_resumed_swap > 0) == swap and (stats.num_resumed_recompute > 0) != swap


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2"])
def test_mla_cache_holds_the_compressed_latent_and_rope_key_only(tiny_checkpoint, arch):
    folder, _ = tiny_checkpoint(arch)
    config = ModelConfig.from_pretrained(folder)
    engine = Engine(folder, EngineConfig(block_size=8, kv_cache_memory_bytes=1 << 20))
    rank, rope = config.mla.kv_lora_rank, config.mla.qk_rope_head_dim
    compressed = config.num_hidden_layers * (rank + rope) * 4  # fp32 bytes per token
    expanded = config.num_hidden_layers * config.num_attention_heads * (config.mla.qk_head_dim + config.mla.v_head_dim) * 4
    assert engine.kv_bytes_per_token == compressed < expanded
    assert all(layer[0].shape[1:] == (8, rank + rope) and len(layer) == 1 for layer in engine.executor.kv_cache.layers)
    assert engine.executor.kv_cache.num_blocks == (1 << 20) // (compressed * 8)
    # Portable KV (swap, export) is the same compressed rows.
    [out] = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    seq = engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    engine.step()
    state = engine.export_sequence(seq, with_kv=True)
    assert state.kv.shape == (seq.num_tokens - 1, config.num_hidden_layers * (rank + rope))


def test_config_kv_values_match_every_attention_kinds_spec(tiny_checkpoint):
    for arch in ("deepseek_v3", "glm4_moe", "gpt_oss", "mixtral"):
        folder, _ = tiny_checkpoint(arch)
        specs = MoEModel.from_pretrained(folder).kv_specs
        assert ModelConfig.from_pretrained(folder).kv_values_per_token == sum(s.values_per_token for s in specs)


def test_mla_model_loads_no_expanded_kv_projection_per_token(tiny_checkpoint):
    """Decode never expands the cache: a decode-only forward multiplies no context through kv_b."""
    folder, _ = tiny_checkpoint("deepseek_v3")
    engine = Engine(folder, EngineConfig(block_size=8))
    attention = engine.executor.model.layers[0].attention
    calls = []
    original = attention._prefill_expanded
    attention._prefill_expanded = lambda *a: calls.append(1) or original(*a)
    engine.generate([list(range(10, 40))], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert len(calls) == 1  # the prompt's prefill only; the 4 decode steps ran absorbed


def _raw_config(arch: str, **overrides) -> dict:
    return {**_COMMON, **ARCHITECTURES[arch], **overrides}


@pytest.mark.parametrize(
    "arch,overrides,field",
    [
        ("deepseek_v3", {"topk_method": "greedy"}, "topk_method"),
        ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func"),
        ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method"),
        ("deepseek_v2", {"norm_topk_prob": True}, "norm_topk_prob"),
        ("deepseek_v3", {"quantization_config": {"quant_method": "gptq"}}, "quant_method"),
        ("deepseek_v3", {"quantization_config": {"quant_method": "fp8", "weight_block_size": 128}}, "weight_block_size"),
        ("glm4_moe", {"quantization_config": {"quant_method": "fp8"}}, "quant_method"),
        ("glm4_moe", {"hidden_act": "gelu"}, "hidden_act"),
        ("gpt_oss", {"layer_types": ["sliding_attention", "chunked_attention", "full_attention", "full_attention"]}, "layer_types"),
        ("mixtral", {"model_type": "llama4"}, "model_type"),
        ("deepseek_v3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope type"),
    ],
)
def test_unsupported_switches_fail_at_load_naming_the_field(arch, overrides, field):
    with pytest.raises(CheckpointError, match=field) as info:
        ModelConfig.from_dict(_raw_config(arch, **overrides))
    assert "supported" in str(info.value)


def test_deepseek_layer_kinds_follow_first_k_dense_replace_and_moe_layer_freq():
    config = ModelConfig.from_dict(_raw_config("deepseek_v3", num_hidden_layers=7, first_k_dense_replace=2, moe_layer_freq=2))
    assert config.sparse_layer_ids == (2, 4, 6)
    assert ModelConfig.from_dict(_raw_config("glm4_moe", first_k_dense_replace=2)).sparse_layer_ids == (2,)


def test_unsupported_checkpoint_fails_in_the_engine_with_a_checkpoint_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_raw_config("deepseek_v3", topk_method="group_limited_greedy")))
    with pytest.raises(CheckpointError, match="topk_method"):
        Engine(tmp_path)


def _reference_fp8_dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Block by block, from the format's definition: w[i, j] * scale[i // bn, j // bk]."""
    out = weight.float().clone()
    bn, bk = block
    for bi in range(scale.shape[0]):
        for bj in range(scale.shape[1]):
            out[bi * bn : (bi + 1) * bn, bj * bk : (bj + 1) * bk] *= scale[bi, bj]
    return out


def _hf_weight(hf, name: str) -> torch.Tensor:
    """The transformers parameter (or the slice of a fused expert tensor) a checkpoint key loads into."""
    if ".experts." not in name:
        return hf.get_parameter(name)
    prefix, rest = name.split(".experts.")
    expert, proj = int(rest.split(".")[0]), rest.split(".")[1]
    if proj == "down_proj":
        return hf.get_parameter(f"{prefix}.experts.down_proj")[expert]
    gate_up = hf.get_parameter(f"{prefix}.experts.gate_up_proj")[expert]  # [2F, H]
    half = gate_up.shape[0] // 2
    return gate_up[:half] if proj == "gate_proj" else gate_up[half:]


def test_block_scaled_fp8_deepseek_checkpoint_matches_transformers_on_its_dequantized_weights(tiny_checkpoint, tmp_path):
    """DeepSeek-V3 releases store projections as FP8 with a scale per weight block; the engine
    dequantizes them at load. Blocks of 16 x 16 on the tiny model leave partial blocks at edges."""
    import copy
    import shutil

    from safetensors.torch import load_file, save_file
    from tiny_checkpoints import hf_greedy_continuations

    from batchgen_data.model.attention.metadata import build_attention_metadata

    folder, cached = tiny_checkpoint("deepseek_v3")
    hf = copy.deepcopy(cached)
    out = tmp_path / "deepseek-v3-fp8"
    shutil.copytree(folder, out)
    block = (16, 16)
    state = load_file(str(out / "model.safetensors"))
    quantized = 0
    for name in list(state):
        weight = state[name]
        if not name.endswith("proj.weight") or weight.dim() != 2:
            continue  # norms, embeddings, lm_head and the router stay in full precision, as released
        rows, cols = weight.shape
        padded = torch.zeros(-(-rows // 16) * 16, -(-cols // 16) * 16)
        padded[:rows, :cols] = weight
        blocks = padded.view(padded.shape[0] // 16, 16, padded.shape[1] // 16, 16)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0  # e4m3's largest finite value
        fp8 = (weight / scale.repeat_interleave(16, 0)[:rows].repeat_interleave(16, 1)[:, :cols]).to(torch.float8_e4m3fn)
        state[name], state[f"{name}_scale_inv"] = fp8, scale
        with torch.no_grad():
            _hf_weight(hf, name).copy_(_reference_fp8_dequantize(fp8, scale, block))
        quantized += 1
    assert quantized > 20
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (out / "config.json").write_text(json.dumps(config))

    model = MoEModel.from_pretrained(out)
    prompts = PROMPTS[:4]
    lens = [len(p) for p in prompts]
    tables, start = [], 0
    for n in lens:
        tables.append(list(range(start, start + -(-n // 8))))
        start += -(-n // 8)
    hidden = model.forward(torch.tensor(sum(prompts, [])), build_attention_metadata(lens, lens, tables, 8),
                           model.new_kv_cache(start, 8))
    with torch.no_grad():
        ref = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
    assert (model.compute_logits(hidden) - ref).abs().max().item() < 1e-4
    outs = Engine(out, EngineConfig(block_size=8)).generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy_continuations(hf, prompts, 12)
