"""Computing ``TokenLogprobs`` from logits rows: one read of each row where the native kernels
are on (``model/native/logit_stats.cpp``: block maxima and log sum exp, chunk by chunk while the
chunk is in cache, with a vectorised exp), else three cheap passes and one exp pass.

NOTE: log p(t) = x_t - logsumexp(x). Over a 152k-token vocabulary every full pass counts
(``benchmarks/logprobs.py``), so:
  * the top max(k, 1) come from block maxima: the row's maxima over blocks of ``BLOCK`` tokens
    (one fast reduction), the top-k blocks among them, and the top-k of those blocks' tokens;
    each of the k largest tokens lies in a block whose maximum is among the k largest, so this
    is exact (``torch.topk`` over the whole row costs ~5x more);
  * the sum of exp(x - max) is taken in place when the caller owns the rows (after sampling
    they are not needed again), so no [n, V] copy is made, and without the shift when every
    row's maximum is within +-60 (no overflow); this exp pass is the floor (~5 ms for 64 rows of
    152k on a 2-core EPYC);
  * the chosen token's rank is its place among the top-k when it is there, and only otherwise a
    count of the values at least as large (one more pass, for those rows alone).
Nothing here runs for rows that did not ask for logprobs.
"""

from __future__ import annotations

import torch

from batchgen_data.engine.sample.logprobs import TokenLogprobs

BLOCK = 64  # tokens per block for the top-k (V / 64 block maxima per row)
# Below this maximum logit, exp(x) of a whole row sums without overflow in fp32 (V e^60 << 3e38)
# and the largest terms are far from underflow: the shift by the maximum can be skipped.
_NO_SHIFT_LIMIT = 60.0


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor, ks: list[int],
                   overwrite: bool = False, stats: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[TokenLogprobs]:
    """logits: [n, V] fp32; chosen: [n] token ids (the sampled or next prompt token); ks[i]: how
    many top tokens row i lists (0: only the chosen one). ``overwrite``: ``logits`` may be
    clobbered (saves a copy). ``stats``: ``row_stats(logits)`` if the caller has them."""
    if logits.shape[0] == 0:
        return []
    k_max = max(1, max(ks))
    if stats is None:
        stats = row_stats(logits)
    block_max, native_log_norm = stats if stats is not None else (None, None)
    top_values, top_ids = _topk(logits, k_max, block_max)  # [n, k_max], descending
    row_max = top_values[:, :1]  # [n, 1]
    chosen = chosen.to(logits.device)
    chosen_value = logits.gather(1, chosen[:, None])  # [n, 1]
    in_top = top_ids == chosen[:, None]  # [n, k_max]
    ranks = (top_values >= chosen_value).sum(dim=-1)  # vLLM's rank: values >= the chosen one
    outside = ~in_top.any(dim=-1)
    if bool(outside.any()):
        rows = outside.nonzero().squeeze(1)
        ranks[rows] = (logits[rows] >= chosen_value[rows]).sum(dim=-1)
    if native_log_norm is not None:
        log_norm = native_log_norm
    elif -_NO_SHIFT_LIMIT < float(row_max.min()) and float(row_max.max()) < _NO_SHIFT_LIMIT:
        work = logits if overwrite else logits.clone()
        log_norm = torch.log(work.exp_().sum(dim=-1, keepdim=True))  # no overflow: skip the shift pass
    else:
        work = logits if overwrite else logits.clone()
        log_norm = row_max + torch.log(work.sub_(row_max).exp_().sum(dim=-1, keepdim=True))  # [n, 1]
    top_lp = (top_values - log_norm).tolist()
    top_ids_list = top_ids.tolist()
    chosen_lp = (chosen_value - log_norm).squeeze(1).tolist()
    ranks_list = ranks.tolist()
    out = []
    for i, (token, k) in enumerate(zip(chosen.tolist(), ks)):
        ids, lps, rks = [token], [chosen_lp[i]], [ranks_list[i]]
        for j in range(k):
            if top_ids_list[i][j] != token:
                ids.append(top_ids_list[i][j])
                lps.append(top_lp[i][j])
                rks.append(j + 1)
            else:
                rks[0] = j + 1  # the chosen token is in the top-k: its place there, as in vLLM
        out.append(TokenLogprobs(ids, lps, rks))
    return out


def row_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Block maxima [n, V // BLOCK] and log sum exp [n, 1] from the native kernel in one read of
    each row, where the engine turned the native kernels on and the logits are fp32 on CPU
    (else None). The greedy sampler takes its argmax from the same block maxima."""
    from batchgen_data.model.native import active_native

    native = active_native()
    if native is None or logits.dtype != torch.float32 or logits.device.type != "cpu":
        return None
    return native.logit_row_stats(logits, BLOCK)


def _topk(logits: torch.Tensor, k: int, block_max: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits.topk(k)`` through block maxima (see module NOTE; ``block_max`` when the caller
    has them) when the row is long."""
    n, vocab = logits.shape
    blocks = vocab // BLOCK
    if blocks < 4 * k:
        return logits.topk(k, dim=-1)
    head = blocks * BLOCK
    if block_max is None:
        block_max = logits[:, :head].reshape(n, blocks, BLOCK).amax(dim=-1)  # [n, blocks]
    best = block_max.topk(k, dim=-1).indices  # [n, k]
    candidates = (best[:, :, None] * BLOCK + torch.arange(BLOCK, device=logits.device)).reshape(n, -1)
    if head < vocab:  # the tail that does not fill a block is always a candidate
        tail = torch.arange(head, vocab, device=logits.device).expand(n, -1)
        candidates = torch.cat([candidates, tail], dim=1)
    values, picked = logits.gather(1, candidates).topk(k, dim=-1)
    return values, candidates.gather(1, picked)
