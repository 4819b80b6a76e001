"""``InProcessExecutor``: one scheduler, KV pool and model runner in this process.

NOTE: one ``step`` is schedule -> execute -> update -> publish: the scheduler picks the running
set's work and pages (``SchedulerOutput``), the runner runs the forward and samples
(``ModelRunnerOutput``), the scheduler applies it, and the executor publishes what the engine's
request handles show (``ExecutorStep``): progress of the records that ran or changed status
(``ProgressPublisher``: O(running), never O(waiting)) and the finished ones as
``FinishedRequest``s. It reads the scheduler's records and never writes them.
Building one is a sequence of named phases:
load the model (or one rank's shard of its experts), tune the GEMMs, plan the running set when
experts stream, size the KV pool, then the scheduler and runner over it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable

import torch

from batchgen_data.config import EngineConfig
from batchgen_data.engine.worker.model_runner import ModelRunner
from batchgen_data.engine.worker.offload import OffloadPlan, OffloadStats, plan_offload, step_fetch_fields
from batchgen_data.engine.core.progress import ProgressPublisher, RequestProgress
from batchgen_data.engine.core.request import FinishedRequest, NewRequest
from batchgen_data.engine.core.scheduler import Scheduler
from batchgen_data.engine.core.sequence import EXPORTABLE, Sequence, SequenceState, SequenceStatus
from batchgen_data.engine.executor.base import ExecutorStep
from batchgen_data.engine.structured.manager import StructuredOutputManager
from batchgen_data.engine.stats import EngineStats
from batchgen_data.engine.step_report import StepReport
from batchgen_data.errors import BatchGenError, ConfigError
from batchgen_data.heap import keep_step_buffers
from batchgen_data.model import ModelConfig, MoEModel
from batchgen_data.model.gemm_tuning import available_kernels, load_or_tune
from batchgen_data.model.kv_cache import KVCache
from batchgen_data.model.layers import use_gemm_plan
from batchgen_data.model.native import load_native, use_native_kernels
from batchgen_data.model.moe.store import ExpertShard, StreamedStore
from batchgen_data.paths import cache_dir

logger = logging.getLogger(__name__)

_DEFAULT_KV_TOKENS_PER_SEQ = 1024  # KV sized for this many tokens per running sequence...
_DEFAULT_KV_CAP_BYTES = 4 << 30  # ...up to this, when kv_cache_memory_bytes is not set


def resolve_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    """The context limit: ``config.max_model_len``, or the checkpoint's, which it may not exceed."""
    limit = config.max_model_len or model_config.max_position_embeddings
    if limit > model_config.max_position_embeddings:
        raise ConfigError(f"max_model_len {limit} exceeds the checkpoint's "
                          f"max_position_embeddings {model_config.max_position_embeddings}")
    return limit


