"""What one forward produced: the model runner's answer to a ``SchedulerOutput``. No torch import.

The scheduler and the model runner meet only through ``SchedulerOutput`` (what to run) and
``ModelRunnerOutput`` (what came out); the runner never writes into sequences, the scheduler
applies the output in ``update``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the scheduler imports this module and stays torch-free
    import torch


@dataclass(slots=True)
class ModelRunnerOutput:
    """One forward's results, per sampling sequence in batch order.

    ``req_ids[i]`` sampled ``sampled_token_ids[i]``; ``logprobs[i]``, where a request asked for
    them, holds its ``TokenLogprobs`` (``None`` otherwise). ``prompt_logprobs`` maps a request
    computing prompt positions with ``prompt_logprobs`` to (the prompt index of its first entry,
    the entries) for this forward's positions. ``host_kv`` maps
    each sequence swapped out in this step to the KV read out of its pages (the scheduler keeps
    it until the sequence resumes). ``pooled_data`` maps each pooling request whose prompt this
    forward completed to its pooler output (embedding or class probabilities).
    """

    req_ids: list[int] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] | None = None
    prompt_logprobs: dict[int, tuple[int, list[Any]]] = field(default_factory=dict)
    host_kv: dict[int, torch.Tensor] = field(default_factory=dict)
    pooled_data: dict[int, list[float]] = field(default_factory=dict)
    # Speculative decoding with an MTP layer: each row's drafts for its next step, by request id.
    draft_token_ids: dict[int, list[int]] = field(default_factory=dict)

    @property
    def num_sampled(self) -> int:
        return len(self.sampled_token_ids)
