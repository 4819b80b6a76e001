"""A Ray Data LLM pipeline on batchgen-data: the import line and the model change, nothing else.

    python examples/ray_data_llm_switch.py

The same pipeline on vLLM (Ray Data LLM) reads:

    from ray.data.llm import build_processor, vLLMEngineProcessorConfig
    config = vLLMEngineProcessorConfig(model_source="Qwen/Qwen3-30B-A3B",
                                       engine_kwargs={"max_model_len": 4096}, batch_size=16, concurrency=1,
                                       chat_template_stage={"chat_template_kwargs": {"enable_thinking": False}})
"""

import sys

import ray

import prompts
from batchgen_data import build_processor, vLLMEngineProcessorConfig
from prompts import load_tickets

URGENCY = ["low", "medium", "high"]


def main(max_tokens: int = 4, num_rows: int = 8) -> list[dict]:
    # examples/ is not installed, so Ray workers cannot import these modules: ship them by value.
    for module in (prompts, sys.modules[__name__]):
        ray.cloudpickle.register_pickle_by_value(module)
    config = vLLMEngineProcessorConfig(model_source="demo", engine_kwargs={"max_model_len": 4096}, batch_size=16,
                                       concurrency=1, num_cpus=0.5,
                                       chat_template_stage={"chat_template_kwargs": {"enable_thinking": False}})
    processor = build_processor(
        config,
        preprocess=lambda row: dict(
            messages=[{"role": "system", "content": "Rate the urgency of the ticket: low, medium or high."},
                      {"role": "user", "content": row["text"]}],
            sampling_params=dict(temperature=0.0, max_tokens=max_tokens, logprobs=2,
                                 structured_outputs={"choice": URGENCY})),
        postprocess=lambda row: dict(ticket_id=row["ticket_id"], urgency=row["generated_text"],
                                     confidence=_confidence(row["logprobs"])),
    )
    ds = ray.data.from_items(load_tickets()[:num_rows])
    return processor(ds).take_all()


def _confidence(logprobs) -> float | None:
    """The probability of the answer's first token, from its logprobs (an Arrow column: per
    position a list of ``{"token_id", "logprob", "rank", "decoded_token"}``, the generated token
    first; Ray Data LLM keys each position's entries by token id instead)."""
    import math

    if logprobs is None or len(logprobs) == 0:
        return None
    return math.exp(logprobs[0][0]["logprob"])


if __name__ == "__main__":
    ray.init(num_cpus=2, include_dashboard=False)
    for row in main():
        print(row)
