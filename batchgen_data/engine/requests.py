"""Matching prompts with their sampling parameters: one rule for every entry point."""

from __future__ import annotations

import copy
from collections.abc import Sequence as SequenceABC
from typing import TYPE_CHECKING

from batchgen_data.engine.pooling_params import PoolingParams
from batchgen_data.engine.sampling_params import SamplingParams
from batchgen_data.errors import ConfigError, RequestError

if TYPE_CHECKING:
    from batchgen_data.engine.tokenizer import PromptTokenizer

# Most token sequences the bad words of one request may tokenize to (vLLM's default
# VLLM_MAX_NUM_BAD_WORDS): each is matched against the output's tail at every step.
MAX_BAD_WORD_SEQUENCES = 128


def pair_requests(prompts, sampling_params: SamplingParams | PoolingParams | SequenceABC | None = None,
                  ) -> tuple[list, list]:
    """``(prompts, params)`` as two lists of one length.

    ``prompts`` is a list of prompts (strings, token-id lists or chat ``messages`` lists), or a
    single string, which is one prompt (as in vLLM's ``LLM.generate``). ``sampling_params`` is
    ``None``, one ``SamplingParams`` (or ``PoolingParams``) for all, or one per prompt.

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
    if sampling_params is None or isinstance(sampling_params, (SamplingParams, PoolingParams)):
        return prompts, [sampling_params] * len(prompts)
    params = list(sampling_params)
    if len(params) != len(prompts):
        raise ConfigError(f"got {len(params)} sampling params for {len(prompts)} prompts; pass one or one per prompt")
    return prompts, params


def truncate_prompt(prompt_token_ids: list[int], params: SamplingParams | PoolingParams,
                    max_model_len: int) -> list[int]:
    """``params.truncate_prompt_tokens``: the last k prompt tokens (vLLM's left truncation; -1:
    as many as the context limit holds beside the request's first generated token)."""
    k = params.truncate_prompt_tokens
    if k is None:
        return prompt_token_ids
    keep = max_model_len - num_reserved_tokens(params) if k == -1 else k
    return prompt_token_ids[-keep:]


def num_reserved_tokens(params: SamplingParams | PoolingParams) -> int:
    """Context a request needs past its prompt before it can finish: a slot for its first
    generated token; none for a pooling request (it generates nothing)."""
    return min(1, params.max_tokens)


def resolve_token_params(params, tokenizer: PromptTokenizer):
    """``params`` checked against the model's vocabulary, with what its logits processors need
    from the tokenizer (vLLM's request processing: ``_validate_logit_bias``,
    ``_validate_allowed_token_ids``, ``update_from_tokenizer``, ``update_from_generation_config``):
    ``bad_words`` as token sequences, and the end-of-sequence ids ``min_tokens`` masks.

    Returns a copy holding them when there is something to hold (the caller's object may be
    shared by many prompts), else ``params`` itself; anything but a ``SamplingParams`` passes
    through. Raises ``RequestError`` naming out-of-vocabulary ids.
    """
    if not isinstance(params, SamplingParams) or not params.adjusts_logits:
        return params
    vocab_size = tokenizer.vocab_size
    if params.logit_bias:
        bad = [t for t in params.logit_bias if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"token_id(s) {bad} in logit_bias contain out-of-vocab token ids. "
                               f"Vocabulary size: {vocab_size}")
    if params.allowed_token_ids is not None:
        bad = [t for t in params.allowed_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"allowed_token_ids contains out-of-vocab token id(s) {bad[:5]}. "
                               f"Vocabulary size: {vocab_size}")
    if not params.bad_words and not params.min_tokens:
        return params
    resolved = copy.copy(params)
    if params.bad_words:
        resolved._bad_words_token_ids = _bad_words_token_ids(params.bad_words, tokenizer)
    if params.min_tokens:
        stops = set(params.stop_token_ids or ()) | set(tokenizer.eos_token_ids)
        resolved._all_stop_token_ids = frozenset(t for t in stops if 0 <= t < vocab_size)  # others never sample
    return resolved


def _bad_words_token_ids(words: list[str], tokenizer: PromptTokenizer) -> tuple[tuple[int, ...], ...]:
    """vLLM's ``SamplingParams.update_from_tokenizer``: each word without special tokens, as it
    starts a text and, when that tokenizes differently into as many tokens, after a space."""
    if tokenizer.hf is None:
        raise RequestError(f"bad_words need a tokenizer, and {str(tokenizer.folder)!r} has none")
    found: list[list[int]] = []
    for word in words:
        plain = tokenizer.hf.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise RequestError(f"bad_words entries must tokenize to at least one token, got {word!r}")
        found.append(plain)
        spaced = tokenizer.hf.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            found.append(spaced)
        if len(found) > MAX_BAD_WORD_SEQUENCES:
            raise RequestError(f"too many bad words after tokenization: {len(found)}; "
                               f"the most is {MAX_BAD_WORD_SEQUENCES}")
    bad = sorted({t for ids in found for t in ids if not 0 <= t < tokenizer.vocab_size})
    if bad:
        raise RequestError(f"the model vocabulary size is {tokenizer.vocab_size}, but bad_words tokenize to "
                           f"token ids {bad[:5]}")
    return tuple(tuple(ids) for ids in found)
