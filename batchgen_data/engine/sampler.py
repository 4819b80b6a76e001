"""Vectorised sampling: greedy, temperature, top-k, top-p, with per-row seeds.

Randomness is counter-based: each row's noise comes from a generator seeded with a hash of
(seed, tokens generated so far), so a request's tokens do not depend on what else shares the
batch, on how many requests are in flight, or on whether it was suspended and recomputed.
Sampling is Gumbel-max (argmax of logits / T plus Gumbel noise): unlike an inverse CDF over a
150k-token vocabulary, whose bucket edges move with the last bits of the logits, it only changes
its pick when two perturbed scores tie to within float error, so the same seed gives the same
tokens even when a different thread count or batch shape changes the logits by 1e-6.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling parameters for the N rows of a logits matrix."""

    temperatures: list[float]
    top_ps: list[float]
    top_ks: list[int]
    seeds: list[int]
    steps: list[int]  # tokens generated so far by each row's sequence


def counter_uniform(seeds: list[int], steps: list[int]) -> np.ndarray:
    """SplitMix64 of (seed, step) -> float64 uniforms in [0, 1)."""
    with np.errstate(over="ignore"):
        x = np.asarray(seeds, dtype=np.uint64) * _GOLDEN + np.asarray(steps, dtype=np.uint64) * _MIX1
        x ^= x >> np.uint64(30)
        x *= _MIX1
        x ^= x >> np.uint64(27)
        x *= _MIX2
        x ^= x >> np.uint64(31)
    return (x >> np.uint64(11)).astype(np.float64) * 2.0**-53


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits: [N, V] fp32 -> token ids [N] (int64, same device)."""
    tokens = first_argmax(logits)  # greedy for every row; sampled rows overwritten below
    rows = [i for i, t in enumerate(batch.temperatures) if t > 0.0]
    if not rows:
        return tokens
    device = logits.device
    idx = torch.tensor(rows, device=device)
    temps = torch.tensor([batch.temperatures[i] for i in rows], device=device, dtype=torch.float32)
    scaled = logits[idx] / temps[:, None]  # [n, V]
    top_ks = [batch.top_ks[i] for i in rows]
    if any(k > 0 for k in top_ks):
        scaled = _apply_top_k(scaled, top_ks)
    top_ps = [batch.top_ps[i] for i in rows]
    if any(p < 1.0 for p in top_ps):
        scaled = _apply_top_p(scaled, top_ps)
    gumbel = _gumbel_noise([batch.seeds[i] for i in rows], [batch.steps[i] for i in rows], scaled.shape[1])
    tokens[idx] = first_argmax(scaled + gumbel.to(device))
    return tokens


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """[N, V] -> [N]: the index of each row's first maximum (NaN counts as the maximum), as
    ``argmax`` and transformers' greedy search pick it.

    ``max(dim).indices`` has the same documented semantics and runs 3-4x faster than ``argmax``
    on CPU over a 32 k vocabulary (2.4 vs 10.6 ms for 256 rows on a 2-core Xeon).
    """
    return x.max(dim=-1).indices


def _gumbel_noise(seeds: list[int], steps: list[int], vocab: int) -> torch.Tensor:
    """[n, V] Gumbel(0, 1) noise; row i depends only on (seeds[i], steps[i])."""
    keys = (counter_uniform(seeds, steps) * 2.0**53).astype(np.int64)  # 53-bit per-row seeds
    uniform = torch.empty(len(seeds), vocab)
    for row, key in enumerate(keys.tolist()):
        uniform[row].uniform_(generator=torch.Generator().manual_seed(key))
    return -torch.log(-torch.log(uniform.clamp_(min=1e-12, max=1.0 - 1e-7)))


def _apply_top_k(scaled: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    vocab = scaled.shape[1]
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=scaled.device)
    k_max = int(ks.max())
    values = scaled.topk(k_max, dim=-1).values  # [n, k_max]
    threshold = values.gather(1, (ks - 1)[:, None])  # [n, 1]
    return scaled.masked_fill(scaled < threshold, float("-inf"))


def _apply_top_p(scaled: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    ps = torch.tensor(top_ps, device=scaled.device, dtype=torch.float32)[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # [n, V]
    remove_sorted = mass_before >= ps  # keeps the smallest prefix reaching p (at least one token)
    remove = torch.zeros_like(remove_sorted).scatter_(1, order, remove_sorted)
    return scaled.masked_fill(remove, float("-inf"))
