"""Per-sequence grammar state for the scheduler: attach, wait, mask, advance. No torch.

NOTE: a constrained sequence's life here:
  attach   on ``add`` / ``import_state``: its grammar starts compiling (or comes from the cache);
  poll     at admission: not ready -> the sequence waits in its queue without holding up the
           step; failed -> it finishes as an error row naming the problem; ready -> it gets a
           matcher in the start state, advanced over the tokens it has already generated (an
           imported or resumed sequence continues where it was; nothing is lost or repeated);
  bitmask  each step it samples: one int32 row of allowed tokens (bit t of word t // 32),
           filled on the scheduler's thread, except for a greedy row the sampler may pick
           from its argmax without the mask (``lazy.py``), which it fills only if needed;
  accept   each sampled token advances the matcher; once the grammar can go no further the
           sequence finishes with ``"stop"``.
The matcher lives on the ``Sequence`` (``seq.structured``), so suspension with swap or
recompute keeps it: the output tokens do not change.
"""

from __future__ import annotations

import time
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, wait
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from batchgen_data.engine.structured.compiler import GrammarCompiler, compile_error, exceeds_limits
from batchgen_data.engine.structured.lazy import LAZY_MIN_SHARE, LazyGrammarRows
from batchgen_data.engine.structured.request import StructuredRequest
from batchgen_data.errors import BatchGenError, RequestError, error_text, one_line

if TYPE_CHECKING:
    from batchgen_data.engine.core.sequence import Sequence


