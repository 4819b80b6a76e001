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

from batchgen_data.engine import Engine
from batchgen_data.errors import BatchGenError
from batchgen_data.outputs import GenerationOutput
from batchgen_data.sampling_params import SamplingParams
from batchgen_data.sequence import SequenceStatus

logger = logging.getLogger(__name__)


class EngineDeadError(BatchGenError, RuntimeError):
    """The engine thread failed; the engine cannot serve further requests."""


@dataclass(slots=True)
class _Submission:
    prompt: object
    params: SamplingParams | None
    deliver: Callable[[GenerationOutput | BaseException], None]


class AsyncEngine:
    """Runs ``engine`` on a background thread and serves asyncio callers.

    Example:
        >>> import asyncio
        >>> from batchgen_data import Engine, SamplingParams
        >>> from batchgen_data.async_engine import AsyncEngine
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

    @property
    def is_dead(self) -> bool:
        return self._error is not None

    @property
    def num_unfinished(self) -> int:
        return self.engine.scheduler.num_unfinished + self._inbox.qsize()

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

    async def _submit(self, prompts, sampling_params) -> AsyncIterator[tuple[int, GenerationOutput]]:
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
        if len(params) != len(prompts):
            raise BatchGenError(f"got {len(params)} sampling params for {len(prompts)} prompts")
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
        waiting: dict[int, Callable] = {}
        try:
            while True:
                block = not self.engine.has_unfinished_requests()
                try:
                    item = self._inbox.get(block=block)
                    while True:
                        if item is None:
                            return
                        seq = self.engine.add_request(item.prompt, item.params)
                        if seq.status is SequenceStatus.FINISHED:
                            item.deliver(self.engine.to_output(seq))
                        else:
                            waiting[seq.request_id] = item.deliver
                        item = self._inbox.get_nowait()
                except queue.Empty:
                    pass
                if self.engine.has_unfinished_requests():
                    for seq in self.engine.step():
                        deliver = waiting.pop(seq.request_id, None)
                        if deliver is not None:
                            deliver(self.engine.to_output(seq))
        except BaseException as err:  # the engine is unusable: fail every waiter loudly
            logger.exception("batchgen engine thread failed")
            self._error = err
            for deliver in waiting.values():
                deliver(err)
            while True:
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item.deliver(err)

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the engine thread (after the work it already has in hand)."""
        self._closed = True
        if self._thread is not None:
            self._inbox.put(None)
            self._thread.join(timeout)
