"""The MTP layer's part of a step (``model/mtp.py``): keep its KV up to date and draft the next
step's tokens.

NOTE: after the main forward and sampling, over the same positions and attention metadata:
  catch up  the MTP layer's attention runs on every position of the step with (the main
            model's output state there, the token after it): the prompt's next token, the token
            sampled at that position, or for a drafted row the token sampled at each of its
            positions (equal to the draft where it was accepted). Its K/V lands in the cache's
            last layer at the same slots; a rejected position's is overwritten later, as the
            main model's. Its FFN runs only at the positions that draft (nothing else reads it).
  draft     for each row that sampled, the layer's logits at its last accepted position give
            d_1; d_j (j >= 2) runs the layer one position further on (its own output before,
            embed(d_{j-1})), as long as the row's blocks hold that position's slot: positions
            past the accepted ones, which the next step's catch-up overwrites before any
            attention reads them. Drafts are greedy (argmax), as vLLM's.
The drafts go back to the scheduler with the step's output; its proposer offers them next step
if the row's tokens are still what they were drafted after.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen_data.model import MoEModel
from batchgen_data.model.attention.metadata import AttentionBatch, build_attention_metadata
from batchgen_data.model.kv_cache import KVCache


@dataclass(slots=True)
class DraftRow:
    """A row that sampled this step: where its last accepted position's state is."""

    request_id: int
    hidden_row: int  # in the step's flat batch
    position: int  # its position in the sequence
    block_ids: list[int]


def catch_up_and_draft(model: MoEModel, kv: KVCache, batch: AttentionBatch, hidden: torch.Tensor,
                       next_ids: list[int], first_rows: list[int], rows: list[DraftRow],
                       num_drafts: int) -> dict[int, list[int]]:
    """Run the MTP layer over the step's positions (module NOTE); up to ``num_drafts`` draft
    tokens for each of ``rows``, by request id (none when ``num_drafts`` is 0)."""
    mtp, device = model.mtp, hidden.device
    layer_kv = kv.layers[-1]
    states = model.final_norm(hidden)  # [T, H]: the main model's output states
    first = None
    if first_rows:
        first = torch.zeros(hidden.shape[0], dtype=torch.bool, device=device)
        first[torch.tensor(first_rows, device=device)] = True
    if num_drafts <= 0:
        rows = []
    index = torch.tensor([r.hidden_row for r in rows], dtype=torch.long, device=device)
    y = mtp.forward(torch.tensor(next_ids, dtype=torch.long, device=device), states, batch, layer_kv, first,
                    rows=index)  # [R, H]: every position's K/V written, the output only where it drafts
    if not rows:
        return {}
    tokens = mtp.logits(y).argmax(dim=-1)  # [R]
    drafts = {r.request_id: [t] for r, t in zip(rows, tokens.tolist())}
    positions = [r.position for r in rows]
    block_size = kv.block_size
    for _ in range(1, num_drafts):
        keep = [i for i, (r, p) in enumerate(zip(rows, positions)) if p + 1 < len(r.block_ids) * block_size]
        if not keep:
            break
        if len(keep) < len(rows):
            index = torch.tensor(keep, device=device)
            rows, positions, y, tokens = [rows[i] for i in keep], [positions[i] for i in keep], y[index], tokens[index]
        positions = [p + 1 for p in positions]
        meta = build_attention_metadata([1] * len(rows), [p + 1 for p in positions], [r.block_ids for r in rows],
                                        block_size, device)
        y = mtp.forward(tokens, y, model.attention_batch(meta), layer_kv)
        tokens = mtp.logits(y).argmax(dim=-1)
        for r, t in zip(rows, tokens.tolist()):
            drafts[r.request_id].append(t)
    return drafts
