"""The model layer computes what transformers computes, for every supported architecture."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from tiny_checkpoints import ALL_ARCHS, hf_greedy_continuations

from batchgen_data import Engine, EngineConfig, SamplingParams
from batchgen_data.model import MoEModel
from batchgen_data.model.attention.metadata import build_attention_metadata

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 75)), [100], [7, 300, 42, 17, 99]]


def _our_logits(model: MoEModel, prompts: list[list[int]], block_size: int = 8) -> torch.Tensor:
    """Prefill all prompts in one flat batch; logits for every token."""
    kv = model.new_kv_cache(num_blocks=64, block_size=block_size)
    tables, next_block = [], 0
    for p in prompts:
        n = -(-len(p) // block_size)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    lens = [len(p) for p in prompts]
    meta = build_attention_metadata(lens, lens, tables, block_size)
    hidden = model.forward(torch.tensor(sum(prompts, [])), meta, kv)
    return model.compute_logits(hidden)


@pytest.mark.parametrize("arch", ALL_ARCHS)
@pytest.mark.parametrize("backend", ["native", "deepspeed"])
def test_prefill_logits_match_transformers(tiny_checkpoint, arch, backend):
    folder, hf = tiny_checkpoint(arch)
    model = MoEModel.from_pretrained(folder, expert_backend=backend)
    with torch.no_grad():
        ref = torch.cat([hf(torch.tensor([p])).logits[0] for p in PROMPTS])
    ours = _our_logits(model, PROMPTS)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_greedy_continuations_match_transformers_generate(tiny_checkpoint, arch):
    folder, hf = tiny_checkpoint(arch)
    max_new = 20
    refs = hf_greedy_continuations(hf, PROMPTS, max_new)
    engine = Engine(folder, EngineConfig(max_num_seqs=4, attention_batch_size=2, block_size=8))
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == refs
    assert all(o.num_generated_tokens == max_new and o.finish_reason == "length" for o in outs)


def test_expert_backends_agree(tiny_checkpoint):
    folder, _ = tiny_checkpoint("qwen2_moe")
    native = _our_logits(MoEModel.from_pretrained(folder, expert_backend="native"), PROMPTS)
    deepspeed = _our_logits(MoEModel.from_pretrained(folder, expert_backend="deepspeed"), PROMPTS)
    assert (native - deepspeed).abs().max().item() < 1e-5


def test_grouped_mm_path_matches_loop(tiny_checkpoint):
    folder, _ = tiny_checkpoint("mixtral")
    model = MoEModel.from_pretrained(folder)
    loop = _our_logits(model, PROMPTS)
    for layer in model.layers:
        layer.ffn.experts.use_grouped_mm = True
    grouped = _our_logits(model, PROMPTS)
    assert (loop - grouped).abs().max().item() < 1e-5


def test_sharded_and_fused_checkpoints_load_identically(tiny_checkpoint, tmp_path):
    folder, hf = tiny_checkpoint("qwen3_moe")
    reference = _our_logits(MoEModel.from_pretrained(folder), PROMPTS)

    sharded = tmp_path / "sharded"
    hf.save_pretrained(str(sharded), max_shard_size="200KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    (sharded / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    assert torch.equal(_our_logits(MoEModel.from_pretrained(sharded), PROMPTS), reference)

    fused = tmp_path / "fused"
    fused.mkdir()
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state), "transformers keeps experts fused in memory"
    save_file(state, str(fused / "model.safetensors"))
    (fused / "config.json").write_bytes((folder / "config.json").read_bytes())
    assert torch.equal(_our_logits(MoEModel.from_pretrained(fused), PROMPTS), reference)


def test_demo_model_matches_transformers(demo_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(demo_path), dtype=torch.float32).eval()
    prompts = [[9707, 1879, 11], [151644, 872, 198, 6023, 151645, 198, 151644, 77091, 198]]
    with torch.no_grad():
        ref = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
    ours = _our_logits(MoEModel.from_pretrained(demo_path), prompts)
    assert (ours - ref).abs().max().item() < 1e-4


def test_sliding_window_attention_matches_transformers(tmp_path):
    from tiny_checkpoints import build_checkpoint

    from batchgen_data.model import ModelConfig

    folder = tmp_path / "mixtral-sliding"
    hf = build_checkpoint("mixtral", folder, sliding_window=8)
    assert ModelConfig.from_pretrained(folder).sliding_windows[0] == 8
    prompts = [list(range(30, 60)), [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]]
    with torch.no_grad():
        ref = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
    ours = _our_logits(MoEModel.from_pretrained(folder), prompts)
    assert (ours - ref).abs().max().item() < 1e-4
    refs = hf_greedy_continuations(hf, prompts, 12)  # decoding past the window
    outs = Engine(folder, EngineConfig(block_size=8)).generate(
        prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    )
    assert [o.token_ids for o in outs] == refs
