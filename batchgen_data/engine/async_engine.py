"""An asyncio front for one running ``Engine``: many callers feed one continuous batch.

Several Ray Data batches in flight in one actor (or any asyncio code) call ``generate`` /
``generate_stream`` concurrently; their requests join the same running set, so the engine's
batch stays full across caller boundaries. The engine itself runs on one background thread,
which is the only thread that touches it.

NOTE: the engine thread's loop. Take everything queued (submissions become live request
handles, ``LiveRequest``; commands run between two steps), run one step if anything is
unfinished and deliver the outputs of the requests that finished, then call every step listener
(``add_step_listener``) with the step's ``StepReport`` (``None`` when no step ran) and the live
requests. Rebalancing reads the engine through such a listener
(``migration/engine_probe.py``), never from the asyncio thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from batchgen_data.engine.core.sequence import EXPORTABLE, SequenceState
from batchgen_data.engine.engine import Engine
from batchgen_data.rebalance.core.move_rule import Move
from batchgen_data.engine.outputs import GenerationOutput
from batchgen_data.engine.pooling_params import PoolingParams
from batchgen_data.engine.request_handle import RequestHandle
from batchgen_data.engine.requests import pair_requests
from batchgen_data.engine.sampling_params import SamplingParams
from batchgen_data.engine.step_report import StepReport
from batchgen_data.errors import EngineDeadError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MigratedOut:
    """What a request's caller gets instead of an output when its sequence was moved away."""

    state: SequenceState


@dataclass(slots=True)
class _Submission:
    prompt: object
    params: SamplingParams | PoolingParams | None
    deliver: Callable[[GenerationOutput | MigratedOut | BaseException], None]
    state: SequenceState | None = None  # continue a sequence exported elsewhere
    movable: bool = False  # ``migrate_out`` may take it away (its caller accepts a MigratedOut)
    in_pool: bool = True  # False: a row its actor runs outside the stage's work pool (its load report says so)


@dataclass(slots=True)
class LiveRequest:
    """One accepted, unfinished request of an ``AsyncEngine`` (what step listeners see)."""

    handle: RequestHandle
    deliver: Callable
    movable: bool  # ``migrate_out`` may take it away (its caller accepts a MigratedOut)
    in_pool: bool = True  # False: a row its actor runs outside the stage's work pool


# Called on the engine thread after every loop turn: the ``AsyncEngine``, the step's report
# (``None``: no step ran, only submissions were accepted), and the live requests by request id
# (a read-only view; do not keep it past the call).
StepListener = Callable[["AsyncEngine", StepReport | None, Mapping[int, LiveRequest]], None]


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
        self._live: dict[int, LiveRequest] = {}  # engine thread only
        self._live_view = MappingProxyType(self._live)
        self._listeners: tuple[StepListener, ...] = ()
        self._num_accepted = 0

    def add_step_listener(self, listener: StepListener) -> None:
        """Call ``listener(self, report, live)`` on the engine thread after every step (and after
        accepting submissions when no step ran, with ``report`` None), so it sees the accepted
        counts. It must be quick and must not call into the engine's asyncio API.

        Example:
            >>> from batchgen_data import Engine
            >>> aengine = AsyncEngine(Engine("demo"))
            >>> aengine.add_step_listener(lambda engine, report, live: None)
            >>> aengine.shutdown()
        """
        self._listeners = (*self._listeners, listener)  # one assignment: the engine thread iterates it

    @property
    def num_accepted(self) -> int:
        """Submissions the engine thread has accepted so far (read it from a step listener)."""
        return self._num_accepted

    @property
    def is_dead(self) -> bool:
        return self._error is not None

    @property
    def num_unfinished(self) -> int:
        return self.engine.num_unfinished + self._inbox.qsize()

    async def generate(self, prompts, sampling_params=None) -> list[GenerationOutput]:
        """All outputs, in input order. ``sampling_params`` as ``Engine.generate``'s; a
        ``PoolingParams`` with its task set (one, or one per prompt) makes pooling requests
        (``Engine.add_request``), which share the running set with generating ones."""
        results: dict[int, GenerationOutput] = {}
        async for index, out in self._submit(prompts, sampling_params):
            results[index] = out
        return [results[i] for i in range(len(results))]

    async def generate_stream(self, prompts, sampling_params=None) -> AsyncIterator[tuple[int, GenerationOutput]]:
        """``(input index, output)`` pairs as requests complete."""
        async for item in self._submit(prompts, sampling_params):
            yield item

    async def run_one(self, prompt, params: SamplingParams | PoolingParams | None, state: SequenceState | None = None,
                      movable: bool = True, in_pool: bool = True) -> GenerationOutput | MigratedOut:
        """One request (or the continuation of an exported ``state``): its output, or, if it is
        ``movable``, a ``MigratedOut`` when ``migrate_out`` took it away to run elsewhere.
        ``in_pool=False`` marks a row its actor runs outside the stage's work pool (reported as such)."""
        return await self._round_trip(lambda deliver: _Submission(prompt, params, deliver, state, movable, in_pool))

    async def migrate_out(self, moves: Iterable[Move]) -> int:
        """MIGRATE out exactly the sequences a plan names (``migration/planner.py``); each one's
        caller gets a ``MigratedOut`` with its state, its KV included where its ``Move`` says.
        A named request that is no longer here (it finished since the plan) or is not movable
        stays. Returns how many were taken out."""
        chosen = {move.request_id: move.send_kv for move in moves}
        return await self._round_trip(lambda deliver: _Command(lambda: self._export_stragglers(chosen), deliver))

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

    def _export_stragglers(self, chosen: Mapping[int, bool]) -> int:
        """Export the live movable requests among ``chosen`` (request id -> ship its KV)."""
        num_moved = 0
        for request_id, send_kv in chosen.items():
            live = self._live.get(request_id)
            if live is None or not live.movable or live.handle.status not in EXPORTABLE:
                continue
            state = self.engine.export_sequence(live.handle, with_kv=send_kv)
            del self._live[request_id]
            live.deliver(MigratedOut(state))
            num_moved += 1
        return num_moved

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
                report = None
                if self.engine.has_unfinished_requests():
                    for handle in self.engine.step():
                        entry = live.pop(handle.request_id, None)
                        if entry is not None:
                            entry.deliver(handle.output)
                    report = self.engine.last_report
                for listener in self._listeners:
                    listener(self, report, self._live_view)
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

    def _accept(self, item: _Submission) -> None:
        self._num_accepted += 1
        if item.state is not None:
            handle = self.engine.import_sequence(item.state)
        else:
            handle = self.engine.add_request(item.prompt, item.params)
        if handle.is_finished:
            item.deliver(handle.output)
        else:
            self._live[handle.request_id] = LiveRequest(handle, item.deliver, item.movable, item.in_pool)

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
