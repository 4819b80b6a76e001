"""``RequestHandle``: what a caller of ``Engine.add_request`` holds. No torch.

The scheduler alone holds and writes a request's ``Sequence`` record (under expert parallelism,
on some rank). After every step the executor publishes ``RequestProgress`` for the requests that
ran or changed status, and the engine applies it to their handles: a handle shows where its
request really stands (RUNNING on a rank, SUSPENDED for memory, its tokens so far), and holds
the ``GenerationOutput`` once it finished. Only its engine writes it, through its methods.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from batchgen_data.engine.core.progress import RequestProgress
from batchgen_data.engine.core.sequence import SequenceStatus

if TYPE_CHECKING:
    from batchgen_data.engine.outputs import GenerationOutput
    from batchgen_data.engine.sampling_params import SamplingParams


@dataclass(slots=True, eq=False)
class RequestHandle:
    """One request, as its caller sees it.

    Example:
        >>> from batchgen_data import Engine, SamplingParams
        >>> engine = Engine("demo")
        >>> handle = engine.add_request("Hello", SamplingParams(max_tokens=2, temperature=0))
        >>> handle.status.name
        'WAITING'
        >>> while not handle.is_finished:
        ...     _ = engine.step()
        >>> handle.output.num_generated_tokens
        2
    """

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    arrival_s: float  # seconds since the engine started
    progress: RequestProgress  # the last one its executor published
    output: GenerationOutput | None = None  # once finished (an error row included)
    first_token_s: float | None = None  # when its progress first showed a new token (engine clock)

    # -- what a caller reads ------------------------------------------------------------------------

    @property
    def status(self) -> SequenceStatus:
        return self.progress.status

    @property
    def num_generated(self) -> int:
        return self.progress.num_generated

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return self.progress.num_tokens

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV is computed (what a MIGRATE with KV ships)."""
        return self.progress.num_computed_tokens

    @property
    def num_tokens_left(self) -> int:
        """Tokens it may still generate (its ``max_tokens`` budget left)."""
        return self.progress.num_tokens_left

    @property
    def is_finished(self) -> bool:
        return self.progress.status is SequenceStatus.FINISHED

    # -- what its engine writes -------------------------------------------------------------------

    def observe(self, progress: RequestProgress, now_s: float) -> None:
        """Take its executor's latest progress; a first new token sets ``first_token_s``."""
        if self.first_token_s is None and progress.num_generated > self.progress.num_generated:
            self.first_token_s = now_s
        self.progress = progress

    def finish(self, output: GenerationOutput) -> None:
        """Its result (timings in ``output.timings``, taken by the engine in its own clock)."""
        num_generated = output.num_generated_tokens
        if self.first_token_s is None and output.timings.first_token_s is not None:
            self.first_token_s = self.arrival_s + output.timings.first_token_s
        self.progress = replace(self.progress, status=SequenceStatus.FINISHED, num_generated=num_generated,
                                num_tokens=len(self.prompt_token_ids) + num_generated, has_host_kv=False)
        self.output = output

    def mark_exported(self) -> None:
        """MIGRATEd out: it continues in another engine, under another handle."""
        self.progress = replace(self.progress, status=SequenceStatus.EXPORTED, has_host_kv=False)
