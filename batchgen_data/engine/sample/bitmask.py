"""Apply grammar bitmasks to logits: constrained rows sample only their grammar's tokens.

A bitmask row is ``ceil(V / 32)`` int32 words; token t is allowed when bit ``t % 32`` of word
``t // 32`` is set (xgrammar's and llguidance's layout). Unconstrained rows are not touched.

NOTE: on CPU, where the engine turned the native kernels on, one C++ pass over each row's
words does it (``model/native/grammar_mask.cpp``): every greedy row is picked, not written, and
every other row gets -inf at its disallowed tokens; all-ones words are read as vectors and
all-zero words skipped or filled whole. 48 greedy rows of the demo vocabulary under the masks
of ``[a-z]{400}`` (about a third of the vocabulary allowed) take ~1.9 ms a step there against
~31 ms in the numpy path below, and the sampler's own argmax over those rows is skipped (the
whole run: 1.9x the unconstrained time before, 1.2x after; Xeon, ``benchmarks/structured.py``).
Without the native kernels, the CPU path works on the words and writes only what it must. Writing ``-inf`` over a
whole 152k-token row costs as much as copying it (~60 us), and a grammar state usually allows
either almost every token (inside a JSON string) or a handful (between fields), so:
  * a row allowing more than half the vocabulary gets ``-inf`` scattered at its disallowed
    tokens only (found in the words that are not all ones);
  * a greedy row allowing fewer is not written at all: its token is the first maximum of its
    logits over the allowed tokens (found in the words that are not zero), which
    ``GrammarPicks`` hands to the sampler;
  * a sampling row allowing fewer is masked whole (its noise is drawn over the whole row anyway).
For 48 greedy rows of the demo vocabulary this takes ~1.4 ms where the libraries' own CPU
kernels take 19-30 ms (``benchmarks/structured.py``). On CUDA every row is masked whole, the
words unpacked on the device with shifts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from batchgen_data.engine.sample.kernels import native_for, top_ids_at

_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}


@dataclass(slots=True)
class GrammarPicks:
    """Greedy constrained rows whose token the mask step already chose (rows of the logits)."""

    rows: torch.Tensor  # [k] int64
    tokens: torch.Tensor  # [k] int64


class LazyRows(Protocol):
    """Mask rows left unfilled for a greedy pick from the argmax (``structured/lazy.py``)."""

    mask_rows: list[int]

    def first_allowed(self, i: int, tokens: list[int]) -> int | None: ...

    def fill(self, i: int, bitmask: np.ndarray) -> None: ...


LAZY_CANDIDATES = 16  # a lazy row's largest logits offered to its grammar, in order


def pick_lazily(logits: torch.Tensor, bitmask: np.ndarray, rows: list[int], greedy: list[bool] | None,
                lazy: LazyRows) -> tuple[list[int], GrammarPicks | None]:
    """The lazy rows' picks: a greedy row takes the first of its ``LAZY_CANDIDATES`` largest
    logits (value down, id up) that its grammar allows; that is the first maximum over the
    allowed tokens, which the mask would give, since every allowed token outside them comes
    after them in that order. A row none of whose candidates is allowed gets its mask filled
    into ``bitmask`` now. Returns the mask rows still to apply (``apply_token_bitmask``) and
    the picks."""
    picked: set[int] = set()
    pick_rows: list[int] = []
    pick_tokens: list[int] = []
    candidates = [i for i, mask_row in enumerate(lazy.mask_rows) if greedy is not None and greedy[mask_row]]
    tops = top_ids_at(logits, [rows[lazy.mask_rows[i]] for i in candidates], LAZY_CANDIDATES) if candidates else []
    offered = dict(zip(candidates, tops))
    for i, mask_row in enumerate(lazy.mask_rows):
        tokens = offered.get(i)
        token = lazy.first_allowed(i, tokens) if tokens else None
        if token is not None:
            picked.add(mask_row)
            pick_rows.append(rows[mask_row])
            pick_tokens.append(token)
        else:
            lazy.fill(i, bitmask)
    keep = [i for i in range(len(rows)) if i not in picked]
    picks = GrammarPicks(rows=torch.tensor(pick_rows, dtype=torch.int64),
                         tokens=torch.tensor(pick_tokens, dtype=torch.int64)) if pick_rows else None
    return keep, picks


def merge_picks(a: GrammarPicks | None, b: GrammarPicks | None) -> GrammarPicks | None:
    if a is None or b is None:
        return a if b is None else b
    return GrammarPicks(rows=torch.cat([a.rows, b.rows]), tokens=torch.cat([a.tokens, b.tokens]))


def apply_token_bitmask(logits: torch.Tensor, bitmask: np.ndarray, rows: list[int],
                        greedy: list[bool] | None = None) -> GrammarPicks | None:
    """Constrain ``logits[rows]`` (``[N, V]`` fp32, modified in place) to ``bitmask``
    (``[len(rows), ceil(V / 32)]`` int32, one row per entry of ``rows``).

    ``greedy[i]`` says row ``rows[i]`` samples greedily: then, on CPU, a row allowing few tokens
    may be left unwritten and its token returned in ``GrammarPicks`` instead (see module NOTE).
    Every other constrained row has ``-inf`` at each disallowed token.
    """
    if not rows:
        return None
    vocab = logits.shape[1]
    if bitmask.shape != (len(rows), (vocab + 31) // 32):
        raise ValueError(f"bitmask of shape {bitmask.shape} for {len(rows)} rows of a {vocab}-token vocabulary")
    if logits.device.type != "cpu":
        index = torch.tensor(rows, device=logits.device)
        words = torch.from_numpy(bitmask).to(logits.device, non_blocking=True)
        disallowed = _unpack_disallowed_device(words)[:, :vocab]  # [n, V]
        logits[index] = logits[index].masked_fill_(disallowed, float("-inf"))
        return None
    words = np.ascontiguousarray(bitmask, dtype=np.int32)
    row_ids = np.asarray(rows, dtype=np.int64)
    native = native_for(logits)
    if native is not None:  # one pass over each row's words (model/native/grammar_mask.cpp)
        flags = np.asarray(greedy if greedy is not None else [False] * len(rows), dtype=np.uint8)
        picks = native.grammar_mask(logits, row_ids, words, flags)
        picked = picks >= 0
        if not picked.any():
            return None
        return GrammarPicks(rows=torch.from_numpy(row_ids[picked]), tokens=torch.from_numpy(picks[picked]))
    num_allowed = np.bitwise_count(words.view(np.uint32)).sum(axis=1)  # [n]
    few = num_allowed * 2 < vocab
    pick = few & np.asarray(greedy if greedy is not None else [False] * len(rows), dtype=bool) & (num_allowed > 0)
    dense = ~few
    if dense.any():  # scatter -inf at the disallowed tokens
        mask_rows, tokens = _set_bits(~words[dense], vocab)
        flat = torch.from_numpy(row_ids[dense][mask_rows] * vocab + tokens)
        logits.view(-1).index_fill_(0, flat, float("-inf"))
    whole = few & ~pick
    if whole.any():  # mask the whole row, in place (gathering rows out and back costs more)
        disallowed = _unpack_disallowed_cpu(words[whole])  # [w, 32 W]
        for i, row in enumerate(row_ids[whole].tolist()):
            logits[row].masked_fill_(disallowed[i, :vocab], float("-inf"))
    if not pick.any():
        return None
    return _pick_greedy(logits, row_ids[pick], words[pick], vocab)


def allowed_tokens(words: np.ndarray, vocab: int) -> np.ndarray:
    """[W] int32 mask words -> the allowed token ids below ``vocab``, ascending (int64)."""
    return _set_bits(np.asarray(words, dtype=np.int32).reshape(1, -1), vocab)[1]


def _set_bits(words: np.ndarray, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """[n, W] int32 -> (mask row, token) of every set bit below ``vocab``, row-major order."""
    nonzero = np.flatnonzero(words.reshape(-1) != 0)  # the words with any bit set (flat: 2-D nonzero is slow)
    word_rows, word_ids = np.divmod(nonzero, words.shape[1])
    bits = np.unpackbits(words[word_rows, word_ids].view(np.uint8), bitorder="little").view(bool)  # [32 m]
    flat = np.flatnonzero(bits)  # on bools: ~6x faster than nonzero on the 2-D uint8 bits
    hit = flat >> 5
    tokens = word_ids[hit].astype(np.int64) * 32 + (flat & 31)
    keep = tokens < vocab
    return word_rows[hit][keep], tokens[keep]


def _pick_greedy(logits: torch.Tensor, row_ids: np.ndarray, words: np.ndarray, vocab: int) -> GrammarPicks:
    """Each row's first maximum over its allowed tokens (what argmax of the masked row gives)."""
    segment, tokens = _set_bits(words, vocab)  # sorted by (segment, token)
    seg = torch.from_numpy(segment)
    tok = torch.from_numpy(tokens)
    values = logits.view(-1).index_select(0, torch.from_numpy(row_ids[segment] * vocab + tokens))  # [m]
    values = torch.nan_to_num(values, nan=float("inf"))  # NaN counts as the maximum, as in argmax
    num = len(row_ids)
    best = torch.full((num,), float("-inf")).scatter_reduce_(0, seg, values, "amax")
    position = torch.where(values == best[seg], torch.arange(len(values)), len(values))
    first = torch.full((num,), len(values)).scatter_reduce_(0, seg, position, "amin")
    return GrammarPicks(rows=torch.from_numpy(row_ids), tokens=tok[first])


