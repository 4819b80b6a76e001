"""``OutputBuilder``: a finished request's ``GenerationOutput`` from its handle and the
``FinishedRequest`` its executor returned (text, logprob dicts, timings). No torch."""

from __future__ import annotations

from batchgen_data.engine.core.request import FinishedRequest
from batchgen_data.engine.outputs import GenerationOutput, RequestTimings
from batchgen_data.engine.request_handle import RequestHandle
from batchgen_data.engine.tokenizer import PromptTokenizer
from batchgen_data.errors import one_line


class OutputBuilder:
    """Builds outputs with one engine's tokenizer; caches each token's text (a logprob's
    ``decoded_token``: a job decodes few distinct ones)."""

    def __init__(self, tokenizer: PromptTokenizer):
        self.tokenizer = tokenizer
        self._token_texts = _TokenTexts(tokenizer)

    def build(self, handle: RequestHandle, done: FinishedRequest, now_s: float) -> GenerationOutput:
        """The output of a request that finished at ``now_s`` (the engine's clock; a request that
        finished in the step of its first token has that step's time as its first-token time)."""
        tokens = done.output_token_ids
        text = ""
        if tokens and handle.params.detokenize:
            text = self.tokenizer.decode(tokens, handle.params.skip_special_tokens)
            if done.stop_text_len is not None:
                text = text[: done.stop_text_len]
        first_token_s = handle.first_token_s if handle.first_token_s is not None else now_s if tokens else None
        for entries in (done.logprobs, done.prompt_logprobs):
            if entries:
                self._token_texts.prefetch(entries)
        return GenerationOutput(
            request_id=handle.request_id,
            token_ids=list(tokens),
            text=text,
            finish_reason=done.finish_reason,
            num_input_tokens=len(handle.prompt_token_ids),
            num_generated_tokens=len(tokens),
            error=None if done.error is None else one_line(done.error),  # never a backtrace
            prompt_token_ids=list(handle.prompt_token_ids),
            num_cached_tokens=done.num_cached_tokens or 0,
            logprobs=None if done.logprobs is None else [e.to_dict(self._token_texts) for e in done.logprobs],
            prompt_logprobs=None if done.prompt_logprobs is None else [
                None if e is None else e.to_dict(self._token_texts) for e in done.prompt_logprobs],
            embeddings=done.pooled_data,
            timings=RequestTimings(
                queued_s=handle.arrival_s,
                first_token_s=None if first_token_s is None else first_token_s - handle.arrival_s,
                finished_s=now_s - handle.arrival_s,
            ),
        )

class _TokenTexts(dict):
    """token id -> its text, decoded on first use (a plain dict lookup after, where a method
    call per logprob token ran for every row and step); ``prefetch`` decodes the ids a request
    needs that are not here yet in one call."""

    def __init__(self, tokenizer: PromptTokenizer):
        super().__init__()
        self.tokenizer = tokenizer

    def prefetch(self, entries: list) -> None:
        """Decodes the token ids of ``entries`` (``TokenLogprobs`` or None) not known yet."""
        missing = list({t for e in entries if e is not None for t in e.token_ids if t not in self})
        if missing:
            self.update(zip(missing, self.tokenizer.decode_each(missing)))

    def __missing__(self, token_id: int) -> str:
        text = self[token_id] = self.tokenizer.decode_each([token_id])[0]
        return text
