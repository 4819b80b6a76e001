"""``StepReport``: what one engine step did, as the engine, its timeline and its step listeners
(``AsyncEngine.add_step_listener``) read it. No torch."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class StepReport:
    """One step's counts, summed over expert-parallel ranks.

    ``extras`` holds the executor's timeline-only fields (module seconds, KV blocks used, per-rank
    tokens and collective times, ...), filled only while ``EngineConfig.collect_timeline`` is on.
    ``step_s`` is the engine's wall time around the executor's step.
    """

    num_running: int  # sequences in the running set after the step
    num_queued: int  # waiting or suspended after the step (and not yet placed on a rank)
    num_tokens: int  # forward tokens
    num_sampled: int  # tokens sampled
    step_s: float = 0.0
    extras: dict = field(default_factory=dict)
