"""Presence, frequency and repetition penalties (vLLM's ``apply_penalties``), on the few
(row, token) pairs they can change.

NOTE: vLLM counts every row's prompt and output tokens into ``[N, V]`` bins and rewrites the
whole logits matrix. A penalty only changes a token the row has seen, so here each asking row's
seen tokens are counted on the host (``np.unique`` of its prompt and output) and only those
logits are read, changed and written back: O(prompt + output) per asking row instead of O(V),
and nothing for the other rows. Per token the arithmetic is vLLM's, in its order and in fp32:
  x = x / r if x > 0 else x * r      r: repetition_penalty, for a token in the prompt or output
  x = x - f * count                  f: frequency_penalty, count: times the output holds it
  x = x - p * (count > 0)            p: presence_penalty
(vLLM's CUDA kernel divides by r, as ``transformers``' ``RepetitionPenaltyLogitsProcessor``
does; its CPU fallback multiplies by 1 / r, which can differ in the last bit.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class PenaltyRows:
    """The (row, token) pairs the penalties of a batch's asking rows can change, with each
    pair's factors (host arrays, one entry per pair)."""

    rows: np.ndarray  # [m] int64: the logits row
    tokens: np.ndarray  # [m] int64
    repetition: np.ndarray  # [m] fp32: the row's repetition_penalty (1.0 when it has none)
    frequency: np.ndarray  # [m] fp32: the row's frequency_penalty
    presence: np.ndarray  # [m] fp32: the row's presence_penalty
    counts: np.ndarray  # [m] fp32: times the row's output holds the token (0: only in the prompt)

    @classmethod
    def build(cls, rows: list[int], params: list, prompts: list[list[int]], outputs: list[list[int]]) -> PenaltyRows:
        """One entry per asking row: its logits row, ``SamplingParams``, prompt and output ids."""
        parts = []
        for row, p, prompt, output in zip(rows, params, prompts, outputs):
            seen, counts = np.unique(np.asarray(output, dtype=np.int64), return_counts=True)
            if p.repetition_penalty != 1.0:  # it also covers the prompt's tokens
                in_prompt = np.unique(np.asarray(prompt, dtype=np.int64))
                tokens = np.union1d(in_prompt, seen)
                all_counts = np.zeros(len(tokens), dtype=np.int64)
                all_counts[np.searchsorted(tokens, seen)] = counts
                seen, counts = tokens, all_counts
            parts.append((row, p, seen, counts))
        sizes = [len(seen) for _, _, seen, _ in parts]

        def spread(values) -> np.ndarray:
            return np.repeat(np.asarray(values, dtype=np.float32), sizes)

        return cls(
            rows=np.repeat(np.asarray([row for row, *_ in parts], dtype=np.int64), sizes),
            tokens=np.concatenate([seen for _, _, seen, _ in parts]) if parts else np.zeros(0, np.int64),
            repetition=spread([p.repetition_penalty for _, p, _, _ in parts]),
            frequency=spread([p.frequency_penalty for _, p, _, _ in parts]),
            presence=spread([p.presence_penalty for _, p, _, _ in parts]),
            counts=(np.concatenate([c for *_, c in parts]) if parts else np.zeros(0, np.int64)).astype(np.float32),
        )


def apply_penalties(logits: torch.Tensor, penalties: PenaltyRows) -> None:
    """Penalise ``logits`` ([N, V] fp32, contiguous; changed in place) at ``penalties``' pairs."""
    if len(penalties.rows) == 0:
        return
    device = logits.device
    flat = logits.view(-1)
    index = torch.from_numpy(penalties.rows * logits.shape[1] + penalties.tokens).to(device)  # [m]
    x = flat.index_select(0, index)
    rep = torch.from_numpy(penalties.repetition).to(device)
    x = torch.where(x > 0, x / rep, x * rep)
    counts = torch.from_numpy(penalties.counts).to(device)
    x -= torch.from_numpy(penalties.frequency).to(device) * counts
    x -= torch.from_numpy(penalties.presence).to(device) * (counts > 0)
    flat.index_copy_(0, index, x)


def reference_penalties(logits: torch.Tensor, repetition: list[float], frequency: list[float],
                        presence: list[float], prompts: list[list[int]], outputs: list[list[int]]) -> torch.Tensor:
    """vLLM's dense ``apply_penalties`` over every row (tests compare the sparse kernel with
    it): a penalised copy of ``logits``."""
    num_rows, vocab = logits.shape
    out = logits.clone()
    output_counts = torch.zeros(num_rows, vocab, dtype=torch.int64)
    prompt_mask = torch.zeros(num_rows, vocab, dtype=torch.bool)
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        output_counts[i].index_add_(0, torch.tensor(output, dtype=torch.int64), torch.ones(len(output), dtype=torch.int64))
        prompt_mask[i, torch.tensor(prompt, dtype=torch.int64)] = True
    output_mask = output_counts > 0
    rep = torch.tensor(repetition, dtype=torch.float32)[:, None].expand(-1, vocab)
    rep = torch.where(prompt_mask | output_mask, rep, 1.0)
    out = torch.where(out > 0, out / rep, out * rep)
    out -= torch.tensor(frequency, dtype=torch.float32)[:, None] * output_counts
    out -= torch.tensor(presence, dtype=torch.float32)[:, None] * output_mask
    return out
