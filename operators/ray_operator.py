"""``BatchGenOperator``: the Ray Data stage.

    ds.map_batches(BatchGenOperator, fn_constructor_kwargs={"model": "demo", "max_tokens": 64},
                   batch_size=64, num_cpus=0.5,
                   compute=ray.data.ActorPoolStrategy(size=2, max_concurrent_calls_per_actor=4))

Each actor hosts one engine. ``__call__`` is async, so the rows of every batch in flight in the
actor feed the same running set (continuous batching across batches). This class only does row
bookkeeping; the engine does the work.
"""

from __future__ import annotations

import logging
from functools import partial

from batchgen_data.operators.restart import exit_for_restart, in_ray_actor
from batchgen_data.operators.columns import RowResult
from batchgen_data.operators.rows import StageConfig
from batchgen_data.operators.stage import PreparedBatch, finish_batch, prepare_batch
from batchgen_data.operators.stats_report import write_stats_report

from batchgen_data.engine.async_engine import AsyncEngine
from batchgen_data.engine.engine import Engine
from batchgen_data.errors import EngineDeadError
from batchgen_data.heap import HeapTrimmer

logger = logging.getLogger(__name__)

# Calls after which a too-small in-flight row count is reported (the first calls ramp up).
_WARN_AFTER_CALLS = 4


