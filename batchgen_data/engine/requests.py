"""Matching prompts with their sampling parameters: one rule for every entry point."""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC

from batchgen_data.engine.sampling_params import SamplingParams
from batchgen_data.errors import ConfigError


def pair_requests(prompts, sampling_params: SamplingParams | SequenceABC | None = None,
                  ) -> tuple[list, list[SamplingParams | None]]:
    """``(prompts, params)`` as two lists of one length.

    ``prompts`` is a list of prompts (strings, token-id lists or chat ``messages`` lists), or a
    single string, which is one prompt (as in vLLM's ``LLM.generate``). ``sampling_params`` is
    ``None``, one ``SamplingParams`` for all, or one per prompt.

    Example:
        >>> pair_requests("Hello")
        (['Hello'], [None])
    """
    if isinstance(prompts, str):
        prompts = [prompts]
    elif isinstance(prompts, dict):
        raise ConfigError("prompts must be a string or a list (of strings, token-id lists or messages lists), "
                          "got a dict")
    prompts = list(prompts)
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return prompts, [sampling_params] * len(prompts)
    params = list(sampling_params)
    if len(params) != len(prompts):
        raise ConfigError(f"got {len(params)} sampling params for {len(prompts)} prompts; pass one or one per prompt")
    return prompts, params


def truncate_prompt(prompt_token_ids: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    """``params.truncate_prompt_tokens``: the last k prompt tokens (vLLM's left truncation; -1:
    as many as the context limit leaves room for one generated token)."""
    k = params.truncate_prompt_tokens
    if k is None:
        return prompt_token_ids
    keep = max_model_len - 1 if k == -1 else k
    return prompt_token_ids[-keep:]