class StructuredOutputManager:
    """Grammar state for every constrained sequence of one scheduler (see module NOTE).

    Args:
        tokenizer_folder, vocab_size, eos_token_ids, hf_tokenizer: the model's (``GrammarCompiler``).
    """

    lazy_greedy = True  # leave greedy rows' masks unfilled where a lazy pick is likely (lazy.py)

    def __init__(self, tokenizer_folder: str | Path, vocab_size: int, eos_token_ids: frozenset[int],
                 hf_tokenizer=None):
        self.compiler = GrammarCompiler(tokenizer_folder, vocab_size, eos_token_ids, hf_tokenizer)
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.num_words = (vocab_size + 31) // 32
        self.mask_s = 0.0  # seconds spent filling and checking masks (the benchmark's per-step mask time)
        self.lazy_picks = 0  # greedy rows picked without their mask

    def prewarm(self) -> None:
        """Build, in the background, the tokenizer views an earlier process built for this
        tokenizer (``token_table``): a first constrained request then need not wait for them."""
        self.compiler.prewarm()

    def attach(self, seq: Sequence) -> None:
        """Start compiling the sequence's grammar (no-op for an unconstrained one)."""
        params = seq.params.structured_outputs  # a StructuredOutputsParams since SamplingParams.verify
        if params is not None and seq.structured is None:
            seq.structured = StructuredRequest(self.compiler.submit(params))

    def poll(self, seq: Sequence) -> bool:
        """Whether the sequence may run: unconstrained, or its matcher is ready. After a failed
        compile or replay, ``seq.structured.error`` says why (the scheduler finishes it)."""
        request = seq.structured
        if request is None or request.is_ready:
            return True
        if request.error is not None or not request.future.done():
            return False
        try:
            matcher = request.future.result().new_matcher()
        except BatchGenError as err:
            request.error = error_text(err)
            return False
        except Exception as err:  # the library's own failure on this constraint: this row's fault
            request.error = f"{type(err).__name__}: structured_outputs could not be compiled: {one_line(str(err))}"
            return False
        for token in seq.output_token_ids:  # replay: an imported or resumed sequence
            if not matcher.consume_token(token):
                request.error = _token_error(seq, matcher, token, "generated")
                return False
        request.matcher = matcher
        return True

    @staticmethod
    def wait_compiled(seqs: list[Sequence], timeout_s: float, every: bool) -> None:
        """Block until one of these sequences' grammars has compiled, or ``every`` one of them
        (or ``timeout_s``)."""
        futures = [s.structured.future for s in seqs if s.structured is not None and not s.structured.is_ready]
        if futures:
            wait(futures, timeout=timeout_s, return_when=ALL_COMPLETED if every else FIRST_COMPLETED)

    @staticmethod
    def valid_draft(seq: Sequence, draft: list[int]) -> list[int]:
        """The longest prefix of a speculative draft the sequence's grammar accepts, cut before
        a token that would complete the grammar (the matcher is left where it was)."""
        matcher = seq.structured.matcher
        valid = matcher.validate_tokens(draft)  # without advancing
        consumed = kept = 0
        for token in draft[:valid]:
            if not matcher.consume_token(token):
                break
            consumed += 1
            if matcher.is_stopped():
                break
            kept += 1
        if consumed:
            matcher.rollback(consumed)
        return draft[:kept]

    def bitmask(self, seqs: list[Sequence]) -> tuple[np.ndarray, LazyGrammarRows | None]:
        """[rows, ceil(V / 32)] int32: each ready sequence's allowed next tokens; a sequence
        with a speculative draft of k tokens gets k + 1 rows, the j-th after the draft's first
        j tokens (the matcher is rolled back after). The rows left unfilled for a lazy greedy
        pick (``lazy.py``) come second, or None.

        Filled on this thread, row by row: llguidance's parallel fill hands the rows to a rayon
        pool whose threads spin after the work and slow the forward that follows (2.3 ms more
        lm_head time per step on 2 cores), for no gain on a machine torch already keeps busy.
        """
        import llguidance.numpy as llg_numpy

        start = time.perf_counter()
        mask = np.empty((sum(1 + len(seq.draft_token_ids) for seq in seqs), self.num_words), dtype=np.int32)
        lazy_rows: list[int] = []
        lazy_requests: list[StructuredRequest] = []
        filled: list[tuple[int, StructuredRequest]] = []  # rows that may go lazy next step
        row = 0
        for seq in seqs:
            request = seq.structured
            matcher = request.matcher
            greedy = (self.lazy_greedy and not seq.draft_token_ids and seq.params.temperature == 0.0
                      and seq.params.logprobs is None)
            if greedy and request.lazy:
                lazy_rows.append(row)
                lazy_requests.append(request)
                row += 1
                continue
            llg_numpy.fill_next_token_bitmask(matcher, mask, row)
            if greedy:
                if request.lazy_wait > 0:
                    request.lazy_wait -= 1
                else:
                    filled.append((row, request))
            row += 1
            for token in seq.draft_token_ids:
                if not matcher.consume_token(token):
                    raise RuntimeError(f"a draft token the grammar rejects reached the mask step: {token}")
                llg_numpy.fill_next_token_bitmask(matcher, mask, row)
                row += 1
            if seq.draft_token_ids:
                matcher.rollback(len(seq.draft_token_ids))
        if filled:  # a dense mask: the next step may pick from the argmax
            self._note_density(filled, mask)
        self.mask_s += time.perf_counter() - start
        return mask, (LazyGrammarRows(lazy_rows, lazy_requests, self) if lazy_rows else None)

    def fill_row(self, request: StructuredRequest, mask: np.ndarray, row: int) -> None:
        """A lazy row's mask after all (its argmax was not allowed), into ``mask[row]``."""
        import llguidance.numpy as llg_numpy

        start = time.perf_counter()
        llg_numpy.fill_next_token_bitmask(request.matcher, mask, row)
        self.mask_s += time.perf_counter() - start

    def _note_density(self, filled: list[tuple[int, StructuredRequest]], mask: np.ndarray) -> None:
        """Whether each filled (row, request) allowed at least 1 / ``LAZY_MIN_SHARE`` of the
        vocabulary, estimated from every 8th word (a choice of which rows to check lazily: it
        never changes a token)."""
        sample = mask[:, ::8].view(np.uint32)  # a view: no copy of the rows
        allowed = np.bitwise_count(sample[[row for row, _ in filled]]).sum(axis=1)
        for (_, request), count in zip(filled, allowed.tolist()):
            request.allowed_share = count * 8 / self.vocab_size
            request.lazy = LAZY_MIN_SHARE * request.allowed_share >= 1

    @staticmethod
    def accept(seq: Sequence, token: int) -> str | None:
        """Advance the sequence's matcher by its sampled token; an error message if the grammar
        rejects it (only possible if the mask was not applied) or the library hits one of its
        limits on the grammar."""
        matcher = seq.structured.matcher
        # In error already: filling its mask hit a limit (the mask then allows only EOS, which a
        # stopped matcher accepts: the row would end as an empty "stop").
        if matcher.is_error() or not matcher.consume_token(token):
            return _token_error(seq, matcher, token, "sampled")
        return None

    @staticmethod
    def is_terminated(seq: Sequence) -> bool:
        """The grammar is complete and allows no further token."""
        return seq.structured.matcher.is_stopped()

    def close(self) -> None:
        self.compiler.close()


def _token_error(seq: Sequence, matcher, token: int, how: str) -> str:
    """Why the matcher refused a token: a limit the library hit on this grammar (it builds the
    lexer as tokens come: ``a{1000000}`` fails at its first token), or a token outside the grammar."""
    error = one_line(matcher.get_error())  # without the parser state and grammar dump
    if exceeds_limits(error):
        return error_text(RequestError(compile_error(seq.params.structured_outputs.kind, error)))
    return error_text(RequestError(f"structured_outputs: {how} token {token} does not match the grammar ({error})"))