class BatchGenOperator:
    """Ray Data callable class adding generated columns to every row.

    Args:
        model (str, default "demo"): ``"demo"`` or a local checkpoint folder.
        rebalance (bool | None, default None): share work with the stage's other actors through
            a coordinator's pool: unstarted rows go to whichever actor has room, longest first;
            at the tail, running sequences move to actors with empty slots (PARTITION and
            MIGRATE); leased rows return to the pool when an actor dies. None turns it on
            inside Ray actors. ``False`` keeps each batch on its actor, as does a ``task_type``
            other than "generate" (pooling rows are prefill-only: no tail to even out).
        lease_timeout_s (float, default 15): how long a silent actor keeps leased rows before
            they go back to the pool.
        stats_dir (str | None, default None): benchmark instrumentation: after every batch,
            write this actor's engine timeline and counters to ``stats_dir/actor-<pid>.json``.
        max_concurrent_batches (int | None, default None): the batch calls Ray Data runs on one
            actor at once (the ``max_concurrent_calls_per_actor`` of its ``ActorPoolStrategy``;
            the processor passes its own). Known, an actor with a call slot free tells the pool
            that the stage's input is all in, and actors holding rows long for the job then run
            small sets beside them (``rebalance/core/pacing.py``); unknown, nothing is paced.
        **config: ``StageConfig``'s fields (``engine_config``, ``prompt_column``,
            ``prompt_template``, ``should_continue_on_error``, ``json_columns``, ``chat_template``,
            ``task_type``, ``sampling_params``, ...: documented there), and ``SamplingParams`` names as flat keywords
            (``max_tokens=64``: ``StageConfig.from_kwargs``): the params of rows without their own
            ``sampling_params`` (``max_tokens`` 16, ``temperature`` 0 (greedy), the rest vLLM's
            defaults); a row's ``sampling_params`` may carry ``structured_outputs`` or Ray Data
            LLM's ``guided_decoding``.

    Output columns: those of ``OUTPUT_TABLE`` (``columns.py``), as Ray Data LLM's vLLM stage
    writes them: ``generated_text``, ``generated_tokens``, token counts, the rendered ``prompt``
    and its ``prompt_token_ids``, ``embeddings``, ``logprobs`` / ``prompt_logprobs``,
    ``finish_reason``, ``metrics``, ``request_id``, ``batch_uuid``, ``params``,
    ``time_taken_llm`` and ``__inference_error__`` (always present, null on success); with a
    default ``structured_outputs`` JSON schema for an object, also ``generated_json``, typed from
    the schema (``json_column.py``). Every other column passes through; one output row per input
    row, in input order.

    Reading files is the reader's choice here: ``ray.data.read_json`` / ``read_csv`` stop the
    whole read at a malformed line or mixed types, as pyarrow does. The ``batchgen-data`` CLI
    reads such files line by line instead; its tables (and any batch) may carry a reason per row
    in ``__input_error__``, which makes that row an error row with the message (the column is
    not passed through).
    """

    def __init__(self, model: str = "demo", *, rebalance: bool | None = None, lease_timeout_s: float = 15.0,
                 stats_dir: str | None = None, max_concurrent_batches: int | None = None, **config):
        self.config = StageConfig.from_kwargs(model=model, **config)
        if rebalance is None:  # on inside a Ray actor (several actors share a pool), off elsewhere
            rebalance = in_ray_actor()
        # Rebalancing evens out generation tails; a pooling row (embed, classify) is one prefill.
        rebalance = rebalance and self.config.task_type == "generate"
        membership = None
        if rebalance:  # as it starts: the pool learns how long actors take to load
            from batchgen_data.rebalance.client import join_stage

            membership = join_stage()
        self.engine = AsyncEngine(Engine(self.config.model, self.config.engine_config))
        self.stats_dir = stats_dir
        if stats_dir is not None:
            self.engine.engine.config.collect_timeline = True
        self.rebalancer = None
        if rebalance:
            from batchgen_data.operators.rebalance import stage_client

            self.rebalancer = stage_client(self.engine, repr(self.config), lease_timeout_s, membership,
                                           max_calls=max_concurrent_batches)
        self._heap = HeapTrimmer()
        self._rows_in_flight = 0
        self._peak_rows_in_flight = 0
        self._num_calls = 0
        self._warned = False

    async def __call__(self, batch):
        prepared = prepare_batch(batch, self.config)
        num_valid = len(prepared.valid_rows)
        self._track(num_valid)
        try:
            results = await self._generate(prepared)
        except EngineDeadError as err:
            exit_for_restart(err)
        finally:
            self._rows_in_flight -= num_valid
        output = finish_batch(prepared, results, self.config,
                              partial(self.engine.engine.tokenizer.decode, skip_special_tokens=False))
        if self.stats_dir is not None:
            write_stats_report(self.stats_dir, self.engine.engine, self.rebalance_stats())
        self._heap.maybe_trim()  # what the batch's steps freed, back to the OS (heap.py)
        return output

    async def _generate(self, prepared: PreparedBatch) -> list[RowResult]:
        """The valid rows' results: through the stage's shared pool when rebalancing, else (or
        when the pool's coordinator cannot be reached) on this actor's engine."""
        prompts, params = prepared.prompts, prepared.params
        if self.rebalancer is not None and prompts:
            results = await self.rebalancer.run_batch(prompts, params)
            if results is not None:
                return results
        outputs = await self.engine.generate(prompts, params)
        return [RowResult.from_output(out) for out in outputs]

    def _track(self, num_rows: int) -> None:
        self._rows_in_flight += num_rows
        self._peak_rows_in_flight = max(self._peak_rows_in_flight, self._rows_in_flight)
        self._num_calls += 1
        target = self.engine.engine.max_running_seqs
        is_ramped_up = self._num_calls > _WARN_AFTER_CALLS
        if not self._warned and is_ramped_up and self._peak_rows_in_flight < target:
            self._warned = True
            logger.warning(
                "at most %d rows have been in flight in this actor, but the engine batches up "
                "to %d sequences (max_num_seqs): raise batch_size or "
                "max_concurrent_calls_per_actor (rows in flight = batch_size x concurrent calls) "
                "to fill it",
                self._peak_rows_in_flight, target,
            )

    def rebalance_stats(self) -> dict:
        """This actor's rebalancing counters: items leased, run for other owners, sequences given
        back and continued at the tail, recomputed KV tokens, idle and busy seconds."""
        return {} if self.rebalancer is None else self.rebalancer.snapshot()

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(timeout=1.0)