class InProcessExecutor:
    """The sequence-coroutine runtime over a model loaded in this process (see module NOTE).

    Args:
        model_path: a resolved checkpoint folder.
        config: the engine's settings.
        clock: seconds since the engine started (when a request arrived or was imported).
        eos_token_ids, detokenize: the tokenizer's, for the stop rules.
        expert_shard: an expert-parallel rank's shard: load only its experts.
        hf_tokenizer: the engine's loaded Hugging Face tokenizer, if any: the grammars' tokenizer
            view is built from it (not from a second copy loaded from the folder).
    """

    def __init__(self, model_path: str | os.PathLike, config: EngineConfig, clock: Callable[[], float],
                 eos_token_ids: frozenset[int] = frozenset(),
                 detokenize: Callable[[list[int]], str] | None = None,
                 expert_shard: ExpertShard | None = None, hf_tokenizer=None):
        self.config = config
        self._clock = clock
        device = config.resolve_device()
        if torch.device(device).type == "cpu":
            keep_step_buffers()  # a step's large tensors are reused, not faulted in again (heap.py)
        dtype = config.resolve_dtype(device)
        # Grammars for structured outputs: the tokenizer views an earlier process built are built
        # again beside the model load (nothing else loads until a constrained request comes).
        self.structured = StructuredOutputManager(model_path, ModelConfig.from_pretrained(model_path).vocab_size,
                                                  eos_token_ids, hf_tokenizer)
        self.structured.prewarm()
        try:
            self.model = MoEModel.from_pretrained(model_path, dtype, device, config.expert_backend,
                                                  expert_shard=expert_shard,
                                                  weight_memory_bytes=config.weight_memory_bytes,
                                                  with_mtp=_uses_mtp(config))
        except BaseException:
            self.structured.close()  # no engine to close it: its compile thread stops here
            raise
        _tune_gemms(self.model, config)
        _use_native_kernels(self.model)
        block_bytes = KVCache.bytes_per_block(self.model.kv_specs, config.block_size)
        self.offload_plan, running = _plan_running_set(self.model, config, block_bytes)
        max_model_len = resolve_max_model_len(config, self.model.config)
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
            # vLLM's rule: without chunking, a step's budget holds the longest prompt
            config = self.config = dataclasses.replace(config, max_num_batched_tokens=max_model_len)
        num_blocks = _num_kv_blocks(config, running, max_model_len, block_bytes, _kv_share_bytes(self.model, config))
        self.kv_cache = self.model.new_kv_cache(num_blocks, config.block_size)
        self.scheduler = Scheduler(
            dataclasses.replace(config, max_num_seqs=running) if running != config.max_num_seqs else config,
            num_blocks,
            max_model_len,
            kv_bytes_per_token=block_bytes // config.block_size,
            eos_token_ids=eos_token_ids,
            detokenize=detokenize,
            structured=self.structured,
        )
        self.blocks = self.scheduler.kv  # the KV manager: block counts for the engine and stats
        self.runner = ModelRunner(self.model, self.kv_cache, config.attention_batch_size)
        self._num_generated = 0
        self._publisher = ProgressPublisher()
        self._fetched_before = None

    # -- what the engine asks ----------------------------------------------------------------------

    @property
    def num_kv_blocks(self) -> int:
        return self.blocks.num_blocks

    @property
    def block_size(self) -> int:
        return self.blocks.block_size

    @property
    def kv_bytes_per_token(self) -> int:
        return self.scheduler.kv_bytes_per_token

    @property
    def max_running_seqs(self) -> int:
        return self.scheduler.config.max_num_seqs

    @property
    def num_unfinished(self) -> int:
        return self.scheduler.num_unfinished

    @property
    def streamed_store(self) -> StreamedStore | None:
        """The expert store when experts stream from the checkpoint (``weight_memory_bytes``)."""
        return self.model.expert_store if self.offload_plan is not None else None

    # -- work ----------------------------------------------------------------------------------------

    def add(self, request: NewRequest) -> None:
        self.scheduler.add_request(request)

    def step(self) -> ExecutorStep:
        store = self.streamed_store
        if store is not None and self.config.collect_timeline:
            self._fetched_before = dataclasses.replace(store.stats)
        out = self.scheduler.schedule()
        start = time.perf_counter()
        result = self.runner.execute(out)
        drafter = self.scheduler.drafter
        if drafter is not None and out.is_decode_step:
            drafter.observe(out.num_tokens, time.perf_counter() - start)  # a decode step's cost
        finished = self.scheduler.update(out, result, self._clock())
        self._num_generated += self.scheduler.last_num_generated
        if not out.is_progress and self.scheduler.has_unfinished():
            # Nothing could run: only possible if a request can never fit, which the engine
            # rejects when it is added; fail loudly rather than spin.
            raise RuntimeError("scheduler made no progress with unfinished requests")
        scheduler = self.scheduler
        report = StepReport(num_running=scheduler.num_running, num_queued=scheduler.num_queued,
                            num_tokens=out.num_tokens, num_sampled=self.scheduler.last_num_generated,
                            extras=self._timeline_extras() if self.config.collect_timeline else {})
        return ExecutorStep(self._publisher.publish(scheduler.running, scheduler.compiling),
                            [FinishedRequest.of(seq) for seq in finished], report)

    def _timeline_extras(self) -> dict:
        runner = self.runner.stats
        store = self.streamed_store
        return {
            "tokens_per_expert_call": runner.last_tokens_per_expert_call,
            **{f"{name}_s": seconds for name, seconds in runner.last_module_s.items()},
            **dataclasses.asdict(runner.last_work),
            "kv_blocks_used": self.blocks.num_used,
            **(step_fetch_fields(self._fetched_before, store.stats)
               if store is not None and self._fetched_before is not None else {}),
        }

    # -- MIGRATE -----------------------------------------------------------------------------------

    def export(self, request_id: int, with_kv: bool = False) -> SequenceState:
        """Take a waiting, suspended or running request out (between steps). ``with_kv``
        carries the KV it has computed (read out of its pages, or its host copy when suspended
        by swapping); without it the importing engine recomputes the KV from the tokens."""
        seq = self._find(request_id)
        if seq.status not in EXPORTABLE:
            raise BatchGenError(f"only waiting, suspended or running sequences can be exported, not {seq.status.name}")
        kv = None
        if with_kv and seq.status is SequenceStatus.RUNNING and seq.num_computed_tokens:
            kv = self.runner.read_kv(seq)
        return self.scheduler.export(seq, with_kv, kv)

    def _find(self, request_id: int) -> Sequence:
        seq = self.scheduler.find(request_id)
        if seq is None:
            raise BatchGenError(f"request {request_id} is not waiting, suspended or running here; "
                                "only those can be exported")
        return seq

    def import_state(self, state: SequenceState, request_id: int) -> RequestProgress:
        seq = self.scheduler.import_state(state, request_id, self._clock())
        self._publisher.watch(seq)
        return RequestProgress.of(seq)

    # -- stats and lifetime ------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        r, s = self.runner.stats, self.scheduler.stats
        drafter = self.scheduler.drafter
        store = self.model.expert_store
        return EngineStats(
            num_requests=0,
            num_finished=0,
            num_generated_tokens=self._num_generated,
            num_forwards=r.num_forwards,
            num_forward_tokens=r.num_tokens,
            mean_tokens_per_expert_call=r.mean_tokens_per_expert_call,
            kernel_s=r.kernel_s,
            busy_s=0.0,
            num_suspended=s.num_suspended,
            num_resumed_swap=s.num_resumed_swap,
            num_resumed_recompute=s.num_resumed_recompute,
            num_recomputed_tokens=s.num_recomputed_tokens,
            num_kv_blocks=self.blocks.num_blocks,
            num_idle_forwards=r.num_idle_forwards,
            expert_comm_s=self.model.expert_comm_seconds(),
            expert_weight_bytes=getattr(store, "nbytes", 0),
            offload=None if self.offload_plan is None else OffloadStats.of(self.model, store, self.offload_plan),
            prefix_cache_queries=s.num_prefix_query_tokens,
            prefix_cache_hits=s.num_prefix_hit_tokens,
            num_draft_tokens=0 if drafter is None else drafter.stats.num_drafted_tokens,
            num_accepted_tokens=0 if drafter is None else drafter.stats.num_accepted_tokens,
        )

    def close(self) -> None:
        """Stop a streamed expert store's fetch thread and the grammar compile thread."""
        self.structured.close()
        self.model.close()


