"""``SamplingBatch``: the per-row sampling parameters of one forward's sampling rows, as tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from batchgen_data.engine.sample.processors import ProcessorRows


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling parameters for the N rows of a logits matrix, as tensors.

    ``temperatures``, ``top_ps`` and ``top_ks`` live on the logits' device; ``seeds`` and
    ``steps`` stay on the host (the noise is drawn there, row by row). The flags are computed
    once when the batch is built so the sampler branches without reading tensors back. When
    every row is greedy nothing reads the five tensors, and they are None (building them was
    ~0.08 ms of a one-sequence decode step).
    """

    temperatures: torch.Tensor | None  # [N] fp32; 0 = greedy
    top_ps: torch.Tensor | None  # [N] fp32 in (0, 1]
    top_ks: torch.Tensor | None  # [N] int64; <= 0 = off
    seeds: torch.Tensor | None  # [N] int64, host
    steps: torch.Tensor | None  # [N] int64, host: tokens generated so far by each row's sequence
    num_rows: int = 0
    all_greedy: bool = False
    any_top_k: bool = False
    any_top_p: bool = False
    # Structured outputs: the constrained rows and their grammar bitmasks ([n, ceil(V / 32)]
    # int32, host), or None when no row is constrained.
    bitmask_rows: list[int] | None = None
    token_bitmask: np.ndarray | None = None
    bitmask_greedy: list[bool] | None = None  # per constrained row: it samples greedily
    # Mask rows the scheduler left unfilled for a greedy pick from the argmax (``bitmask.LazyRows``).
    bitmask_lazy: Any = None
    # Logprobs: the rows that asked, and how many top tokens each lists.
    logprob_rows: list[int] | None = None
    logprob_ks: list[int] | None = None
    # Logits processors and penalties (``processors.py``): what the asking rows want, or None;
    # min_p per row on the logits' device (0: off) when a sampling row has one; the logprob
    # rows whose logits a processor changes (their logprobs are of the logits before it).
    processors: ProcessorRows | None = None
    min_ps: torch.Tensor | None = None  # [N] fp32
    raw_logprob_rows: list[int] | None = None

    @classmethod
    def build(cls, temperatures: list[float], top_ps: list[float], top_ks: list[int], seeds: list[int],
              steps: list[int], device: torch.device | str = "cpu", bitmask_rows: list[int] | None = None,
              token_bitmask: np.ndarray | None = None, logprobs: list[int | None] | None = None,
              processors: ProcessorRows | None = None, bitmask_lazy: Any = None) -> SamplingBatch:
        """From per-row Python values (one list per parameter, N each), the grammar masks of
        the constrained rows, each row's ``logprobs`` (None: not asked) and the asking rows'
        logits processors (``ProcessorRows.build``; None: no row asks)."""
        logprob_rows = None if logprobs is None else [i for i, k in enumerate(logprobs) if k is not None]
        changed = frozenset(processors.changed_rows) if processors is not None else frozenset()
        raw_logprob_rows = [r for r in logprob_rows if r in changed] if logprob_rows and changed else None
        all_greedy = all(t == 0.0 for t in temperatures)
        return cls(
            temperatures=None if all_greedy else torch.tensor(temperatures, dtype=torch.float32, device=device),
            top_ps=None if all_greedy else torch.tensor(top_ps, dtype=torch.float32, device=device),
            top_ks=None if all_greedy else torch.tensor(top_ks, dtype=torch.int64, device=device),
            seeds=None if all_greedy else torch.tensor([wrap_int64(s) for s in seeds], dtype=torch.int64),
            steps=None if all_greedy else torch.tensor(steps, dtype=torch.int64),
            num_rows=len(temperatures),
            all_greedy=all_greedy,
            any_top_k=any(k > 0 for k, t in zip(top_ks, temperatures) if t > 0.0),
            any_top_p=any(p < 1.0 for p, t in zip(top_ps, temperatures) if t > 0.0),
            bitmask_rows=bitmask_rows if token_bitmask is not None else None,
            token_bitmask=token_bitmask,
            # A row whose logprobs are asked is masked whole: its logprobs see the masked logits;
            # so is a row a logits processor changes after the mask (its pick is made after it).
            bitmask_lazy=bitmask_lazy if token_bitmask is not None else None,
            bitmask_greedy=None if token_bitmask is None else [
                temperatures[r] == 0.0 and (logprobs is None or logprobs[r] is None) and r not in changed
                for r in bitmask_rows],
            logprob_rows=logprob_rows or None,
            logprob_ks=[logprobs[i] for i in logprob_rows] if logprob_rows else None,
            processors=processors,
            min_ps=None if processors is None or processors.min_ps is None else torch.tensor(
                processors.min_ps, dtype=torch.float32, device=device),
            raw_logprob_rows=raw_logprob_rows or None,
        )

    def __len__(self) -> int:
        return self.num_rows


def wrap_int64(seed: int) -> int:
    """A seed's low 64 bits as a signed int64 (the noise reads them back as uint64)."""
    return (seed + 2**63) % 2**64 - 2**63
