"""vLLM's logits processors and penalties as per-row data (``ProcessorRows``): what the rows of
one sampling batch that ask for them want, in the form the sampler's steps apply.

NOTE: built once per step on the host, from each asking row's ``SamplingParams`` (``None`` when
no row asks: a batch of plain rows builds nothing and no step runs). What depends on the output
so far is decided here, in Python, so the steps are plain tensor writes:
  * allowed_token_ids  -> the row's ids; every other token of the row gets -inf;
  * bad_words          -> (row, token): the last token of each bad-word sequence whose other
                          tokens end the output (vLLM's ``apply_bad_words``, output tokens only);
  * min_tokens         -> (row, token) for each stop / end-of-sequence id while the output is
                          shorter than ``min_tokens`` (vLLM's ``MinTokensLogitsProcessor``);
  * logit_bias         -> (row, token, bias);
  * penalties          -> ``PenaltyRows`` (``penalties.py``);
  * min_p              -> the row's min_p, for rows that sample (it is argmax-invariant: vLLM
                          skips it for greedy rows); applied inside ``kernels.sample``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from batchgen_data.engine.sample.penalties import PenaltyRows


@dataclass(slots=True)
class ProcessorRows:
    """The asking rows' logits processors for one sampling batch (rows index the logits)."""

    allowed_rows: list[int] = field(default_factory=list)
    allowed_token_ids: list[list[int]] = field(default_factory=list)  # per allowed row
    bad_word_rows: list[int] = field(default_factory=list)  # with bad_word_tokens: pairs set to -inf
    bad_word_tokens: list[int] = field(default_factory=list)
    min_tokens_rows: list[int] = field(default_factory=list)  # with min_tokens_tokens: pairs set to -inf
    min_tokens_tokens: list[int] = field(default_factory=list)
    bias_rows: list[int] = field(default_factory=list)  # with bias_tokens, bias_values: pairs biased
    bias_tokens: list[int] = field(default_factory=list)
    bias_values: list[float] = field(default_factory=list)
    penalties: PenaltyRows | None = None
    min_ps: list[float] | None = None  # per row of the batch (0.0: off); None when no sampling row has one
    changed_rows: list[int] = field(default_factory=list)  # rows whose logits a processor writes (not min_p)

    @classmethod
    def build(cls, params: list, prompt_token_ids: list[list[int]], output_token_ids: list[list[int]],
              ) -> ProcessorRows | None:
        """From each row's ``SamplingParams``, prompt and output so far (N each); None when no
        row asks for a processor or a penalty."""
        asking = [i for i, p in enumerate(params) if p.adjusts_logits]
        if not asking:
            return None
        out = cls()
        penalty_rows = []
        for i in asking:
            p, output = params[i], output_token_ids[i]
            changed = False
            if p.allowed_token_ids is not None:
                out.allowed_rows.append(i)
                out.allowed_token_ids.append(p.allowed_token_ids)
                changed = True
            for token in _banned_by_bad_words(p.bad_words_token_ids, output):
                out.bad_word_rows.append(i)
                out.bad_word_tokens.append(token)
                changed = True
            if p.min_tokens and len(output) < p.min_tokens:
                stops = sorted(p.all_stop_token_ids)
                out.min_tokens_rows += [i] * len(stops)
                out.min_tokens_tokens += stops
                changed = True
            if p.logit_bias:
                out.bias_rows += [i] * len(p.logit_bias)
                out.bias_tokens += list(p.logit_bias)
                out.bias_values += list(p.logit_bias.values())
                changed = True
            if p.has_penalties:
                penalty_rows.append(i)
                changed = True
            if changed:
                out.changed_rows.append(i)
        if penalty_rows:
            out.penalties = PenaltyRows.build(penalty_rows, [params[i] for i in penalty_rows],
                                              [prompt_token_ids[i] for i in penalty_rows],
                                              [output_token_ids[i] for i in penalty_rows])
        if any(params[i].min_p and params[i].temperature > 0.0 for i in asking):
            out.min_ps = [p.min_p if p.temperature > 0.0 else 0.0 for p in params]
        return out

    @classmethod
    def of(cls, seqs: list) -> ProcessorRows | None:
        """``build`` from scheduler sequences (``params``, ``prompt_token_ids``,
        ``output_token_ids``); a batch of plain rows costs one flag read per row."""
        if not any(s.params.adjusts_logits for s in seqs):
            return None
        return cls.build([s.params for s in seqs], [s.prompt_token_ids for s in seqs],
                         [s.output_token_ids for s in seqs])


def _banned_by_bad_words(bad_words: tuple[tuple[int, ...], ...], output: list[int]) -> list[int]:
    """The last token of every bad-word sequence the output's tail would complete."""
    banned = []
    for ids in bad_words:
        prefix = len(ids) - 1
        if prefix > len(output):
            continue
        if prefix == 0 or tuple(output[-prefix:]) == ids[:-1]:
            banned.append(ids[-1])
    return banned
