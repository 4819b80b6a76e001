"""Per-forward attention metadata: where each flat token sits, and which KV slots each sequence reads.

A forward pass works on a flat batch of T tokens from B sequences (prefill chunks and decode
tokens mixed). The metadata maps that flat batch to the padded [B, Q, L] layout one batched
attention call needs, and to the paged KV cache's slots. It is built once per micro-batch and
shared by every layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class AttentionMetadata:
    positions: torch.Tensor  # [T] position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] KV slot (block * block_size + offset) each new token writes
    query_index: torch.Tensor  # [T] row of each token in the padded [B * Q] query layout
    block_table: torch.Tensor  # [B, P] KV blocks each sequence attends over (padding -> block 0)
    query_positions: torch.Tensor  # [B, Q] position of each padded query (padding -> last)
    context_lens: torch.Tensor  # [B] tokens in KV after this forward
    num_seqs: int
    max_query_len: int
    block_size: int
    # Preallocated buffers the pages are gathered into, per ``KVSpec``: one [B * P, block_size,
    # *shape] tensor per stored tensor, shared by every layer of that spec; a spec missing here
    # allocates per call. Reusing memory makes the gather ~3x faster on CPU.
    gather_buffers: dict = field(default_factory=dict)
    _masks: dict = field(default_factory=dict)

    @property
    def num_gathered_blocks(self) -> int:
        return self.block_table.numel()

    @property
    def num_keys(self) -> int:
        """L, the padded key length every sequence of the micro-batch attends over."""
        return self.block_table.shape[1] * self.block_size

    def gather_pages(self, pages: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[num_blocks, block_size, *shape] pages -> [B, L, *shape]: each sequence's context.

        Gathers whole pages (contiguous runs of block_size tokens), not single token slots; ``out``
        is a reused buffer of at least ``num_gathered_blocks`` pages (see ``gather_buffers``).
        """
        if out is not None:
            out = out[: self.num_gathered_blocks]
        gathered = torch.index_select(pages, 0, self.block_table.view(-1), out=out)  # [B * P, bs, *shape]
        return gathered.view(self.num_seqs, self.num_keys, *pages.shape[2:])

    def pad_queries(self, q: torch.Tensor) -> torch.Tensor:
        """Flat queries [t, N, D] -> [B, N, Q, D], each sequence's queries padded to Q."""
        b, qmax, heads, dim = self.num_seqs, self.max_query_len, q.shape[1], q.shape[2]
        if qmax == 1:
            # One query per sequence. This stride layout (a transposed [B, 1, N, D]) keeps SDPA on
            # its CPU flash kernel; other layouts send it to the (GQA-copying) math path.
            return q.contiguous().view(b, 1, heads, dim).transpose(1, 2)
        q_pad = q.new_zeros(b * qmax, heads, dim)
        q_pad[self.query_index] = q
        return q_pad.view(b, qmax, heads, dim).transpose(1, 2)

    def unpad_outputs(self, out: torch.Tensor) -> torch.Tensor:
        """[B, N, Q, D] attention outputs -> the flat tokens' [t, N * D]."""
        b, heads, qmax, dim = out.shape
        if qmax == 1:
            return out.reshape(b, heads * dim)
        return out.transpose(1, 2).reshape(b * qmax, heads * dim)[self.query_index]

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """[B, 1, Q, L] boolean: query may attend key (causal, in context, within the window)."""
        if sliding_window not in self._masks:
            num_keys = self.block_table.shape[1] * self.block_size
            key_pos = torch.arange(num_keys, device=self.positions.device)
            q_pos = self.query_positions[:, :, None]  # [B, Q, 1]
            allowed = (key_pos[None, None, :] <= q_pos) & (
                key_pos[None, None, :] < self.context_lens[:, None, None]
            )
            if sliding_window is not None:
                allowed &= key_pos[None, None, :] > q_pos - sliding_window
            self._masks[sliding_window] = allowed[:, None]
        return self._masks[sliding_window]


