"""The input processor: the one place a request is validated and turned into an engine request
(vLLM v1's ``InputProcessor``).

A ``SamplingParams`` / ``PoolingParams`` checks its own fields when it is built and whenever a
field is set (``validated.py``), so the processor does not verify them again; it checks what
needs the model: the params' type and task, the prompt (tokenized, truncated, its ids in the
vocabulary), token ids in the params, and that the request fits the context limit and the KV
budget. Nothing past it (executor, scheduler, ranks) validates a request.
"""

from __future__ import annotations

from batchgen_data.engine.core.kv_manager import blocks_for
from batchgen_data.engine.core.request import NewRequest
from batchgen_data.engine.pooling_params import PoolingParams
from batchgen_data.engine.requests import num_reserved_tokens, resolve_token_params, truncate_prompt
from batchgen_data.engine.sampling_params import SamplingParams
from batchgen_data.engine.tokenizer import PromptTokenizer
from batchgen_data.errors import ConfigError, RequestError
from batchgen_data.model import ModelConfig


class InputProcessor:
    """Turns ``(prompt, params)`` into the engine's ``NewRequest``, or raises a ``BatchGenError``
    naming what is wrong with it.

    Args:
        tokenizer (PromptTokenizer): the engine's.
        model_config (ModelConfig): the checkpoint's (its task: a classifier cannot generate).
        max_model_len (int): the context limit.
        block_size (int), num_kv_blocks (int): the KV budget a request must fit in whole.
    """

    def __init__(self, tokenizer: PromptTokenizer, model_config: ModelConfig, max_model_len: int,
                 block_size: int, num_kv_blocks: int):
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks

    def process(self, prompt, request: NewRequest) -> None:
        """Fill in ``request``'s prompt token ids and its engine-side params (token ids
        resolved: ``resolve_token_params``). On a bad request it raises, leaving what was
        filled in (the prompt's ids, when tokenizing got that far) for the error output."""
        params = request.params
        if not isinstance(params, (SamplingParams, PoolingParams)):
            raise ConfigError(f"params must be a SamplingParams or a PoolingParams, got {type(params).__name__}")
        self._check_task(params)
        request.prompt_token_ids = truncate_prompt(self.tokenizer.encode(prompt), params, self.max_model_len)
        request.params = resolve_token_params(params, self.tokenizer)  # bad_words as token ids, ...
        self._check_fits(request)

    def _check_task(self, params: SamplingParams | PoolingParams) -> None:
        """The checkpoint runs the request's task: a pooling one (``PoolingParams.check_model``),
        or generation, which a sequence classifier (no LM head) cannot do."""
        if isinstance(params, PoolingParams):
            params.check_model(self.model_config)
        elif self.model_config.num_labels:
            raise RequestError("this checkpoint is a sequence classifier (*ForSequenceClassification, no LM "
                               "head): it runs classify (Engine.classify, task_type='classify'), not generation")

    def _check_fits(self, request: NewRequest) -> None:
        prompt_len = len(request.prompt_token_ids)
        reserved = num_reserved_tokens(request.params)  # a generated token's slot; none to pool
        if prompt_len + reserved > self.max_model_len:
            what = " (prompt plus at least one generated token)" if reserved else ""
            raise RequestError(f"prompt has {prompt_len} tokens; the context limit is {self.max_model_len}{what}")
        worst = min(prompt_len + request.params.max_tokens, self.max_model_len)
        if blocks_for(worst, self.block_size) > self.num_kv_blocks:
            raise RequestError(
                f"request needs up to {worst} tokens of KV cache but the whole KV budget holds "
                f"{self.num_kv_blocks * self.block_size} tokens; raise kv_cache_memory_bytes or lower max_tokens"
            )
