"""Computing ``TokenLogprobs`` from logits rows: one native call that reads each row once where
the native kernels are on (``model/native/logit_stats.cpp``: log sum exp, the top k, the chosen
token's value and rank, with a vectorised exp while each block is in registers), else torch's
passes.

NOTE: log p(t) = x_t - logsumexp(x). Over a 152k-token vocabulary every full pass counts
(``benchmarks/logprobs.py``), so:
  * a greedy batch that asks for logprobs takes its tokens from the same call (``chosen`` None:
    each row's first maximum, as ``first_argmax``), so its capture costs that one read of each
    row, as the plain argmax does, plus the exp work (``Sample`` in ``steps.py``);
  * the torch passes take the top max(k, 1) from block maxima: the row's maxima over blocks of
    ``BLOCK`` tokens (one fast reduction), the top-k blocks among them, and the top-k of those
    blocks' tokens; each of the k largest tokens lies in a block whose maximum is among the k
    largest, so this is exact (``torch.topk`` over the whole row costs ~5x more), and the sum of
    exp(x - max) is taken in place when the caller owns the rows, without the shift when every
    row's maximum is within +-60 (no overflow);
  * a row holding a NaN or +inf, or only -inf, takes the torch passes (torch's semantics);
  * the chosen token's rank is vLLM's: how many logits are >= its logit.
Nothing here runs for rows that did not ask for logprobs.
"""

from __future__ import annotations

import torch

from batchgen_data.engine.sample.logprobs import TokenLogprobs
from batchgen_data.model.native.kernels import LogitTopK

BLOCK = 64  # tokens per block for the top-k (V / 64 block maxima per row)
# Below this maximum logit, exp(x) of a whole row sums without overflow in fp32 (V e^60 << 3e38)
# and the largest terms are far from underflow: the shift by the maximum can be skipped.
_NO_SHIFT_LIMIT = 60.0


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor, ks: list[int], overwrite: bool = False,
                   top: LogitTopK | None = None) -> list[TokenLogprobs]:
    """logits: [n, V] fp32; chosen: [n] token ids (the sampled or next prompt token); ks[i]: how
    many top tokens row i lists (0: only the chosen one). ``overwrite``: ``logits`` may be
    clobbered (saves a copy). ``top``: ``logit_topk(logits, top_k_of(ks))`` if the caller has it."""
    if logits.shape[0] == 0:
        return []
    k_max = top_k_of(ks, logits.shape[1])
    if top is None:
        top = logit_topk(logits, k_max, chosen)
    if top is not None:
        return logprob_entries(top, ks)
    return _torch_logprobs(logits, chosen, ks, k_max, overwrite)


def top_k_of(ks: list[int], vocab: int) -> int:
    """How many top tokens a capture for rows asking ``ks`` computes (at least the first)."""
    return min(max(1, max(ks)), vocab)


def logit_topk(logits: torch.Tensor, k: int, chosen: torch.Tensor | None = None) -> LogitTopK | None:
    """The native kernel's ``LogitTopK`` (``chosen`` None: each row's first maximum) where the
    engine turned the native kernels on, the logits are fp32 on CPU and every row's log sum exp
    is finite; else None (the torch passes serve)."""
    from batchgen_data.model.native import active_native

    native = active_native()
    if native is None or logits.dtype != torch.float32 or logits.device.type != "cpu" or not logits.shape[1]:
        return None
    top = native.logit_topk(logits, k, chosen)
    return top if top.num_nonfinite == 0 else None


def logprob_entries(top: LogitTopK, ks: list[int]) -> list[TokenLogprobs]:
    """Each row's chosen token first, then its top ks[i] other than the chosen one (``top``
    holds at least max(ks) of them)."""
    log_norm = top.log_norm[:, None]
    top_lp = (top.top_values - log_norm).tolist()
    top_ids = top.top_ids.tolist()
    chosen_lp = (top.chosen_value - top.log_norm).tolist()
    out = []
    for token, lp, rank, k, ids_i, lps_i in zip(top.chosen.tolist(), chosen_lp, top.rank.tolist(), ks, top_ids, top_lp):
        ids, lps, rks = [token], [lp], [rank]
        for j in range(k):
            if ids_i[j] != token:
                ids.append(ids_i[j])
                lps.append(lps_i[j])
                rks.append(j + 1)
        out.append(TokenLogprobs(ids, lps, rks))
    return out


def _torch_logprobs(logits: torch.Tensor, chosen: torch.Tensor, ks: list[int], k_max: int,
                    overwrite: bool) -> list[TokenLogprobs]:
    top_values, top_ids = _topk(logits, k_max)  # [n, k_max], descending
    row_max = top_values[:, :1]  # [n, 1]
    chosen = chosen.to(logits.device)
    chosen_value = logits.gather(1, chosen[:, None])  # [n, 1]
    ranks = (top_values >= chosen_value).sum(dim=-1)  # vLLM's rank: logits >= the chosen one ...
    outside = top_values[:, -1] >= chosen_value[:, 0]  # ... counted over the row unless all are in the top k
    if bool(outside.any()):
        rows = outside.nonzero().squeeze(1)
        ranks[rows] = (logits[rows] >= chosen_value[rows]).sum(dim=-1)
    if -_NO_SHIFT_LIMIT < float(row_max.min()) and float(row_max.max()) < _NO_SHIFT_LIMIT:
        work = logits if overwrite else logits.clone()
        log_norm = torch.log(work.exp_().sum(dim=-1, keepdim=True))  # no overflow: skip the shift pass
    else:
        work = logits if overwrite else logits.clone()
        log_norm = row_max + torch.log(work.sub_(row_max).exp_().sum(dim=-1, keepdim=True))  # [n, 1]
    return logprob_entries(LogitTopK(top_values, top_ids, log_norm[:, 0], chosen, chosen_value[:, 0], ranks), ks)


def _topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits.topk(k)`` through block maxima (see module NOTE) when the row is long."""
    n, vocab = logits.shape
    blocks = vocab // BLOCK
    if blocks < 4 * k:
        return logits.topk(k, dim=-1)
    head = blocks * BLOCK
    block_max = logits[:, :head].reshape(n, blocks, BLOCK).amax(dim=-1)  # [n, blocks]
    best = block_max.topk(k, dim=-1).indices  # [n, k]
    candidates = (best[:, :, None] * BLOCK + torch.arange(BLOCK, device=logits.device)).reshape(n, -1)
    if head < vocab:  # the tail that does not fill a block is always a candidate
        tail = torch.arange(head, vocab, device=logits.device).expand(n, -1)
        candidates = torch.cat([candidates, tail], dim=1)
    values, picked = logits.gather(1, candidates).topk(k, dim=-1)
    return values, candidates.gather(1, picked)
