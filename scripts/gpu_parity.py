"""Model maths against ``transformers`` on one device, every family, layer by layer.

For each tiny test architecture (``tests/tiny_checkpoints.py``) this builds the checkpoint, loads
it in ``transformers`` and in batchgen-data on ``--device`` in fp32, and reports:

- the largest prefill logit difference;
- the first decoder layer whose residual stream differs by more than ``--tolerance`` (with the
  layer's attention kind: sliding window, sinks), so a divergence is located, not just seen;
- whether greedy continuations are token-identical (``Engine.generate`` against
  ``transformers`` ``generate``).

Exit status 1 when any family differs. It runs anywhere (``--device cpu`` is what the test
suite runs); on a GPU machine::

    .venv/bin/python scripts/gpu_parity.py --device cuda
    .venv/bin/python scripts/gpu_parity.py --device cuda --archs gpt_oss --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 75)), [100], [7, 300, 42, 17, 99]]


def _our_hidden_states(model, prompts: list[list[int]], device: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The residual stream after every decoder layer of one flat prefill, and the logits."""
    from batchgen_data.model.attention.metadata import AttentionBatch, build_attention_metadata

    block_size = 8
    kv = model.new_kv_cache(num_blocks=64, block_size=block_size)
    tables, next_block = [], 0
    for p in prompts:
        n = -(-len(p) // block_size)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    lens = [len(p) for p in prompts]
    meta = build_attention_metadata(lens, lens, tables, block_size)
    batch = AttentionBatch.combine([meta], model.rotary, model.dtype)
    h = model.embed(torch.tensor(sum(prompts, []), device=device))
    states = []
    for layer_id, layer in enumerate(model.layers):
        h = layer.attention_block(h, batch, kv.layers[layer_id])
        h, _ = layer.ffn_block(h)
        states.append(h)
    return states, model.compute_logits(h)


def _hf_hidden_states(hf, prompts: list[list[int]], device: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """transformers' residual stream after every layer (the last one before the final norm, as
    ours), prompt by prompt, concatenated; and the logits."""
    per_layer: list[list[torch.Tensor]] = []
    logits = []
    captured: list[torch.Tensor] = []
    last = hf.model.layers[-1]
    handle = last.register_forward_hook(
        lambda module, args, out: captured.append((out[0] if isinstance(out, tuple) else out)[0]))
    try:
        for p in prompts:
            out = hf(torch.tensor([p], device=device), output_hidden_states=True)
            layers = [h[0] for h in out.hidden_states[1:-1]] + [captured.pop()]
            per_layer.append(layers)
            logits.append(out.logits[0])
    finally:
        handle.remove()
    return [torch.cat([layers[i] for layers in per_layer]) for i in range(len(per_layer[0]))], torch.cat(logits)


def _layer_kind(hf, layer_id: int) -> str:
    config = hf.config
    kinds = getattr(config, "layer_types", None)
    kind = kinds[layer_id] if kinds else "full_attention"
    if getattr(config, "model_type", "") == "gpt_oss":
        kind += " + sinks"
    return kind


def check(arch: str, device: str, max_new_tokens: int, tolerance: float, folder: Path) -> dict:
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_checkpoints import build_checkpoint, hf_greedy_continuations

    from batchgen_data import Engine, EngineConfig, SamplingParams
    from batchgen_data.model import MoEModel

    hf = build_checkpoint(arch, folder).to(device)
    ours = MoEModel.from_pretrained(folder, torch.float32, device)
    with torch.no_grad():
        hf_states, hf_logits = _hf_hidden_states(hf, PROMPTS, device)
        our_states, our_logits = _our_hidden_states(ours, PROMPTS, device)
    first_bad = None
    for layer_id, (a, b) in enumerate(zip(our_states, hf_states)):
        diff = (a - b).abs().max().item()
        if diff > tolerance:
            first_bad = (layer_id, _layer_kind(hf, layer_id), diff)
            break
    with torch.no_grad():
        refs = _hf_greedy_on(hf, PROMPTS, max_new_tokens, device, hf_greedy_continuations)
    engine = Engine(folder, EngineConfig(device=device, dtype="float32", max_num_seqs=4, block_size=8))
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=max_new_tokens, temperature=0, ignore_eos=True))
    engine.close()
    return {
        "arch": arch,
        "max_logit_diff": (our_logits - hf_logits).abs().max().item(),
        "first_differing_layer": first_bad,
        "tokens_identical": [o.token_ids for o in outs] == refs,
    }


def _hf_greedy_on(hf, prompts, max_new_tokens, device, hf_greedy_continuations):
    if device == "cpu":
        return hf_greedy_continuations(hf, prompts, max_new_tokens)
    hf.generation_config.eos_token_id = None
    refs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
        refs.append(out[0, len(prompt):].tolist())
    return refs


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_checkpoints import ALL_ARCHS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--archs", default=",".join(ALL_ARCHS), help=f"comma-separated, of {ALL_ARCHS}")
    parser.add_argument("--max-new-tokens", type=int, default=20)
    parser.add_argument("--tolerance", type=float, default=1e-4, help="largest residual-stream difference")
    args = parser.parse_args(argv)
    failed = 0
    print(f"{'arch':<22} {'max logit diff':>15}  {'first differing layer':<40} tokens")
    for arch in args.archs.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            r = check(arch, args.device, args.max_new_tokens, args.tolerance, Path(tmp))
        layer = "none" if r["first_differing_layer"] is None else \
            "{} ({}): {:.2e}".format(*r["first_differing_layer"])
        ok = r["tokens_identical"] and r["first_differing_layer"] is None
        failed += not ok
        print(f"{arch:<22} {r['max_logit_diff']:>15.2e}  {layer:<40} {'identical' if r['tokens_identical'] else 'DIFFER'}",
              flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
