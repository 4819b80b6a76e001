"""An asyncio front for one running ``Engine``: many callers feed one continuous batch.

Several Ray Data batches in flight in one actor (or any asyncio code) call ``generate`` /
``generate_stream`` concurrently; their requests join the same running set, so the engine's
batch stays full across caller boundaries. The engine itself runs on one background thread,
which is the only thread that touches it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from batchgen_data.engine.engine import Engine
from batchgen_data.engine.migration.costs import MigrationCosts, MovePolicy, pick_to_move
from batchgen_data.engine.core.progress import EngineProgress, SeqProgress
from batchgen_data.engine.outputs import GenerationOutput
from batchgen_data.engine.requests import pair_requests
from batchgen_data.engine.sampling_params import SamplingParams
from batchgen_data.engine.core.sequence import EXPORTABLE, Sequence, SequenceState, SequenceStatus
from batchgen_data.errors import EngineDeadError

logger = logging.getLogger(__name__)

_COSTS_EVERY_STEPS = 32


@dataclass(frozen=True, slots=True)
class MigratedOut:
    """What a request's caller gets instead of an output when its sequence was moved away."""

    state: SequenceState


@dataclass(slots=True)
class _Submission:
    prompt: object
    params: SamplingParams | None
    deliver: Callable[[GenerationOutput | MigratedOut | BaseException], None]
    state: SequenceState | None = None  # continue a sequence exported elsewhere
    movable: bool = False  # ``migrate_out`` may take it away (its caller accepts a MigratedOut)


@dataclass(slots=True)
class _Live:
    seq: Sequence
    deliver: Callable
    movable: bool


@dataclass(slots=True)
class _Command:
    """Work for the engine thread between two steps (the only thread that touches the engine)."""

    fn: Callable[[], object]
    deliver: Callable[[object], None]


