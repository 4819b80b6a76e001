"""Helpers for the work-pool tests: an engine stand-in for a ``RebalanceClient`` (no model, no Ray).
A ``Coordinator`` in the test's own event loop is ``rebalance.transport.InProcessTransport``."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from batchgen_data.config import EngineConfig


class StalledEngine:
    """What a ``RebalanceClient`` reads of an ``AsyncEngine``, with ``max_running_seqs`` slots:
    every item it is given runs until the test cancels it; no step ever runs, so its probe's
    snapshot stays empty and its room is its slots less the items given to it."""

    def __init__(self, max_running_seqs: int = 8):
        stats = SimpleNamespace(num_forward_tokens=0, kernel_s=0.0, num_recomputed_tokens=0)
        self.engine = SimpleNamespace(max_running_seqs=max_running_seqs, kv_bytes_per_token=64, stats=lambda: stats, kv_capacity_tokens=1 << 20,
                                      config=EngineConfig(device="cpu"))
        self.num_unfinished = 0
        self.prompts: list = []

    def add_step_listener(self, listener) -> None:
        pass

    async def run_one(self, prompt, params, state=None, movable=True, in_pool=True):
        self.prompts.append(prompt)
        await asyncio.Event().wait()  # never finishes
