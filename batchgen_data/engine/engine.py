"""The public entry point: ``Engine(model).generate(prompts, sampling_params)``, and
``embed`` / ``classify`` (vLLM's ``LLM`` names) for prefill-only pooling requests.

The engine does request bookkeeping once — ids, seeds, request handles, outputs, stats and the
timeline; its ``InputProcessor`` validates and tokenizes each request, once — and hands each valid request to its executor as a
``NewRequest``, which runs it: in this process (``InProcessExecutor``) or over expert-parallel
rank processes (``ExpertParallelExecutor``, when ``EngineConfig.expert_parallel_size > 1``).

NOTE: callers hold ``RequestHandle``s; the scheduler alone holds and writes the request records.
``step()`` is one executor step (schedule -> execute -> update, on every rank) and then, in the
engine's own clock: the published ``RequestProgress`` applied to the live handles (a first new
token is the first-token time), the ``FinishedRequest``s turned into ``GenerationOutput``s on
their handles, and the step's ``StepReport`` kept (``last_report``) and recorded in the timeline.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from collections.abc import Iterator
from collections.abc import Sequence as SequenceABC

from batchgen_data.config import EngineConfig
from batchgen_data.engine.executor.base import Executor
from batchgen_data.engine.executor.expert_parallel import ExpertParallelExecutor
from batchgen_data.engine.executor.in_process import InProcessExecutor, resolve_max_model_len
from batchgen_data.engine.core.progress import RequestProgress
from batchgen_data.engine.core.request import FinishedRequest, NewRequest
from batchgen_data.engine.core.sequence import EXPORTABLE, SequenceState, SequenceStatus
from batchgen_data.engine.output_builder import OutputBuilder
from batchgen_data.engine.outputs import GenerationOutput
from batchgen_data.engine.pooling_params import PoolingParams
from batchgen_data.engine.request_handle import RequestHandle
from batchgen_data.engine.input_processor import InputProcessor
from batchgen_data.engine.requests import pair_requests
from batchgen_data.engine.sampling_params import SamplingParams
from batchgen_data.engine.stats import EngineStats
from batchgen_data.engine.step_report import StepReport
from batchgen_data.engine.timeline import StepTimeline
from batchgen_data.engine.tokenizer import ChatPrompt, PromptTokenizer
from batchgen_data.errors import BatchGenError, ConfigError, error_text
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
        self.model_config = model_config = ModelConfig.from_pretrained(self.model_path)
        self.tokenizer = PromptTokenizer(self.model_path, model_config.vocab_size, model_config.eos_token_ids)
        self.max_model_len = resolve_max_model_len(self.config, model_config)
        self._start = time.perf_counter()
        self.start_wall = time.time()  # wall clock at engine start: aligns timelines across processes
        self.executor: Executor = self._make_executor(model_config)
        self.input_processor = InputProcessor(self.tokenizer, model_config, self.max_model_len,
                                              self.executor.block_size, self.executor.num_kv_blocks)
        self._rng = random.Random(self.config.seed)
        self._next_id = 0
        self._num_finished = 0
        self._busy_s = 0.0
        self._timeline = StepTimeline(self._now)
        self._handles: dict[int, RequestHandle] = {}  # the unfinished requests' handles
        self.last_report: StepReport | None = None  # the last step's
        self._outputs = OutputBuilder(self.tokenizer)

    def _make_executor(self, model_config: ModelConfig) -> Executor:
        if self.config.expert_parallel_size > 1:
            return ExpertParallelExecutor(self.model_path, self.config, model_config, self._now)
        return InProcessExecutor(self.model_path, self.config, self._now, self.tokenizer.eos_token_ids,
                                 self.tokenizer.decode, hf_tokenizer=self.tokenizer.hf)

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, prompt, params: SamplingParams | PoolingParams | None = None) -> RequestHandle:
        """Queue one request and return its handle; an invalid one comes back already finished,
        its ``output`` an error row.

        Args:
            prompt: a string, a token-id list or a chat ``messages`` list.
            params (SamplingParams | PoolingParams | None): default ``SamplingParams()``. A
                ``PoolingParams`` with its ``task`` set ("embed" or "classify") makes a
                prefill-only request whose output carries ``embeddings``.
        """
        request_id = self._new_request_id()
        now = self._now()
        params = params if params is not None else SamplingParams()
        seed = params.seed if isinstance(getattr(params, "seed", None), int) else self._rng.getrandbits(63)
        request = NewRequest(request_id, [], params, seed, arrival_s=now)
        try:
            self.input_processor.process(prompt, request)
        except BatchGenError as err:  # never reaches an executor
            handle = self._new_handle(request, RequestProgress(
                request_id, SequenceStatus.WAITING, 0, 0, len(request.prompt_token_ids)))
            handle.finish(self.to_output(handle, FinishedRequest(request_id, [], "error", error_text(err)), now))
            return handle
        self.executor.add(request)
        handle = self._handles[request_id] = self._new_handle(request, RequestProgress.of_new(request))
        return handle

    @staticmethod
    def _new_handle(request: NewRequest, progress: RequestProgress) -> RequestHandle:
        return RequestHandle(request.request_id, request.prompt_token_ids, request.params, request.seed,
                             request.arrival_s, progress)

    def _new_request_id(self) -> int:
        request_id, self._next_id = self._next_id, self._next_id + 1
        return request_id

    def has_unfinished_requests(self) -> bool:
        return self.executor.num_unfinished > 0

    @property
    def num_unfinished(self) -> int:
        """Requests waiting, running or suspended."""
        return self.executor.num_unfinished

    @property
    def kv_capacity_tokens(self) -> int:
        """The tokens the whole KV budget holds (all sequences together)."""
        return self.executor.num_kv_blocks * self.executor.block_size

    @property
    def kv_bytes_per_token(self) -> int:
        """What one token's KV costs, all layers (``KVSpec``s): what a MIGRATE ships."""
        return self.executor.kv_bytes_per_token

    @property
    def max_running_seqs(self) -> int:
        """Sequences the engine runs at once (every rank's running set, under expert parallelism;
        the planned running set when experts stream)."""
        return self.executor.max_running_seqs

    def step(self) -> list[RequestHandle]:
        """One forward over the running set (see module NOTE); returns the handles of the requests
        that finished in it, each with its ``output``."""
        t0 = time.perf_counter()
        out = self.executor.step()
        elapsed = time.perf_counter() - t0
        self._busy_s += elapsed
        now = self._now()
        handles = self._handles
        for progress in out.progress:
            handle = handles.get(progress.request_id)
            if handle is not None:
                handle.observe(progress, now)
        finished = []
        for done in out.finished:
            handle = handles.pop(done.request_id, None)
            if handle is not None:
                handle.finish(self.to_output(handle, done, now))
                finished.append(handle)
        self._num_finished += len(finished)
        self.last_report = dataclasses.replace(out.report, step_s=elapsed)
        if self.config.collect_timeline:
            self._timeline.record(self.last_report)
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
        handles = self._add_all(prompts, sampling_params)
        for out in self._run(handles):
            outputs[out.request_id] = out
        return [outputs[h.request_id] for h in handles]

    def embed(self, prompts: SequenceABC | str,
              pooling_params: PoolingParams | SequenceABC[PoolingParams] | None = None) -> list[GenerationOutput]:
        """Embed every prompt (vLLM's ``LLM.embed``): each output's ``embeddings`` is the
        final-normed hidden state at its last prompt token, L2-normalized unless
        ``normalize=False``, cut to ``dimensions`` first on a matryoshka checkpoint. The rows
        run prefill-only, in the same forwards as any other requests.

        Args:
            prompts: strings, token-id lists or chat ``messages`` lists; a single string is one.
            pooling_params: one ``PoolingParams`` for all, or one per prompt; default
                ``PoolingParams()``. Their ``task`` is set to "embed" (another one is an error).

        Example:
            >>> from batchgen_data import Engine
            >>> [out] = Engine("demo").embed(["Hello"])
            >>> len(out.embeddings), out.finish_reason
            (256, 'stop')
        """
        return self._pool(prompts, pooling_params, "embed")

    def classify(self, prompts: SequenceABC | str,
                 pooling_params: PoolingParams | SequenceABC[PoolingParams] | None = None) -> list[GenerationOutput]:
        """Classify every prompt (vLLM's ``LLM.classify``) with the checkpoint's
        sequence-classification head (a ``*ForSequenceClassification`` checkpoint; others give
        error rows): each output's ``embeddings`` holds the class probabilities (softmax over
        the labels; the logits with ``use_activation=False``), label i being ``id2label[i]`` of
        its config.json.

        Args:
            prompts: strings, token-id lists or chat ``messages`` lists; a single string is one.
            pooling_params: one ``PoolingParams`` for all, or one per prompt; default
                ``PoolingParams()``. Their ``task`` is set to "classify".

        Example:
            >>> from batchgen_data import Engine
            >>> [out] = Engine("demo").classify(["Hello"])  # the demo model has no head
            >>> out.finish_reason
            'error'
        """
        return self._pool(prompts, pooling_params, "classify")

    def _pool(self, prompts, pooling_params, task: str) -> list[GenerationOutput]:
        prompts, params = pair_requests(prompts, pooling_params)
        for p in params:
            if p is not None and not isinstance(p, PoolingParams):
                raise ConfigError(f"pooling_params must be PoolingParams, got {type(p).__name__}")
        return self.generate(prompts, [PoolingParams(task=task) if p is None else p.for_task(task) for p in params])

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

    def _add_all(self, prompts, sampling_params) -> list[RequestHandle]:
        prompts, params = pair_requests(prompts, sampling_params)
        return [self.add_request(p, sp) for p, sp in zip(prompts, params)]

    def _run(self, handles: list[RequestHandle]) -> Iterator[GenerationOutput]:
        pending = {h.request_id for h in handles}
        for handle in handles:
            if handle.is_finished:
                pending.discard(handle.request_id)
                yield handle.output
        while pending:
            for handle in self.step():
                if handle.request_id in pending:
                    pending.discard(handle.request_id)
                    yield handle.output

    def to_output(self, handle: RequestHandle, done: FinishedRequest, now_s: float) -> GenerationOutput:
        """The ``GenerationOutput`` of a request that finished at ``now_s`` (engine clock)."""
        return self._outputs.build(handle, done, now_s)

    # -- MIGRATE --------------------------------------------------------------------------------

    def export_sequence(self, handle: RequestHandle, with_kv: bool = False) -> SequenceState:
        """Take a request out of this engine in portable form (MIGRATE); its handle says EXPORTED.

        A waiting, suspended or running one (between steps). ``with_kv`` carries the KV it has
        computed (read out of the pages, or its host copy when suspended by swapping); without it
        the importing engine recomputes the KV from the tokens.
        """
        if handle.status not in EXPORTABLE or handle.request_id not in self._handles:
            raise BatchGenError("only waiting, suspended or running sequences can be exported, "
                                f"not {handle.status.name}")
        state = self.executor.export(handle.request_id, with_kv)
        del self._handles[handle.request_id]
        handle.mark_exported()
        return state

    def import_sequence(self, state: SequenceState, request_id: int | None = None) -> RequestHandle:
        """Continue a sequence exported by another engine; returns its handle here.

        Its KV comes from ``state.kv`` through the swap-in path when given (the copy is already in
        this process; it counts in the host pool until restored), else it is recomputed. It gets
        a new request id here unless ``request_id`` is given.
        """
        if request_id is None:
            request_id = self._new_request_id()
        progress = self.executor.import_state(state, request_id)
        handle = RequestHandle(request_id, list(state.prompt_token_ids), state.params, state.seed, self._now(),
                               progress)
        self._handles[request_id] = handle
        return handle

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
