"""Engine quickstart: generate from the embedded demo model (or any local MoE checkpoint).

    python examples/quickstart.py            # the demo model
    python examples/quickstart.py /path/to/qwen3-moe-checkpoint
"""

import sys

from batchgen_data import Engine, EngineConfig, SamplingParams


def main(model: str = "demo") -> None:
    engine = Engine(model, EngineConfig(max_num_seqs=64))
    prompts = [
        "Hello",
        "Classify the sentiment of this review: 'Arrived broken, support never answered.'",
        [{"role": "user", "content": "Summarise: the battery lasts two days and charges fast."}],
    ]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
    for prompt, out in zip(prompts, outputs):
        print(f"{str(prompt)[:60]!r}\n  -> {out.text!r}")
        print(f"     {out.num_input_tokens} in, {out.num_generated_tokens} out, finish={out.finish_reason}")
    stats = engine.stats()
    print(f"{stats.num_generated_tokens} tokens in {stats.busy_s:.2f}s; "
          f"{stats.mean_tokens_per_expert_call:.1f} tokens per expert call")


if __name__ == "__main__":
    main(*sys.argv[1:])
