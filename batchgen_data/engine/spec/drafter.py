"""The scheduler's side of speculative decoding: drafts in, accepted tokens out. No torch.

NOTE: one step with drafts (``docs/architecture.md``, "Speculative decoding"):
  draft    when every running sequence is decoding, each eligible row's proposer offers up to
           ``num_speculative_tokens`` tokens and the policy keeps 0..k of them per row
           (``policy.py``); a kept draft gets KV slots (never by suspending anyone) and goes in
           ``seq.draft_token_ids``. The row's query in this forward is its pending token plus
           its draft: k + 1 positions, like a short prefill chunk.
  verify   the runner samples every one of the k + 1 positions, position j with the noise of
           (seed, tokens generated + j): the token plain decoding would sample there, if the
           draft before it is what plain decoding produced.
  accept   the longest prefix of the draft equal to the sampled tokens is kept, plus the
           sampled token after it; the sequence's computed tokens grow by that many (the KV of
           rejected positions sits in slots beyond them and is overwritten later; the prefix
           cache names only blocks of accepted tokens). Each token then goes through the stop
           rules in order, so EOS, stop strings and max_tokens cut a step's tokens where plain
           decoding would stop.
A constrained row drafts only the prefix of its proposal its grammar accepts, cut before a token
that would complete the grammar; its k + 1 positions each get the mask of the grammar state after
the draft tokens before it, and the grammar advances only over the tokens kept. Rows with a
logits processor or a penalty do not draft (their logits at position j would need the output
after the draft's first j tokens); they decode as without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from batchgen_data.config.speculative import SpeculativeConfig
from batchgen_data.engine.spec.policy import (
    JOB_DECAY,
    PROBE_EVERY,
    RowAcceptance,
    StepCosts,
    choose_draft_lengths,
    may_pay,
    paying_lengths,
)
from batchgen_data.engine.spec.proposers import MTPProposer, NgramProposer, Proposer, SuffixProposer

if TYPE_CHECKING:
    from batchgen_data.engine.core.grammar_gate import GrammarGate
    from batchgen_data.engine.core.kv_manager import KVCacheManager
    from batchgen_data.engine.core.sequence import Sequence


@dataclass(slots=True)
class SpecStats:
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0  # draft tokens accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_drafted_tokens if self.num_drafted_tokens else 0.0


class Drafter:
    """Drafts for one scheduler (see module NOTE).

    Args:
        config: the engine's ``speculative_config``.
        max_model_len: the context limit (a draft never runs past it).
        proposer: overrides the config's proposer (benchmarks: an oracle, a never-right one).

    ``fixed_length``, when set (benchmarks and tests), replaces the policy: every eligible row
    drafts that many tokens where its proposer offers them.
    """

    def __init__(self, config: SpeculativeConfig, max_model_len: int, proposer: Proposer | None = None):
        self.config = config
        self.max_model_len = max_model_len
        self.default_proposer: Proposer = make_proposer(config)
        self.proposer: Proposer = proposer or self.default_proposer
        self.fixed_length: int | None = None
        self.enabled = True  # benchmarks turn speculation off in the same engine for a baseline
        self.costs = StepCosts()
        self.stats = SpecStats()
        self.job_acceptance = RowAcceptance(decay=JOB_DECAY)  # every row's drafts: each row's prior
        self._steps_since_probe = 0

    def draft(self, running: list[Sequence], kv: KVCacheManager, budget: int, grammars: GrammarGate) -> None:
        """Give eligible decoding rows their drafts for this step (``seq.draft_token_ids``)."""
        if not self.enabled or not running or any(seq.num_pending_tokens != 1 or seq.is_pooling for seq in running):
            return  # a step with prefill chunks is not a decode step: no drafts
        if self.fixed_length is None and not may_pay(self.costs, len(running)):
            return  # even a draft sure to be accepted would not pay at this size: no per-row work
        rows = [seq for seq in running if _eligible(seq)]
        if not rows:
            return
        k_max = max(self.config.num_speculative_tokens, self.fixed_length or 0)
        limits = []
        for seq in rows:
            limits.append(max(0, min(k_max, seq.num_tokens_left - 1, self.max_model_len - seq.num_tokens - 1)))
            if seq.draft_acceptance is None:
                seq.draft_acceptance = RowAcceptance()
        if self.fixed_length is not None:
            lengths = [min(self.fixed_length, limit) for limit in limits]
        else:  # the policy first: a large running set asks no proposer at all
            self._steps_since_probe += 1
            lengths = choose_draft_lengths([seq.draft_acceptance for seq in rows], limits, self.costs, k_max,
                                           prior=self.job_acceptance.p,
                                           may_probe=self._steps_since_probe >= PROBE_EVERY)
            if self._steps_since_probe >= PROBE_EVERY and any(lengths):
                self._steps_since_probe = 0
        offers = [self.proposer.propose(seq, n)[:n] if n > 0 else [] for seq, n in zip(rows, lengths)]
        offers = [grammars.valid_draft(seq, offer) if offer and seq.structured is not None else offer
                  for seq, offer in zip(rows, offers)]  # a constrained row drafts only what its grammar allows
        lengths = [len(offer) for offer in offers]
        room = budget - len(running)  # the step's token budget left after one token per row
        for seq, offer, length in zip(rows, offers, lengths):
            length = min(length, room)
            if length <= 0:
                continue
            needed = kv.blocks_for(seq.num_tokens + length) - len(seq.block_ids)
            if needed > 0:
                if not kv.can_allocate(needed):
                    continue
                kv.append_slots(seq, needed)
            seq.draft_token_ids = offer[:length]
            room -= length
            self.stats.num_drafted_tokens += length

    def lookahead(self, running: list[Sequence]) -> int:
        """With an MTP layer: how many tokens the runner drafts, in this step, for each row's
        next one: the longest draft the policy would keep for a row at today's acceptance
        (``paying_lengths``), at least 1 when a probe is due; 0 where no draft could pay at this
        running set's size. Each draft token costs the layer and its head once more."""
        if self.config.method != "mtp" or not self.enabled or not running:
            return 0
        if self.fixed_length is not None:
            return self.fixed_length
        if not may_pay(self.costs, len(running)):
            return 0
        prior = self.job_acceptance.p
        p = [prior if seq.draft_acceptance is None else seq.draft_acceptance.p_with(prior) for seq in running]
        k = self.config.num_speculative_tokens
        lengths, _, _ = paying_lengths(p, [k] * len(running), self.costs, k)
        return max(lengths + [1 if self._steps_since_probe + 1 >= PROBE_EVERY else 0])

    def accept(self, seq: Sequence, sampled: list[int]) -> list[int]:
        """The tokens a drafted row keeps: the draft's longest prefix equal to ``sampled``
        (the tokens sampled at its k + 1 positions), then the sampled token after it."""
        draft = seq.draft_token_ids
        n = num_accepted(draft, sampled)
        seq.draft_acceptance.update(len(draft), n)
        self.job_acceptance.update(len(draft), n)
        self.stats.num_accepted_tokens += n
        seq.draft_token_ids = []
        return sampled[: n + 1]

    def finished(self, seq: Sequence) -> None:
        """A row finished: a proposer that learns from the job's outputs sees it."""
        observe = getattr(self.proposer, "observe", None)
        if observe is not None and seq.finish_reason != "error":
            observe(seq)

    def reset_stats(self) -> None:
        self.stats = SpecStats()

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A decode step's measured time (the policy's cost model)."""
        self.costs.observe(num_tokens, seconds)


def num_accepted(draft: list[int], sampled: list[int]) -> int:
    """How many draft tokens are accepted: the length of the draft's longest prefix equal to the
    tokens sampled at its positions (the scheduler keeps them; an MTP layer drafts on from them)."""
    n = 0
    while n < len(draft) and sampled[n] == draft[n]:
        n += 1
    return n


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "mtp":
        return MTPProposer()
    if config.method == "suffix":
        return SuffixProposer(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
                              config.suffix_decoding_min_token_prob, config.prompt_lookup_min,
                              config.prompt_lookup_max)
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)


def _eligible(seq: Sequence) -> bool:
    """Rows whose logits at a draft position need nothing but the tokens before it and, for a
    constrained row, its grammar's state after them (a mask per position)."""
    return (seq.structured is None or seq.structured.is_ready) and not seq.params.adjusts_logits