def build_attention_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Build metadata for B sequences.

    Args:
        query_lens: new tokens per sequence in this forward (prefill chunk length, or 1 to decode).
        context_lens: tokens per sequence in KV after this forward (earlier tokens + new ones).
        block_tables: KV block ids per sequence, covering ``context_lens`` tokens.
        block_size: tokens per KV block.
    """
    max_blocks = (max(context_lens) + block_size - 1) // block_size
    padded = [blocks[:max_blocks] + [0] * (max_blocks - len(blocks)) for blocks in block_tables]
    if max(query_lens) == 1:
        return _decode_metadata(context_lens, padded, block_size, device)
    return _general_metadata(query_lens, context_lens, padded, block_size, device)


def _general_metadata(query_lens: list[int], context_lens: list[int], padded: list[list[int]], block_size: int,
                      device: torch.device | str) -> AttentionMetadata:
    """``build_attention_metadata`` for any query lengths (``padded``: the block tables cut or
    padded with block 0 to the longest context's pages)."""
    num_seqs, max_q = len(query_lens), max(query_lens)
    ctx = torch.tensor(context_lens, dtype=torch.long)
    qlen = torch.tensor(query_lens, dtype=torch.long)
    start = ctx - qlen  # [B] position of each sequence's first new token
    table = torch.tensor(padded, dtype=torch.long)  # [B, P]

    q_off = torch.arange(max_q)
    query_positions = torch.minimum(start[:, None] + q_off[None, :], (ctx - 1)[:, None])  # [B, Q]
    is_real = q_off[None, :] < qlen[:, None]  # [B, Q]
    rows = torch.arange(num_seqs)[:, None] * max_q + q_off[None, :]
    query_index = rows[is_real]  # [T]
    positions = (start[:, None] + q_off[None, :])[is_real]  # [T]
    seq_of_token = torch.arange(num_seqs)[:, None].expand(num_seqs, max_q)[is_real]
    slot_mapping = table[seq_of_token, positions // block_size] * block_size + positions % block_size  # [T]
    return AttentionMetadata(
        positions=positions.to(device),
        slot_mapping=slot_mapping.to(device),
        query_index=query_index.to(device),
        block_table=table.to(device),
        query_positions=query_positions.to(device),
        context_lens=ctx.to(device),
        num_seqs=num_seqs,
        max_query_len=max_q,
        block_size=block_size,
    )


def _decode_metadata(context_lens: list[int], table: list[list[int]], block_size: int,
                     device: torch.device | str) -> AttentionMetadata:
    """``build_attention_metadata`` where every query is one token (a decode step): the same
    fields computed on Python lists, four tensors built once each (a decode step at one sequence
    spent ~0.2 ms in the general path's two dozen small tensor ops)."""
    positions = [c - 1 for c in context_lens]
    slots = [blocks[p // block_size] * block_size + p % block_size for blocks, p in zip(table, positions)]
    pos = torch.tensor(positions, dtype=torch.long, device=device)
    return AttentionMetadata(
        positions=pos,
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        query_index=torch.arange(len(positions), device=device),
        block_table=torch.tensor(table, dtype=torch.long, device=device),
        query_positions=pos[:, None],
        context_lens=torch.tensor(context_lens, dtype=torch.long, device=device),
        num_seqs=len(positions),
        max_query_len=1,
        block_size=block_size,
    )


@dataclass(slots=True)
class AttentionBatch:
    """One forward's attention work: the flat batch split into micro-batches that attend apart.

    Projections, RoPE and the KV write run once over all T tokens (large GEMMs); only the
    attention core runs per micro-batch of B_attn sequences, each over its own metadata.
    """

    micro_batches: list[AttentionMetadata]  # in flat-token order
    slot_mapping: torch.Tensor  # [T] KV slot each token writes (all micro-batches)
    cos_sin: tuple[torch.Tensor, torch.Tensor]  # RoPE tables for the T tokens' positions

    def per_micro_batch(self, q: torch.Tensor, out_width: int,
                        attend: Callable[[torch.Tensor, AttentionMetadata], torch.Tensor]) -> torch.Tensor:
        """``attend(q[micro-batch], its metadata)`` for each micro-batch, in turn: [T, ...] ->
        [T, out_width]. Each micro-batch is a YIELD point between attention and the MoE."""
        if len(self.micro_batches) == 1:
            return attend(q, self.micro_batches[0])
        out = q.new_empty(q.shape[0], out_width)
        start = 0
        for meta in self.micro_batches:
            num = meta.positions.shape[0]
            out[start : start + num] = attend(q[start : start + num], meta)
            start += num
        return out

    @classmethod
    def combine(cls, metas: list[AttentionMetadata], rotary, dtype: torch.dtype) -> AttentionBatch:
        positions = torch.cat([m.positions for m in metas]) if len(metas) > 1 else metas[0].positions
        slots = torch.cat([m.slot_mapping for m in metas]) if len(metas) > 1 else metas[0].slot_mapping
        return cls(metas, slots, rotary.cos_sin(positions, dtype))