class AsyncEngine:
    """Runs ``engine`` on a background thread and serves asyncio callers.

    Example:
        >>> import asyncio
        >>> from batchgen_data import Engine, SamplingParams
        >>> from batchgen_data.engine.async_engine import AsyncEngine
        >>> aengine = AsyncEngine(Engine("demo"))
        >>> outs = asyncio.run(aengine.generate(["Hi"], SamplingParams(max_tokens=2, temperature=0)))
        >>> outs[0].num_generated_tokens
        2
        >>> aengine.shutdown()
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self._inbox: queue.Queue[_Submission | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._closed = False
        self._live: dict[int, _Live] = {}  # engine thread only
        # Published by the engine thread after every step while ``report_progress`` is on (read
        # by the rebalancer's lease loop): its sequences, running ones first, with the count of
        # submissions accepted so far (one consistent snapshot), and what moving one computed
        # token costs (``MigrationCosts``, refreshed every few steps).
        self.report_progress = False
        self.progress = EngineProgress()
        self._num_accepted = 0
        self.move_s_per_token = 0.0
        self._steps_since_costs = _COSTS_EVERY_STEPS

    @property
    def is_dead(self) -> bool:
        return self._error is not None

    @property
    def num_unfinished(self) -> int:
        return self.engine.num_unfinished + self._inbox.qsize()

    async def generate(self, prompts, sampling_params=None) -> list[GenerationOutput]:
        """All outputs, in input order."""
        results: dict[int, GenerationOutput] = {}
        async for index, out in self._submit(prompts, sampling_params):
            results[index] = out
        return [results[i] for i in range(len(results))]

    async def generate_stream(self, prompts, sampling_params=None) -> AsyncIterator[tuple[int, GenerationOutput]]:
        """``(input index, output)`` pairs as requests complete."""
        async for item in self._submit(prompts, sampling_params):
            yield item

    async def run_one(self, prompt, params: SamplingParams | None, state: SequenceState | None = None,
                      movable: bool = True) -> GenerationOutput | MigratedOut:
        """One request (or the continuation of an exported ``state``): its output, or, if it is
        ``movable``, a ``MigratedOut`` when ``migrate_out`` took it away to run elsewhere."""
        return await self._round_trip(lambda deliver: _Submission(prompt, params, deliver, state, movable))

    async def migrate_out(self, max_seqs: int, policy: Callable[[Engine], MovePolicy]) -> int:
        """MIGRATE out up to ``max_seqs`` movable sequences (``pick_to_move``: unstarted ones
        first, then those with the most tokens left among those the policy finds worth moving);
        each one's caller gets a
        ``MigratedOut`` with its state (KV included where the policy says so). ``policy`` is
        built from the engine between two steps, on the engine thread. Returns how many were
        taken out."""
        export = lambda: self._export_stragglers(max_seqs, policy(self.engine))  # noqa: E731
        return await self._round_trip(lambda deliver: _Command(export, deliver))

    async def _round_trip(self, make_item: Callable[[Callable[[object], None]], _Submission | _Command]):
        """Queue one item for the engine thread and await what it delivers."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self._ensure_running()
        self._inbox.put(make_item(_resolver(loop, done)))
        result = await done
        if isinstance(result, BaseException):
            raise EngineDeadError(f"engine failed: {result!r}") from result
        return result

    def _export_stragglers(self, max_seqs: int, costs: MovePolicy) -> int:
        movable = [live.seq for live in self._live.values() if live.movable and live.seq.status in EXPORTABLE]
        chosen = pick_to_move(movable, max_seqs, costs)
        for seq in chosen:
            state = self.engine.export_sequence(seq, with_kv=costs.send_kv(seq.num_computed_tokens))
            self._live.pop(seq.request_id).deliver(MigratedOut(state))
        return len(chosen)

    async def _submit(self, prompts, sampling_params) -> AsyncIterator[tuple[int, GenerationOutput]]:
        prompts, params = pair_requests(prompts, sampling_params)
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()
        self._ensure_running()
        for index, (prompt, sp) in enumerate(zip(prompts, params)):

            def deliver(result, index=index):
                loop.call_soon_threadsafe(inbox.put_nowait, (index, result))

            self._inbox.put(_Submission(prompt, sp, deliver))
        for _ in prompts:
            index, result = await inbox.get()
            if isinstance(result, BaseException):
                raise EngineDeadError(f"engine failed: {result!r}") from result
            yield index, result

    def _ensure_running(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"engine failed earlier: {self._error!r}")
        if self._closed:
            raise EngineDeadError("engine was shut down")
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="batchgen-engine", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        live = self._live
        try:
            while True:
                block = not self.engine.has_unfinished_requests()
                try:
                    item = self._inbox.get(block=block)
                    while True:
                        if item is None:
                            return
                        if isinstance(item, _Command):
                            item.deliver(item.fn())
                        else:
                            self._accept(item)
                        item = self._inbox.get_nowait()
                except queue.Empty:
                    pass
                if self.engine.has_unfinished_requests():
                    for seq in self.engine.step():
                        entry = live.pop(seq.request_id, None)
                        if entry is not None:
                            entry.deliver(self.engine.to_output(seq))
                    self._steps_since_costs += 1
                if self.report_progress:
                    self._publish_progress()
        except BaseException as err:  # the engine is unusable: fail every waiter loudly
            logger.exception("batchgen engine thread failed")
            self._error = err
            for entry in live.values():
                entry.deliver(err)
            while True:
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item.deliver(err)

    def _publish_progress(self) -> None:
        seqs = [SeqProgress(seq.num_generated, seq.params.max_tokens, seq.num_tokens,
                            seq.status is not SequenceStatus.WAITING, entry.movable,
                            seq.status is SequenceStatus.RUNNING)
                for entry in self._live.values() if (seq := entry.seq).status in EXPORTABLE]
        # Running ones first, then suspended, then waiting: the order they would run in.
        self.progress = EngineProgress(tuple(sorted(seqs, key=lambda p: (not p.running, not p.started))),
                                       self._num_accepted)
        if self._steps_since_costs >= _COSTS_EVERY_STEPS:
            self._steps_since_costs = 0
            self.move_s_per_token = MigrationCosts.of_engine(self.engine).move_s_per_token()

    def _accept(self, item: _Submission) -> None:
        self._num_accepted += 1
        if item.state is not None:
            seq = self.engine.import_sequence(item.state)
        else:
            seq = self.engine.add_request(item.prompt, item.params)
        if seq.status is SequenceStatus.FINISHED:
            item.deliver(self.engine.to_output(seq))
        else:
            self._live[seq.request_id] = _Live(seq, item.deliver, item.movable)

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the engine thread (after the work it already has in hand)."""
        self._closed = True
        if self._thread is not None:
            self._inbox.put(None)
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            self.engine.close()


def _resolver(loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> Callable[[object], None]:
    """Resolve ``future`` from the engine thread."""

    def deliver(result) -> None:
        loop.call_soon_threadsafe(lambda: future.done() or future.set_result(result))

    return deliver
