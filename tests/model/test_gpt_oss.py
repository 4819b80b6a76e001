"""gpt-oss specifics: MXFP4 experts dequantized at load, and the harmony chat format."""

from __future__ import annotations

import copy
import json
import math
import shutil

import torch
from safetensors.torch import load_file, save_file
from tiny_checkpoints import hf_greedy_continuations

from batchgen_data import Engine, EngineConfig, SamplingParams
from batchgen_data.model import MoEModel
from batchgen_data.model.attention.metadata import build_attention_metadata
from batchgen_data.model.mxfp4 import dequantize_mxfp4

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(30, 60)), [100, 101]]


def _e2m1_value(code: int) -> float:
    """An E2M1 code's value from its bit fields (sign, 2-bit exponent with bias 1, 1-bit mantissa)."""
    sign = -1.0 if code & 0b1000 else 1.0
    exponent, mantissa = (code >> 1) & 0b11, code & 1
    magnitude = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
    return sign * magnitude


def _reference_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Element by element, from the format's definition: byte j of a block holds values 2j (low
    nibble) and 2j+1 (high nibble); the block's scale is 2 ** (scale - 127)."""
    rows = blocks.reshape(-1, 16).tolist()
    exps = scales.reshape(-1).tolist()
    out = []
    for row, exp in zip(rows, exps):
        for byte in row:
            out += [_e2m1_value(byte & 0xF) * 2.0 ** (exp - 127), _e2m1_value(byte >> 4) * 2.0 ** (exp - 127)]
    return torch.tensor(out, dtype=torch.float32).view(*scales.shape[:-1], scales.shape[-1] * 32)


def _quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] fp32 -> MXFP4 blocks [..., K/32, 16] and scales [..., K/32] (nearest value)."""
    grid = torch.tensor([_e2m1_value(c) for c in range(16)])
    groups = weight.reshape(*weight.shape[:-1], -1, 32)
    amax = groups.abs().amax(-1).clamp(min=1e-30)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)  # so the block's largest value fits
    scaled = groups / torch.pow(2.0, exp)[..., None]
    codes = (scaled[..., None] - grid).abs().argmin(-1).to(torch.uint8)  # [..., G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8)


def test_dequantizer_matches_the_format_definition():
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 5, 2, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(120, 134, (3, 5, 2), dtype=torch.uint8, generator=gen)
    assert torch.equal(dequantize_mxfp4(blocks, scales), _reference_dequantize(blocks, scales))


def _mxfp4_checkpoint(tiny_checkpoint, tmp_path):
    """The tiny gpt-oss checkpoint with its experts stored as MXFP4, and the transformers model
    holding exactly the dequantized experts."""
    folder, cached = tiny_checkpoint("gpt_oss")
    hf = copy.deepcopy(cached)  # the session's model stays as saved
    out = tmp_path / "gpt-oss-mxfp4"
    shutil.copytree(folder, out)
    state = load_file(str(out / "model.safetensors"))
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        weight = state.pop(key).transpose(1, 2).contiguous()  # [E, out, in], as MXFP4 stores it
        blocks, scales = _quantize(weight)
        state[f"{key}_blocks"], state[f"{key}_scales"] = blocks, scales
        module = hf.get_submodule(key.rsplit(".", 1)[0])
        with torch.no_grad():
            getattr(module, key.rsplit(".", 1)[1]).copy_(_reference_dequantize(blocks, scales).transpose(1, 2))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config))
    return out, hf


def test_mxfp4_checkpoint_matches_transformers_on_the_dequantized_weights(tiny_checkpoint, tmp_path):
    folder, hf = _mxfp4_checkpoint(tiny_checkpoint, tmp_path)
    model = MoEModel.from_pretrained(folder)
    lens = [len(p) for p in PROMPTS]
    tables, start = [], 0
    for n in lens:
        tables.append(list(range(start, start + math.ceil(n / 8))))
        start += math.ceil(n / 8)
    kv = model.new_kv_cache(num_blocks=start, block_size=8)
    hidden = model.forward(torch.tensor(sum(PROMPTS, [])), build_attention_metadata(lens, lens, tables, 8), kv)
    with torch.no_grad():
        ref = torch.cat([hf(torch.tensor([p])).logits[0] for p in PROMPTS])
    assert (model.compute_logits(hidden) - ref).abs().max().item() < 1e-4
    refs = hf_greedy_continuations(hf, PROMPTS, 12)
    outs = Engine(folder, EngineConfig(block_size=8)).generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == refs


# A harmony-format template using the jinja features gpt-oss's own template relies on
# (``strftime_now``, ``raise_exception``, a ``reasoning_effort`` default, channels); the official
# file cannot be downloaded here.
HARMONY_TEMPLATE = (
    "{%- set effort = reasoning_effort | default('medium') -%}"
    "{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\\n"
    "Knowledge cutoff: 2024-06\\nCurrent date: ' + strftime_now('%Y-%m-%d') + '\\n\\nReasoning: ' + effort + "
    "'\\n\\n# Valid channels: analysis, commentary, final.<|end|>' -}}"
    "{%- for m in messages -%}"
    "{%- if m['role'] in ('system', 'developer') -%}"
    "{{- '<|start|>developer<|message|># Instructions\\n\\n' + m['content'] + '<|end|>' -}}"
    "{%- elif m['role'] == 'user' -%}{{- '<|start|>user<|message|>' + m['content'] + '<|end|>' -}}"
    "{%- elif m['role'] == 'assistant' -%}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + m['content'] + '<|end|>' -}}"
    "{%- else -%}{{- raise_exception('unknown role ' + m['role']) -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}"
)
HARMONY_TOKENS = ["<|start|>", "<|message|>", "<|end|>", "<|channel|>", "<|return|>"]


def test_harmony_chat_template_renders_through_transformers(tiny_checkpoint, tmp_path):
    from transformers import AutoTokenizer

    folder, _ = tiny_checkpoint("gpt_oss")
    out = tmp_path / "gpt-oss-harmony"
    shutil.copytree(folder, out)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    tokenizer.chat_template = HARMONY_TEMPLATE
    tokenizer.save_pretrained(str(out))
    assert max(tokenizer.convert_tokens_to_ids(HARMONY_TOKENS)) < json.loads((out / "config.json").read_text())["vocab_size"]

    messages = [{"role": "developer", "content": "Label the ticket."}, {"role": "user", "content": "The blender broke."}]
    engine = Engine(out, EngineConfig(block_size=8))
    ids = engine.tokenizer.encode(messages)
    expected = AutoTokenizer.from_pretrained(str(out)).apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert ids == list(expected["input_ids"])
    text = engine.tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|start|>system<|message|>") and text.endswith("<|start|>user<|message|>The blender broke.<|end|><|start|>assistant")
    [result] = engine.generate([messages], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert result.num_input_tokens == len(ids) and result.num_generated_tokens == 4
    [bad] = engine.generate([[{"role": "robot", "content": "hi"}]], SamplingParams(max_tokens=2))
    assert bad.finish_reason == "error" and "unknown role robot" in bad.error
