"""The public entry point: ``Engine(model).generate(prompts, sampling_params)``.

The engine does request bookkeeping once — ids, seeds, tokenizing, validation, outputs, stats
and the timeline — and hands each valid sequence to its executor, which runs it: in this
process (``InProcessExecutor``) or over expert-parallel rank processes
(``ExpertParallelExecutor``, when ``EngineConfig.expert_parallel_size > 1``).
``step()`` is one executor step (schedule -> execute -> update) plus the timeline record.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from collections.abc import Iterator
from collections.abc import Sequence as SequenceABC

from batchgen_data.config import EngineConfig
from batchgen_data.engine.core.block_manager import blocks_for
from batchgen_data.engine.executor.base import Executor
from batchgen_data.engine.executor.expert_parallel import ExpertParallelExecutor
from batchgen_data.engine.executor.in_process import InProcessExecutor, resolve_max_model_len
from batchgen_data.engine.outputs import GenerationOutput, RequestTimings
from batchgen_data.engine.requests import pair_requests
from batchgen_data.engine.sampling_params import SamplingParams
from batchgen_data.engine.core.sequence import Sequence, SequenceState, SequenceStatus
from batchgen_data.engine.stats import EngineStats
from batchgen_data.engine.migration.step_model import StepSums
from batchgen_data.engine.timeline import StepTimeline
from batchgen_data.engine.tokenizer import ChatPrompt, PromptTokenizer
from batchgen_data.errors import BatchGenError, ConfigError, RequestError
from batchgen_data.model import ModelConfig
from batchgen_data.model.resolve import resolve_model


class Engine:
    """Batch generation over a MoE checkpoint with the sequence-coroutine runtime.

    Args:
        model (str | os.PathLike): ``"demo"`` (generated locally on first use) or a local
            Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer files).
        config (EngineConfig | None): runtime settings; defaults work on a CPU. With
            ``expert_parallel_size`` N > 1 the engine starts N rank processes on this node; call
            ``close()`` (or use it as a context manager) to stop them (they also stop when this
            process exits).

    Example:
        >>> from batchgen_data import Engine, SamplingParams
        >>> engine = Engine("demo")
        >>> [out] = engine.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0))
        >>> out.num_generated_tokens
        4
    """

    def __init__(self, model: str | os.PathLike = "demo", config: EngineConfig | None = None):
        self.config = config or EngineConfig()
        self.model_path = resolve_model(model)
        model_config = ModelConfig.from_pretrained(self.model_path)
        self.tokenizer = PromptTokenizer(self.model_path, model_config.vocab_size, model_config.eos_token_ids)
        self.max_model_len = resolve_max_model_len(self.config, model_config)
        self._start = time.perf_counter()
        self.start_wall = time.time()  # wall clock at engine start: aligns timelines across processes
        self.executor: Executor = self._make_executor(model_config)
        self._rng = random.Random(self.config.seed)
        self._next_id = 0
        self._num_finished = 0
        self._busy_s = 0.0
        self._timeline = StepTimeline(self._now)
        self.step_sums = StepSums()  # how step time grows with the running set (rebalancing reads it)
        self._token_texts: dict[int, str] = {}

    def _make_executor(self, model_config: ModelConfig) -> Executor:
        if self.config.expert_parallel_size > 1:
            return ExpertParallelExecutor(self.model_path, self.config, model_config, self._now)
        return InProcessExecutor(self.model_path, self.config, self._now, self.tokenizer.eos_token_ids,
                                 self.tokenizer.decode)

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, prompt, params: SamplingParams | None = None) -> Sequence:
        """Queue one request; an invalid one comes back already finished with an error."""
        request_id = self._new_request_id()
        now = self._now()
        params = params if params is not None else SamplingParams()
        seed = params.seed if isinstance(getattr(params, "seed", None), int) else self._rng.getrandbits(63)
        seq = Sequence(request_id, [], params, seed, arrival_s=now)
        try:
            if not isinstance(params, SamplingParams):
                raise ConfigError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
            params.verify()
            seq.prompt_token_ids = self.tokenizer.encode(prompt)
            self._check_fits(seq)
        except BatchGenError as err:
            seq.finish("error", now, error=str(err))  # never reached a scheduler
            return seq
        self.executor.add(seq)
        return seq

    def _new_request_id(self) -> int:
        request_id, self._next_id = self._next_id, self._next_id + 1
        return request_id

    def _check_fits(self, seq: Sequence) -> None:
        prompt_len = seq.num_prompt_tokens
        if prompt_len >= self.max_model_len:
            raise RequestError(
                f"prompt has {prompt_len} tokens; the context limit is {self.max_model_len} "
                "(prompt plus at least one generated token)"
            )
        worst = min(prompt_len + seq.params.max_tokens, self.max_model_len)
        block_size, num_blocks = self.executor.block_size, self.executor.num_kv_blocks
        if blocks_for(worst, block_size) > num_blocks:
            raise RequestError(
                f"request needs up to {worst} tokens of KV cache but the whole KV budget holds "
                f"{num_blocks * block_size} tokens; raise kv_cache_memory_bytes or lower max_tokens"
            )

    def has_unfinished_requests(self) -> bool:
        return self.executor.num_unfinished > 0

    @property
    def num_unfinished(self) -> int:
        """Requests waiting, running or suspended."""
        return self.executor.num_unfinished

    @property
    def kv_bytes_per_token(self) -> int:
        """What one token's KV costs, all layers (``KVSpec``s): what a MIGRATE ships."""
        return self.executor.kv_bytes_per_token

    @property
    def max_running_seqs(self) -> int:
        """Sequences the engine runs at once (every rank's running set, under expert parallelism;
        the planned running set when experts stream)."""
        return self.executor.max_running_seqs

    def step(self) -> list[Sequence]:
        """One forward over the running set; returns the sequences that finished in it."""
        t0 = time.perf_counter()
        finished = self.executor.step()
        elapsed = time.perf_counter() - t0
        self._busy_s += elapsed
        self._num_finished += len(finished)
        fields = self.executor.step_fields()
        self.step_sums.observe(fields["num_running"], fields["num_tokens"], elapsed)
        if self.config.collect_timeline:
            self._timeline.record(elapsed, fields)
        return finished

    @property
    def timeline(self) -> list[dict]:
        """One record per step while ``config.collect_timeline`` is on (``StepTimeline``)."""
        return self._timeline.entries

    # -- batch API ------------------------------------------------------------------------------

    def generate(
        self,
        prompts: SequenceABC | str,
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
    ) -> list[GenerationOutput]:
        """Generate for every prompt; one ``GenerationOutput`` per prompt, in input order.

        Args:
            prompts: strings, token-id lists, or chat ``messages`` lists (may be mixed); a single
                string is one prompt.
            sampling_params: one ``SamplingParams`` for all, or one per prompt; default
                ``SamplingParams()``.
        """
        outputs: dict[int, GenerationOutput] = {}
        seqs = self._add_all(prompts, sampling_params)
        for out in self._run(seqs):
            outputs[out.request_id] = out
        return [outputs[s.request_id] for s in seqs]

    def chat(self, messages: list, sampling_params=None, chat_template: str | None = None,
             chat_template_kwargs: dict | None = None) -> list[GenerationOutput]:
        """``generate`` over conversations, as ``vllm.LLM.chat``: ``messages`` is one conversation
        (a list of ``{role, content}``) or a list of them; ``chat_template`` replaces the
        tokenizer's template and ``chat_template_kwargs`` are passed to it."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [ChatPrompt(c, chat_template, chat_template_kwargs) for c in conversations]
        return self.generate(prompts, sampling_params)

    def stream(self, prompts: SequenceABC | str, sampling_params=None) -> Iterator[GenerationOutput]:
        """Yield each prompt's output as soon as it finishes (completion order)."""
        yield from self._run(self._add_all(prompts, sampling_params))

    def _add_all(self, prompts, sampling_params) -> list[Sequence]:
        prompts, params = pair_requests(prompts, sampling_params)
        return [self.add_request(p, sp) for p, sp in zip(prompts, params)]

    def _run(self, seqs: list[Sequence]) -> Iterator[GenerationOutput]:
        pending = {s.request_id for s in seqs}
        for seq in seqs:
            if seq.status is SequenceStatus.FINISHED:
                pending.discard(seq.request_id)
                yield self.to_output(seq)
        while pending:
            for seq in self.step():
                if seq.request_id in pending:
                    pending.discard(seq.request_id)
                    yield self.to_output(seq)

    def to_output(self, seq: Sequence) -> GenerationOutput:
        text = ""
        if seq.output_token_ids:
            text = self.tokenizer.decode(seq.output_token_ids, seq.params.skip_special_tokens)
            if seq.stop_text_len is not None:
                text = text[: seq.stop_text_len]
        return GenerationOutput(
            request_id=seq.request_id,
            token_ids=list(seq.output_token_ids),
            text=text,
            finish_reason=seq.finish_reason or "error",
            num_input_tokens=seq.num_prompt_tokens,
            num_generated_tokens=seq.num_generated,
            error=seq.error,
            prompt_token_ids=list(seq.prompt_token_ids),
            num_cached_tokens=seq.num_cached_tokens or 0,
            logprobs=None if seq.logprobs is None else [e.to_dict(self._decode_token) for e in seq.logprobs],
            prompt_logprobs=None if seq.prompt_logprobs is None else [
                None if e is None else e.to_dict(self._decode_token) for e in seq.prompt_logprobs],
            timings=RequestTimings(
                queued_s=seq.arrival_s,
                first_token_s=None if seq.first_token_s is None else seq.first_token_s - seq.arrival_s,
                finished_s=None if seq.finished_s is None else seq.finished_s - seq.arrival_s,
            ),
        )

    def _decode_token(self, token_id: int) -> str:
        """One token's text (a logprob's ``decoded_token``), cached: a job decodes few distinct ones."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    # -- MIGRATE --------------------------------------------------------------------------------

    def export_sequence(self, seq: Sequence, with_kv: bool = False) -> SequenceState:
        """Take a sequence out of this engine in portable form (MIGRATE).

        A waiting, suspended or running one (between steps). ``with_kv`` carries the KV it has
        computed (read out of the pages, or its host copy when suspended by swapping); without it
        the importing engine recomputes the KV from the tokens.
        """
        return self.executor.export(seq, with_kv)

    def import_sequence(self, state: SequenceState, request_id: int | None = None) -> Sequence:
        """Continue a sequence exported by another engine.

        Its KV comes from ``state.kv`` through the swap-in path when given (the copy is already in
        this process; it counts in the host pool until restored), else it is recomputed. It gets
        a new request id here unless ``request_id`` is given.
        """
        if request_id is None:
            request_id = self._new_request_id()
        return self.executor.import_state(state, request_id)

    # -- lifetime -------------------------------------------------------------------------------

    def close(self) -> None:
        """Release what the engine holds outside this object: a streamed expert store's fetch
        thread, an expert-parallel engine's rank processes."""
        self.executor.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- stats ----------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        return dataclasses.replace(self.executor.stats(), num_requests=self._next_id,
                                   num_finished=self._num_finished, busy_s=self._busy_s)

    def _now(self) -> float:
        return time.perf_counter() - self._start
