"""When a sequence stops, and the bookkeeping of its per-token outputs. No torch.

``StopChecker.check`` decides after each sampled token: a token the grammar rejects is an
error; then vLLM's stop rules in their order (``stop_reason``): end of sequence (unless
``ignore_eos``), ``stop_token_ids``, stop strings (found by detokenizing the tail, then cut where
the first one starts), ``max_tokens`` and the context limit; then a grammar that is complete
(nothing but end-of-sequence could follow) stops the sequence.

``min_tokens`` holds back the first three as vLLM does: end of sequence and stop tokens do not
stop an output shorter than ``min_tokens`` (``check_stop``), and stop strings count only once
the output is longer than that, and only where they end after the text of its first
``min_tokens`` tokens (its detokenizer does not search that text).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchgen_data.engine.core.grammar_gate import GrammarGate
    from batchgen_data.engine.core.sequence import Sequence

# Tokens decoded beyond the longest stop string when looking for one in a sequence's tail (a
# stop string can start inside a token that also holds earlier text).
_STOP_TAIL_SLACK_TOKENS = 8


class StopChecker:
    """The stop rules of one scheduler: the model's EOS ids, its context limit, the detokenizer
    for stop strings, and the grammars of constrained sequences."""

    def __init__(self, eos_token_ids: frozenset[int], max_model_len: int,
                 detokenize: Callable[[list[int]], str] | None, grammars: GrammarGate):
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.detokenize = detokenize
        self.grammars = grammars

    def check(self, seq: Sequence, token: int) -> tuple[str | None, str | None]:
        """(finish reason or None, error message or None) after ``token`` was appended."""
        error, complete = (None, False) if seq.structured is None else self.grammars.advance(seq, token)
        if error is not None:
            return "error", error
        reason = stop_reason(seq, token, self.eos_token_ids, self.max_model_len, self.detokenize)
        return ("stop" if reason is None and complete else reason), None


def stop_reason(seq: Sequence, token: int, eos_token_ids: frozenset[int], max_model_len: int,
                detokenize: Callable[[list[int]], str] | None) -> str | None:
    """``"stop"``, ``"length"`` or None (go on) after ``token`` was appended to ``seq``; a hit
    stop string also sets ``seq.stop_text_len``."""
    params = seq.params
    if seq.num_generated >= params.min_tokens:
        if not params.ignore_eos and token in eos_token_ids:
            return "stop"
        if params.stop_token_ids and token in params.stop_token_ids:
            return "stop"
    if (params.stop_strings and detokenize is not None and seq.num_generated > params.min_tokens
            and _hits_stop_string(seq, detokenize)):
        return "stop"
    if seq.num_generated >= params.max_tokens or seq.num_tokens >= max_model_len:
        return "length"
    return None


def _hits_stop_string(seq: Sequence, detokenize: Callable[[list[int]], str]) -> bool:
    stops = seq.params.stop_strings
    longest = max(len(s) for s in stops)
    tail = detokenize(seq.output_token_ids[-(longest + _STOP_TAIL_SLACK_TOKENS):])
    if not any(s in tail for s in stops):
        return False
    text = detokenize(seq.output_token_ids)
    min_tokens = seq.params.min_tokens
    held = len(detokenize(seq.output_token_ids[:min_tokens])) if min_tokens else 0  # text never searched
    hits = [(i, len(s)) for i, s in ((text.find(s, max(0, held - len(s) + 1)), s) for s in stops) if i >= 0]
    if not hits:
        return False
    cut, length = min(hits)  # the first stop string in the text (the shortest among equals: it ended first)
    seq.stop_text_len = cut + length if seq.params.include_stop_str_in_output else cut
    return True


def add_prompt_logprobs(seq: Sequence, first: int, entries: list) -> None:
    """Record prompt entries from prompt index ``first`` on (a recompute's repeats are dropped)."""
    if seq.prompt_logprobs is None:
        seq.prompt_logprobs = [None]  # the first prompt token has no logprob (vLLM's convention)
    if first == len(seq.prompt_logprobs):
        seq.prompt_logprobs.extend(entries)
