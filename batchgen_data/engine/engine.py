"""The public entry point: ``Engine(model).generate(prompts, sampling_params)``.

``step()`` is schedule -> execute -> update; everything else is request bookkeeping.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import time
from collections.abc import Iterator
from collections.abc import Sequence as SequenceABC
from dataclasses import asdict

import torch

from batchgen_data.config import EngineConfig
from batchgen_data.engine.block_manager import BlockManager
from batchgen_data.engine.model_runner import ModelRunner
from batchgen_data.engine.offload import OffloadPlan, OffloadStats, plan_offload, step_fetch_fields
from batchgen_data.engine.outputs import GenerationOutput, RequestTimings
from batchgen_data.engine.sampling_params import SamplingParams
from batchgen_data.engine.scheduler import Scheduler
from batchgen_data.engine.sequence import Sequence, SequenceState, SequenceStatus
from batchgen_data.engine.stats import EngineStats
from batchgen_data.engine.tokenizer import PromptTokenizer
from batchgen_data.errors import BatchGenError, ConfigError, RequestError
from batchgen_data.model import MoEModel
from batchgen_data.model.gemm_tuning import load_or_tune
from batchgen_data.model.kv_cache import KVCache
from batchgen_data.model.layers import use_gemm_plan
from batchgen_data.model.moe.store import ExpertShard
from batchgen_data.model.moe.streamed_store import StreamedExpertStore
from batchgen_data.model.resolve import resolve_model
from batchgen_data.paths import cache_dir

logger = logging.getLogger(__name__)

_DEFAULT_KV_TOKENS_PER_SEQ = 1024
_DEFAULT_KV_CAP_BYTES = 4 << 30


class Engine:
    """Batch generation over a MoE checkpoint with the sequence-coroutine runtime.

    Args:
        model (str | os.PathLike): ``"demo"`` (generated locally on first use) or a local
            Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer files).
        config (EngineConfig | None): runtime settings; defaults work on a CPU.

    Example:
        >>> from batchgen_data import Engine, SamplingParams
        >>> engine = Engine("demo")
        >>> [out] = engine.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0))
        >>> out.num_generated_tokens
        4
    """

    def __new__(cls, model: str | os.PathLike = "demo", config: EngineConfig | None = None, **kwargs):
        if cls is Engine and config is not None and config.expert_parallel_size > 1 and kwargs.get("expert_shard") is None:
            # The one import above this floor (tests/test_import_floors.py lists it): an engine
            # configured for expert parallelism is the front of a group of rank processes.
            from batchgen_data.distributed.expert_parallel import ExpertParallelEngine

            return super().__new__(ExpertParallelEngine)
        return super().__new__(cls)

    def __init__(self, model: str | os.PathLike = "demo", config: EngineConfig | None = None, *,
                 expert_shard: ExpertShard | None = None):
        """``expert_shard`` is set by an expert-parallel rank process: load only its experts."""
        self.config = config or EngineConfig()
        self.model_path = resolve_model(model)
        device = self.config.resolve_device()
        dtype = self.config.resolve_dtype(device)
        self.model = MoEModel.from_pretrained(self.model_path, dtype, device, self.config.expert_backend,
                                              expert_shard=expert_shard,
                                              weight_memory_bytes=self.config.weight_memory_bytes)
        if self.config.tune_gemms and device.type == "cpu" and dtype == torch.float32:
            weights, max_rows = self.model.gemm_weights(self.config.max_num_batched_tokens, self.config.max_num_seqs)
            use_gemm_plan(load_or_tune(weights, max_rows, cache_dir() / "gemm-plans"))
        mcfg = self.model.config
        self.tokenizer = PromptTokenizer(self.model_path, mcfg.vocab_size, mcfg.eos_token_ids)
        self.max_model_len = self.config.max_model_len or mcfg.max_position_embeddings
        if self.max_model_len > mcfg.max_position_embeddings:
            raise ConfigError(
                f"max_model_len {self.max_model_len} exceeds the checkpoint's "
                f"max_position_embeddings {mcfg.max_position_embeddings}"
            )
        block_size = self.config.block_size
        block_bytes = KVCache.bytes_per_block(self.model.kv_specs, block_size)
        budget = self.config.kv_cache_memory_bytes
        running = self.config.max_num_seqs
        self.offload_plan: OffloadPlan | None = None
        store = self.model.expert_store
        if isinstance(store, StreamedExpertStore):
            # Streamed experts: the running set is chosen with the fetch cost, within the KV pool.
            most = running if budget is None else max(1, min(running, budget // block_bytes // 2))
            self.offload_plan = plan_offload(self.model, store, most)
            running = self.offload_plan.running_seqs
            logger.info("streamed experts: %d slots of %d bytes, fetch %.2f GB/s; running set %d (fetch %.0f%% of a step)",
                        store.capacity, store.bytes_per_expert, self.offload_plan.fetch_bytes_per_s / 1e9, running,
                        100 * self.offload_plan.predicted_fetch_share)
        if budget is None:
            want = running * min(_DEFAULT_KV_TOKENS_PER_SEQ, self.max_model_len)
            budget = min(want * block_bytes // block_size, _DEFAULT_KV_CAP_BYTES)
        num_blocks = budget // block_bytes
        if num_blocks < 1:
            raise ConfigError(
                f"kv_cache_memory_bytes={budget} holds no KV block (one block of {block_size} "
                f"tokens takes {block_bytes} bytes)"
            )
        self.kv_cache = self.model.new_kv_cache(num_blocks, block_size)
        self.blocks = BlockManager(num_blocks, block_size)
        self.scheduler = Scheduler(
            dataclasses.replace(self.config, max_num_seqs=running) if running != self.config.max_num_seqs else self.config,
            self.blocks,
            self.max_model_len,
            kv_bytes_per_token=block_bytes // block_size,
            eos_token_ids=self.tokenizer.eos_token_ids,
            detokenize=self.tokenizer.decode,
        )
        self.runner = ModelRunner(self.model, self.kv_cache, self.config.attention_batch_size)
        self._rng = random.Random(self.config.seed)
        self._next_id = 0
        self._num_finished = 0
        self._num_generated = 0
        self._busy_s = 0.0
        self._start = time.perf_counter()
        self.start_wall = time.time()  # wall clock at engine start: aligns timelines across processes
        self.timeline: list[dict] = []

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, prompt, params: SamplingParams | None = None) -> Sequence:
        """Queue one request; an invalid one comes back already finished with an error."""
        request_id, self._next_id = self._next_id, self._next_id + 1
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
            seq.finish("error", now, error=str(err))
            return seq
        self._enqueue(seq)
        return seq

    def _enqueue(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def _check_fits(self, seq: Sequence) -> None:
        prompt_len = seq.num_prompt_tokens
        if prompt_len >= self.max_model_len:
            raise RequestError(
                f"prompt has {prompt_len} tokens; the context limit is {self.max_model_len} "
                "(prompt plus at least one generated token)"
            )
        worst = min(prompt_len + seq.params.max_tokens, self.max_model_len)
        if self.blocks.blocks_for(worst) > self.blocks.num_blocks:
            raise RequestError(
                f"request needs up to {worst} tokens of KV cache but the whole KV budget holds "
                f"{self.blocks.num_blocks * self.blocks.block_size} tokens; raise "
                "kv_cache_memory_bytes or lower max_tokens"
            )

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_unfinished(self) -> int:
        """Requests waiting, running or suspended."""
        return self.scheduler.num_unfinished

    @property
    def kv_bytes_per_token(self) -> int:
        """What one token's KV costs, all layers (``KVSpec``s): what a MIGRATE ships."""
        return self.scheduler.kv_bytes_per_token

    @property
    def max_running_seqs(self) -> int:
        """Sequences the engine runs at once (every rank's running set, under expert parallelism;
        the planned running set when experts stream)."""
        return self.scheduler.config.max_num_seqs

    def step(self) -> list[Sequence]:
        """One forward over the running set; returns the sequences that finished in it."""
        t0 = time.perf_counter()
        store = self.model.expert_store if self.offload_plan is not None else None
        fetched_before = dataclasses.replace(store.stats) if store is not None and self.config.collect_timeline else None
        out = self.scheduler.schedule()
        tokens = self.runner.execute(out)
        finished = self.scheduler.update(out, tokens, self._now())
        self._num_generated += len(tokens)
        self._num_finished += len(finished)
        elapsed = time.perf_counter() - t0
        self._busy_s += elapsed
        if self.config.collect_timeline:
            self.timeline.append(
                {
                    "t": self._now(),
                    "step_s": elapsed,
                    "num_running": len(self.scheduler.running),
                    "num_waiting": len(self.scheduler.waiting) + len(self.scheduler.suspended),  # queued: waiting or suspended
                    "num_tokens": out.num_tokens,
                    "num_sampled": len(tokens),
                    "tokens_per_expert_call": self.runner.stats.last_tokens_per_expert_call,
                    **{f"{name}_s": seconds for name, seconds in self.runner.stats.last_module_s.items()},
                    **asdict(self.runner.stats.last_work),
                    "kv_blocks_used": self.blocks.num_used,
                    **(step_fetch_fields(fetched_before, store.stats) if fetched_before is not None else {}),
                }
            )
        if not out.seqs and self.scheduler.has_unfinished() and not out.swap_out:
            # Nothing could run: only possible if a request can never fit, which add_request
            # rejects; fail loudly rather than spin.
            raise RuntimeError("scheduler made no progress with unfinished requests")
        return finished

    # -- batch API ------------------------------------------------------------------------------

    def generate(
        self,
        prompts: SequenceABC,
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
    ) -> list[GenerationOutput]:
        """Generate for every prompt; one ``GenerationOutput`` per prompt, in input order.

        Args:
            prompts: strings, token-id lists, or chat ``messages`` lists (may be mixed).
            sampling_params: one ``SamplingParams`` for all, or one per prompt; default
                ``SamplingParams()``.
        """
        outputs: dict[int, GenerationOutput] = {}
        seqs = self._add_all(prompts, sampling_params)
        for out in self._run(seqs):
            outputs[out.request_id] = out
        return [outputs[s.request_id] for s in seqs]

    def stream(self, prompts: SequenceABC, sampling_params=None) -> Iterator[GenerationOutput]:
        """Yield each prompt's output as soon as it finishes (completion order)."""
        yield from self._run(self._add_all(prompts, sampling_params))

    def _add_all(self, prompts, sampling_params) -> list[Sequence]:
        if isinstance(prompts, (str, dict)):
            raise ConfigError("prompts must be a list (of strings, token-id lists or messages lists)")
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ConfigError(
                    f"got {len(params_list)} sampling params for {len(prompts)} prompts; pass one or one per prompt"
                )
        return [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]

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
            timings=RequestTimings(
                queued_s=seq.arrival_s,
                first_token_s=None if seq.first_token_s is None else seq.first_token_s - seq.arrival_s,
                finished_s=None if seq.finished_s is None else seq.finished_s - seq.arrival_s,
            ),
        )

    # -- MIGRATE --------------------------------------------------------------------------------

    def export_sequence(self, seq: Sequence, with_kv: bool = False) -> SequenceState:
        """Take a sequence out of this engine in portable form (MIGRATE).

        A waiting, suspended or running one (between steps). ``with_kv`` carries the KV it has
        computed (read out of the pages, or its host copy when suspended by swapping); without it
        the importing engine recomputes the KV from the tokens.
        """
        if seq.status not in (SequenceStatus.WAITING, SequenceStatus.SUSPENDED, SequenceStatus.RUNNING):
            raise BatchGenError(f"only waiting, suspended or running sequences can be exported, not {seq.status.name}")
        kv = None
        if seq.status is SequenceStatus.RUNNING:
            if with_kv and seq.num_computed_tokens:
                kv = self.kv_cache.read_tokens(seq.block_ids, seq.num_computed_tokens)
            self.scheduler.release(seq)
        elif with_kv:
            kv = seq.host_kv
        if seq in self.scheduler.waiting:
            self.scheduler.waiting.remove(seq)
        if seq in self.scheduler.suspended:
            self.scheduler.suspended.remove(seq)
            if seq.host_kv is not None:
                self.scheduler.host_bytes_used -= seq.num_computed_tokens * self.scheduler.kv_bytes_per_token
        state = seq.export_state(kv)
        seq.transition(SequenceStatus.EXPORTED)
        seq.host_kv = None
        return state

    def import_sequence(self, state: SequenceState, request_id: int | None = None) -> Sequence:
        """Continue a sequence exported by another engine.

        Its KV comes from ``state.kv`` through the swap-in path when given (the copy is already in
        this process; it counts in the host pool until restored), else it is recomputed. It gets
        a new request id here unless ``request_id`` is given (an expert-parallel rank keeps the
        driver's).
        """
        if request_id is None:
            request_id, self._next_id = self._next_id, self._next_id + 1
        seq = Sequence(request_id, list(state.prompt_token_ids), state.params, state.seed, arrival_s=self._now())
        seq.output_token_ids = list(state.output_token_ids)
        if not seq.output_token_ids:
            self.scheduler.add(seq)
            return seq
        seq.status = SequenceStatus.SUSPENDED  # resumes through the swap-in or the recompute path
        kv_tokens = 0 if state.kv is None else int(state.kv.shape[0])
        if 0 < kv_tokens < seq.num_tokens:
            seq.host_kv = state.kv
            seq.num_computed_tokens = kv_tokens
            self.scheduler.host_bytes_used += kv_tokens * self.scheduler.kv_bytes_per_token
        self.scheduler.suspended.append(seq)
        return seq

    # -- lifetime -------------------------------------------------------------------------------

    def close(self) -> None:
        """Release what the engine holds outside this object: a streamed expert store's fetch
        thread (an expert-parallel engine: its rank processes)."""
        self.model.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- stats ----------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        r, s = self.runner.stats, self.scheduler.stats
        return EngineStats(
            num_requests=self._next_id,
            num_finished=self._num_finished,
            num_generated_tokens=self._num_generated,
            num_forwards=r.num_forwards,
            num_forward_tokens=r.num_tokens,
            mean_tokens_per_expert_call=r.mean_tokens_per_expert_call,
            kernel_s=r.kernel_s,
            busy_s=self._busy_s,
            num_suspended=s.num_suspended,
            num_resumed_swap=s.num_resumed_swap,
            num_resumed_recompute=s.num_resumed_recompute,
            num_recomputed_tokens=s.num_recomputed_tokens,
            num_kv_blocks=self.blocks.num_blocks,
            num_idle_forwards=r.num_idle_forwards,
            expert_comm_s=self.model.expert_comm_seconds(),
            expert_weight_bytes=getattr(self.model.expert_store, "nbytes", 0),
            offload=None if self.offload_plan is None else OffloadStats.of(self.model, self.model.expert_store,
                                                                           self.offload_plan),
        )

    def _now(self) -> float:
        return time.perf_counter() - self._start