def _unpack_disallowed_cpu(bitmask: np.ndarray) -> torch.Tensor:
    """[n, W] int32 -> [n, 32 W] bool, True where the bit is clear."""
    inverted = np.invert(np.ascontiguousarray(bitmask)).view(np.uint8)  # little-endian words: byte 0 = tokens 0-7
    bits = np.unpackbits(inverted, axis=1, bitorder="little")  # [n, 32 W] uint8 in {0, 1}
    return torch.from_numpy(bits).view(torch.bool)


def _unpack_disallowed_device(words: torch.Tensor) -> torch.Tensor:
    shifts = _BIT_SHIFTS.get(words.device)
    if shifts is None:
        shifts = _BIT_SHIFTS[words.device] = torch.arange(32, dtype=torch.int32, device=words.device)
    return (((words[:, :, None] >> shifts) & 1) == 0).reshape(words.shape[0], -1)  # [n, 32 W]


def reference_masked(logits: torch.Tensor, bitmask: np.ndarray, rows: list[int]) -> torch.Tensor:
    """The definition, token by token (tests compare the kernel against it): a copy of
    ``logits`` with ``-inf`` at every disallowed token of the constrained rows."""
    out = logits.clone()
    for mask_row, row in enumerate(rows):
        for token in range(logits.shape[1]):
            word = int(bitmask[mask_row, token // 32]) & 0xFFFFFFFF
            if not (word >> (token % 32)) & 1:
                out[row, token] = float("-inf")
    return out