def _uses_mtp(config: EngineConfig) -> bool:
    """Speculative decoding drafts with the checkpoint's MTP layer (loaded beside the model)."""
    return config.speculative_config is not None and config.speculative_config.method == "mtp"


def _tune_gemms(model: MoEModel, config: EngineConfig) -> None:
    """Pick each fp32 CPU GEMM shape's fastest kernel (cached on disk across runs)."""
    if config.tune_gemms and model.device.type == "cpu" and model.dtype == torch.float32:
        weights, max_rows = model.gemm_weights(config.max_num_batched_tokens, config.max_num_seqs)
        kernels = available_kernels(native=True)
        use_gemm_plan(load_or_tune(weights, max_rows, cache_dir() / "gemm-plans", kernels), kernels)


def _use_native_kernels(model: MoEModel) -> None:
    """Decode attention reads the KV pages in place, and a MoE layer's experts run in one native
    call for few rows each, where the native kernels build (CPU, fp32)."""
    if model.device.type == "cpu" and model.dtype == torch.float32:
        use_native_kernels(load_native() is not None)


def _plan_running_set(model: MoEModel, config: EngineConfig, block_bytes: int) -> tuple[OffloadPlan | None, int]:
    """The running set: ``max_num_seqs``, or, when experts stream, the size whose fetch cost the
    combined batch amortises best (within the KV pool)."""
    store = model.expert_store
    running = config.max_num_seqs
    if not isinstance(store, StreamedStore):
        return None, running
    budget = config.kv_cache_memory_bytes
    most = running if budget is None else max(1, min(running, budget // block_bytes // 2))
    plan = plan_offload(model, store, most)
    logger.info("streamed experts: %d slots of %d bytes, fetch %.2f GB/s; running set %d (fetch %.0f%% of a step)",
                store.capacity, store.bytes_per_expert, plan.fetch_bytes_per_s / 1e9, plan.running_seqs,
                100 * plan.predicted_fetch_share)
    return plan, plan.running_seqs


def _num_kv_blocks(config: EngineConfig, running: int, max_model_len: int, block_bytes: int,
                   share_bytes: int | None = None) -> int:
    """KV blocks in the pool: ``kv_cache_memory_bytes``, or enough for the running set at
    ``_DEFAULT_KV_TOKENS_PER_SEQ`` tokens each, up to ``_DEFAULT_KV_CAP_BYTES``; never more than
    ``share_bytes`` (what ``memory_utilization`` leaves beside the weights)."""
    budget = config.kv_cache_memory_bytes
    if budget is None:
        want = running * min(_DEFAULT_KV_TOKENS_PER_SEQ, max_model_len)
        budget = min(want * block_bytes // config.block_size, _DEFAULT_KV_CAP_BYTES)
    if share_bytes is not None:
        budget = min(budget, share_bytes)
    num_blocks = budget // block_bytes
    if num_blocks < 1:
        raise ConfigError(f"kv_cache_memory_bytes={budget} holds no KV block (one block of "
                          f"{config.block_size} tokens takes {block_bytes} bytes)")
    return num_blocks


def _kv_share_bytes(model: MoEModel, config: EngineConfig) -> int | None:
    """The KV bytes ``memory_utilization`` allows: that share of the device's memory less the
    resident weights (vLLM's ``gpu_memory_utilization``); None when not set."""
    share = config.memory_utilization
    if share is None:
        return None
    total = device_memory_bytes(model.device)
    weights = model.resident_weight_bytes
    left = int(share * total) - weights
    if left < 1:
        raise ConfigError(f"gpu_memory_utilization={share} gives {int(share * total)} bytes of the device's "
                          f"{total}, and the weights alone take {weights}: raise it")
    return left


def device_memory_bytes(device: torch.device) -> int:
    """The device's memory: a CUDA device's total, else this machine's physical RAM."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
