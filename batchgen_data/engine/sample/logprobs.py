"""Log-probabilities with vLLM's meaning: what a request gets back for ``logprobs`` /
``prompt_logprobs``. No torch.

For each position the engine keeps a ``TokenLogprobs``: the token that was there (sampled, or the
prompt's next token) and the ``k`` most likely tokens, each with its log-probability under the
model's distribution (log-softmax of the logits before temperature, top-k/top-p and penalties:
vLLM's default ``raw_logprobs``; for a constrained row, after its grammar mask, as in vLLM) and its
1-based rank in that distribution. ``Logprob`` is the public per-token value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(slots=True)
class Logprob:
    """One token's log-probability, as ``vllm.logprobs.Logprob``: ``rank`` is 1 for the most
    likely token; ``decoded_token`` is its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class TokenLogprobs:
    """One position: ``token_ids[0]`` is the token that was there, then the top-k not already
    listed; ``logprobs`` and ``ranks`` follow the same order."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]

    def to_dict(self, texts: Mapping[int, str] | None = None) -> dict[int, Logprob]:
        """``{token_id: Logprob}`` in this order (vLLM's per-position dict); ``texts`` gives each
        token's ``decoded_token``."""
        if texts is None:
            return {t: Logprob(lp, r) for t, lp, r in zip(self.token_ids, self.logprobs, self.ranks)}
        return {t: Logprob(lp, r, texts[t]) for t, lp, r in zip(self.token_ids, self.logprobs, self.ranks)}
