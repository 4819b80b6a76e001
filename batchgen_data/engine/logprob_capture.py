"""Computing ``TokenLogprobs`` from logits rows, in two passes over each row.

NOTE: log p(t) = x_t - logsumexp(x). One pass takes the row's top max(k, 1) (its first value is
the row's maximum), a second the sum of exp(x - max). The rank of the chosen token is its place
among the top-k when it is there, and only otherwise a count of the values at least as large
(a third pass, for those rows alone). Nothing here runs for rows
that did not ask for logprobs.
"""

from __future__ import annotations

import torch

from batchgen_data.engine.logprobs import TokenLogprobs


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor, ks: list[int]) -> list[TokenLogprobs]:
    """logits: [n, V] fp32; chosen: [n] token ids (the sampled or next prompt token); ks[i]: how
    many top tokens row i lists (0: only the chosen one)."""
    if logits.shape[0] == 0:
        return []
    k_max = max(1, max(ks))
    top_values, top_ids = logits.topk(k_max, dim=-1)  # [n, k_max], descending
    row_max = top_values[:, :1]  # [n, 1]
    log_norm = row_max + torch.log(torch.exp(logits - row_max).sum(dim=-1, keepdim=True))  # [n, 1]
    chosen = chosen.to(logits.device)
    chosen_value = logits.gather(1, chosen[:, None])  # [n, 1]
    in_top = top_ids == chosen[:, None]  # [n, k_max]
    # vLLM's rank: how many values are >= the chosen one (1 for the maximum)
    ranks = (top_values >= chosen_value).sum(dim=-1)  # [n], exact when the token is in the top-k
    outside = ~in_top.any(dim=-1)
    if bool(outside.any()):
        rows = outside.nonzero().squeeze(1)
        ranks = ranks.clone()
        ranks[rows] = (logits[rows] >= chosen_value[rows]).sum(dim=-1)
    top_lp = (top_values - log_norm).tolist()
    top_ids_list = top_ids.tolist()
    chosen_lp = (chosen_value - log_norm).squeeze(1).tolist()
    out = []
    for i, (token, k) in enumerate(zip(chosen.tolist(), ks)):
        ids, lps, rks = [token], [chosen_lp[i]], [int(ranks[i])]
        for j in range(k):
            if top_ids_list[i][j] != token:
                ids.append(top_ids_list[i][j])
                lps.append(top_lp[i][j])
                rks.append(j + 1)
            else:
                rks[0] = j + 1  # the chosen token is in the top-k: its place there, as in vLLM
        out.append(TokenLogprobs(ids, lps, rks))
    return out
