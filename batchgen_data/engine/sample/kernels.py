"""The sampling kernels: counter-based noise, seeded Gumbel-max sampling, min-p, top-k, top-p,
and a first-maximum argmax (see ``sampler.py`` for why the noise is counter-based)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from batchgen_data.engine.sample.batch import SamplingBatch

# first_argmax on CPU: block size, and the shortest row worth the block search.
_ARGMAX_BLOCK = 64
_ARGMAX_MIN_VOCAB = 4096
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def counter_uniform(seeds, steps) -> np.ndarray:
    """SplitMix64 of (seed, step) -> float64 uniforms in [0, 1) (lists, arrays or host tensors)."""
    with np.errstate(over="ignore"):
        x = np.asarray(seeds, dtype=np.int64).astype(np.uint64) * _GOLDEN
        x += np.asarray(steps, dtype=np.int64).astype(np.uint64) * _MIX1
        x ^= x >> np.uint64(30)
        x *= _MIX1
        x ^= x >> np.uint64(27)
        x *= _MIX2
        x ^= x >> np.uint64(31)
    return (x >> np.uint64(11)).astype(np.float64) * 2.0**-53


def sample(logits: torch.Tensor, batch: SamplingBatch, chosen: torch.Tensor | None = None) -> torch.Tensor:
    """logits: [N, V] fp32 -> token ids [N] (int64, same device). ``chosen``: [k] greedy rows
    whose token the caller has already (the grammar mask's picks): their entries are left 0."""
    if chosen is None:
        tokens = first_argmax(logits)  # greedy for every row; sampled rows overwritten below
    else:
        tokens = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
        free = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
        free[chosen] = False
        if bool(free.any()):
            rows = free.nonzero().squeeze(1)
            tokens[rows] = first_argmax(logits[rows])
    if batch.all_greedy:
        return tokens
    idx = (batch.temperatures > 0.0).nonzero().squeeze(1)  # [n] rows that sample
    if idx.numel() == 0:
        return tokens
    num_min_p = 0
    if batch.min_ps is not None:  # rows with a min-p first: their scaled logits are then a view
        has_min_p = batch.min_ps[idx] > 0.0
        idx = torch.cat([idx[has_min_p], idx[~has_min_p]])
        num_min_p = int(has_min_p.sum())
    scaled = logits[idx] / batch.temperatures[idx, None]  # [n, V]
    if num_min_p:  # vLLM's order: temperature, min-p, top-k, top-p
        _apply_min_p(scaled[:num_min_p], batch.min_ps[idx[:num_min_p]])
    if batch.any_top_k:
        scaled = _apply_top_k(scaled, batch.top_ks[idx])
    if batch.any_top_p:
        scaled = _apply_top_p(scaled, batch.top_ps[idx])
    host_idx = idx.cpu()
    gumbel = _gumbel_noise(batch.seeds[host_idx], batch.steps[host_idx], scaled.shape[1])
    tokens[idx] = first_argmax(scaled + gumbel.to(logits.device))
    return tokens


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """[N, V] -> [N]: the index of each row's first maximum (NaN counts as the maximum), as
    ``argmax`` and transformers' greedy search pick it.

    Where the engine turned the native kernels on (fp32, CPU) it is one native call
    (``model/native/argmax.cpp``). Otherwise, on CPU over a long row it goes through block
    maxima: ``amax`` over blocks of ``_ARGMAX_BLOCK`` tokens is one fast reduction, the first
    block holding the row's maximum holds its first occurrence, and only that block is searched;
    ``max(dim).indices`` over 64 rows of a 152k vocabulary takes ~5-7 ms on a 2-core EPYC, this
    ~1 ms. Elsewhere (and on short rows)
    ``max(dim).indices``, which has the same documented semantics and beats ``argmax`` 3-4x.
    """
    num_rows, vocab = x.shape
    native = native_for(x) if vocab else None
    if native is not None:  # one call: ~10 us at one row of 8k, where the ops below take ~0.2 ms
        return native.first_argmax(x)
    if x.device.type != "cpu" or vocab < _ARGMAX_MIN_VOCAB:
        return x.max(dim=-1).indices
    head = (vocab // _ARGMAX_BLOCK) * _ARGMAX_BLOCK
    block_max = x[:, :head].reshape(num_rows, -1, _ARGMAX_BLOCK).amax(dim=-1)  # [N, full blocks]
    if head < vocab:  # a last, partial block
        block_max = torch.cat([block_max, x[:, head:].amax(dim=-1, keepdim=True)], dim=1)
    best = block_max.max(dim=-1)  # the row maximum and the first block holding it (NaN first)
    starts = best.indices * _ARGMAX_BLOCK  # [N]
    index = (starts[:, None] + torch.arange(_ARGMAX_BLOCK)).clamp_(max=vocab - 1)  # [N, B]
    values = x.gather(1, index)
    target = best.values[:, None]
    hit = (values == target) | (values.isnan() & target.isnan())
    return starts + hit.int().argmax(dim=-1)  # the first hit (clamped repeats come after it)


def top_ids_at(x: torch.Tensor, rows: list[int], k: int) -> list[list[int]]:
    """For each of rows ``rows`` of x, its first ``k`` token ids in the order (value down, id
    up), read in place by one native call where the native kernels are on; else its first
    maximum alone (``first_argmax``). A row holding a NaN gets no ids (native)."""
    native = native_for(x) if x.shape[1] else None
    if native is None:
        return [[token] for token in first_argmax(x[torch.tensor(rows, device=x.device)]).tolist()]
    ids = native.topk_at(x, rows, min(k, x.shape[1])).tolist()
    return [[] if row[0] < 0 else row for row in ids]


def native_for(logits: torch.Tensor):
    """The native kernels where the engine turned them on and ``logits`` is a contiguous fp32
    CPU tensor, else None (the torch and numpy paths)."""
    from batchgen_data.model.native import active_native

    if logits.dtype != torch.float32 or not logits.is_cpu or not logits.is_contiguous():
        return None
    return active_native()


def _gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[n, V] Gumbel(0, 1) noise; row i depends only on (seeds[i], steps[i])."""
    keys = (counter_uniform(seeds.numpy(), steps.numpy()) * 2.0**53).astype(np.int64)  # 53-bit row seeds
    uniform = torch.empty(len(keys), vocab)
    for row, key in enumerate(keys.tolist()):
        uniform[row].uniform_(generator=torch.Generator().manual_seed(key))
    return -torch.log(-torch.log(uniform.clamp_(min=1e-12, max=1.0 - 1e-7)))


def _apply_min_p(scaled: torch.Tensor, min_ps: torch.Tensor) -> None:
    """scaled: [m, V], changed in place; min_ps: [m] fp32. A token whose probability under
    ``scaled`` is below min_p times the top token's gets -inf (vLLM's ``MinPLogitsProcessor``:
    the comparison on softmax probabilities, in fp32)."""
    probs = torch.softmax(scaled, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True).mul_(min_ps[:, None])  # [m, 1]
    scaled.masked_fill_(probs < threshold, float("-inf"))


def _apply_top_k(scaled: torch.Tensor, top_ks: torch.Tensor) -> torch.Tensor:
    """top_ks: [n] int64 (<= 0 or >= V: keep all)."""
    vocab = scaled.shape[1]
    ks = torch.where((top_ks > 0) & (top_ks < vocab), top_ks, vocab)  # [n]
    k_max = int(ks.max())
    values = scaled.topk(k_max, dim=-1).values  # [n, k_max]
    threshold = values.gather(1, (ks - 1)[:, None])  # [n, 1]
    return scaled.masked_fill(scaled < threshold, float("-inf"))


def _apply_top_p(scaled: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """top_ps: [n] fp32."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # [n, V]
    remove_sorted = mass_before >= top_ps[:, None]  # keeps the smallest prefix reaching p (at least one token)
    remove = torch.zeros_like(remove_sorted).scatter_(1, order, remove_sorted)
    return scaled.masked_fill(remove, float("-inf"))
