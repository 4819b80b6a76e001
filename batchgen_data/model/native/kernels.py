"""The compiled library's kernels over tensors: shapes checked, outputs allocated here.

The library (``bindings.cpp``) takes raw buffer addresses, so it builds without torch's C++
headers; every check that keeps it from reading or writing out of bounds is here or, for the
indices it follows (block tables, expert rows), in the kernel itself, which refuses bad ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from batchgen_data.model.native.expert_table import ExpertTable


@dataclass(slots=True)
class LogitTopK:
    """``NativeKernels.logit_topk`` of logits rows [n, V]."""

    top_values: torch.Tensor  # [n, k] fp32, descending (ties: the smaller token id first)
    top_ids: torch.Tensor  # [n, k] int64
    log_norm: torch.Tensor  # [n] fp32: log sum exp of the row
    chosen: torch.Tensor  # [n] int64: the chosen token (given, or the row's first maximum)
    chosen_value: torch.Tensor  # [n] fp32: its logit
    rank: torch.Tensor  # [n] int64: how many logits of the row are >= it
    num_nonfinite: int = 0  # rows whose log_norm is not finite (nothing else defined for them)


class NativeKernels:
    """``skinny_linear``, ``swiglu_experts`` and ``paged_decode_attention`` (fp32, CPU)."""

    def __init__(self, library: ModuleType):
        self.library = library
        self._skinny = library.skinny_into
        self.decode_layer = DecodeLayerKernels(library)

    def skinny_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ w [N, K].T -> [M, N], row-major (built for M <= 32). On the hot path of
        every decode GEMM: the checks are attribute reads only."""
        if not (x.dtype is _FP32 and w.dtype is _FP32 and x.is_cpu and w.is_cpu):
            _check_fp32_cpu(x, w)
        if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
            raise ValueError(f"skinny_linear: x [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
        if not x.is_contiguous():
            x = x.contiguous()
        if not w.is_contiguous():
            w = w.contiguous()
        (m, k), n = x.shape, w.shape[0]
        y = torch.empty((m, n), dtype=_FP32)
        self._skinny(x.data_ptr(), w.data_ptr(), y.data_ptr(), m, k, n)
        return y

    def swiglu_experts(self, x_sorted: torch.Tensor, starts: list[int], rows: list[int], w_gate_up: torch.Tensor,
                       w_down: torch.Tensor) -> torch.Tensor:
        """y_sorted [R, H] for x_sorted [R, H] grouped by expert: rows ``starts[i]:starts[i + 1]``
        go through the expert in weight row ``rows[i]`` of w_gate_up [n, 2F, H] and w_down [n, H, F]."""
        _check_fp32_cpu(x_sorted, w_gate_up, w_down)
        num, two_f, hidden = w_gate_up.shape
        if (x_sorted.dim() != 2 or x_sorted.shape[1] != hidden or two_f % 2 or w_down.dim() != 3
                or tuple(w_down.shape) != (num, hidden, two_f // 2)):
            raise ValueError(f"swiglu_experts: x [R, H], w_gate_up [n, 2F, H], w_down [n, H, F]; got "
                             f"{tuple(x_sorted.shape)}, {tuple(w_gate_up.shape)}, {tuple(w_down.shape)}")
        if not (w_gate_up.is_contiguous() and w_down.is_contiguous()):
            raise ValueError("swiglu_experts: the stacked expert weights must be contiguous")
        x_sorted = x_sorted.contiguous()
        y = torch.zeros_like(x_sorted)
        if not self.library.swiglu_experts_into(x_sorted.data_ptr(), y.data_ptr(), x_sorted.shape[0], hidden,
                                                two_f // 2, starts, rows, w_gate_up.data_ptr(), w_down.data_ptr(),
                                                num):
            raise ValueError(f"swiglu_experts: segments {starts} or weight rows {rows} out of range "
                             f"({x_sorted.shape[0]} rows, {num} experts)")
        return y

    def paged_decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_table: torch.Tensor, context_lens: torch.Tensor, scale: float,
                               window: int) -> torch.Tensor:
        """One query per sequence, q [B, Nq, D], over KV pages [num_blocks, block_size, Nkv, D]
        -> [B, Nq * D]; ``window`` 0 attends the whole context."""
        _check_fp32_cpu(q, k_cache, v_cache)
        b, nq, d = q.shape
        num_blocks, block_size, nkv, dk = k_cache.shape
        if (tuple(v_cache.shape) != tuple(k_cache.shape) or dk != d or nq % nkv or block_table.dim() != 2
                or block_table.shape[0] != b or tuple(context_lens.shape) != (b,)):
            raise ValueError(f"paged_decode_attention: q {tuple(q.shape)}, pages {tuple(k_cache.shape)}, "
                             f"table {tuple(block_table.shape)}, lengths {tuple(context_lens.shape)}")
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("paged_decode_attention: the KV pages must be contiguous")
        if block_table.dtype != torch.int64 or context_lens.dtype != torch.int64:
            raise ValueError("paged_decode_attention: block_table and context_lens must be int64")
        q, block_table, context_lens = q.contiguous(), block_table.contiguous(), context_lens.contiguous()
        out = torch.empty(b, nq * d, dtype=torch.float32)
        if not self.library.paged_decode_attention_into(
                q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(), context_lens.data_ptr(),
                out.data_ptr(), b, nq, d, block_size, nkv, block_table.shape[1], num_blocks, float(scale), int(window)):
            raise ValueError("paged_decode_attention: a context needs a page its block table does not name, or a "
                             f"block beyond the {num_blocks} pages")
        return out

    def logit_topk(self, logits: torch.Tensor, k: int, chosen: torch.Tensor | None = None) -> LogitTopK:
        """For logprobs, reading each row of ``logits`` [n, V] once: its log sum exp, its top
        ``k`` (1 <= k <= V), and the chosen token's value and rank (``chosen`` [n] token ids;
        None: each row's first maximum, the greedy token). Rows whose ``log_norm`` is not
        finite (a NaN, +inf, or only -inf) have nothing else defined."""
        _check_fp32_cpu(logits)
        logits = logits.contiguous()
        n, vocab = logits.shape
        picked = torch.full((n,), -1, dtype=torch.int64) if chosen is None else chosen.to(torch.int64).clone()
        out = LogitTopK(torch.empty(n, k), torch.empty(n, k, dtype=torch.int64), torch.empty(n), picked,
                        torch.empty(n), torch.empty(n, dtype=torch.int64))
        out.num_nonfinite = self.library.logit_topk_rows(
            logits.data_ptr(), n, vocab, k, picked.data_ptr(), out.top_values.data_ptr(), out.top_ids.data_ptr(),
            out.log_norm.data_ptr(), out.chosen_value.data_ptr(), out.rank.data_ptr())
        if out.num_nonfinite < 0:
            raise ValueError(f"logit_topk: k={k} or a chosen token out of range for {tuple(logits.shape)}")
        return out

    def topk_at(self, x: torch.Tensor, rows: list[int], k: int) -> torch.Tensor:
        """The ids of the top ``k`` of rows ``rows`` of x [N, V] (fp32, CPU, contiguous), read
        in place: [len(rows), k] int64, larger value first, ties by the smaller id; a row holding
        a NaN has -1 first (its order is not defined)."""
        num_rows, vocab = x.shape
        index = torch.tensor(rows, dtype=torch.int64)
        values, ids = torch.empty(len(rows), k), torch.empty(len(rows), k, dtype=torch.int64)
        if self.library.logit_topk_at(x.data_ptr(), num_rows, vocab, index.data_ptr(), len(rows), k, values.data_ptr(),
                                      ids.data_ptr()) < 0:
            raise ValueError(f"topk_at: k={k} or a row out of range for {tuple(x.shape)}: {rows}")
        return ids

    def lm_head_topk(self, x: torch.Tensor, head: torch.Tensor, k: int, with_norm: bool, chunk: int,
                     masks: tuple[np.ndarray, np.ndarray] | None = None,
                     keep: np.ndarray | None = None) -> LogitTopK | None:
        """``logit_topk(x @ head.T, k)`` with each row's greedy token (its first maximum) as the
        chosen one, without the [n, V] logits: torch's GEMM writes ``chunk`` vocabulary columns
        at a time into a buffer that stays in cache while the kernel takes their statistics.
        Each chunk's logits are bitwise those of the whole GEMM (one K loop per output).
        ``with_norm`` False: no log sum exp (the plain greedy token; ``log_norm`` is NaN). None
        where a row holds a NaN or +inf, or only -inf: those take the full logits.

        ``masks`` (rows [r] int64, words [r, ceil(V / 32)] int32): grammar bitmasks of those rows.
        Their statistics are over their allowed tokens (the kernel reads the mask words with the
        chunk, and skips the blocks a mask allows nothing of); their top lists hold allowed
        tokens only (-inf, id -1 past the last). ``chunk`` must then be a multiple of 32.
        ``keep`` [n] int64 in 1..k: how many of the top k each row needs (the rest of its row of
        ``top_values`` and ``top_ids`` is -inf, -1)."""
        _check_fp32_cpu(x, head)
        if masks is not None and chunk % 32:
            raise ValueError(f"lm_head_topk: masks need a chunk that is a multiple of 32, got {chunk}")
        n, vocab = x.shape[0], head.shape[0]
        m = torch.full((n,), float("-inf"))
        total = torch.zeros(n, dtype=torch.float64)
        ties, size = torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)
        bad = torch.zeros(n, dtype=torch.uint8)
        top_values, top_ids = torch.full((n, k), float("-inf")), torch.full((n, k), -1, dtype=torch.int64)
        buffer = torch.empty(n * min(chunk + _MIN_CHUNK, vocab))
        need = torch.full((n,), k, dtype=torch.int64) if keep is None else torch.from_numpy(np.array(keep, dtype=np.int64))
        required = need.clone()  # top entries a row must end with
        words, mask_of = _stream_masks(masks, n, vocab)
        if mask_of is not None:
            required[torch.from_numpy(mask_of >= 0)] = 1  # a masked row may allow fewer tokens than it keeps
        words_at, num_words = (0, 0) if words is None else (words.ctypes.data, words.shape[1])
        keep_at = 0 if keep is None else need.data_ptr()
        mask_at = 0 if mask_of is None else mask_of.ctypes.data
        stream = self.library.logit_topk_stream
        starts = list(range(0, vocab, chunk))
        if len(starts) > 1 and vocab - starts[-1] < _MIN_CHUNK:
            starts.pop()  # a narrow last chunk joins the one before (see _MIN_CHUNK)
        for i, start in enumerate(starts):
            width = (starts[i + 1] if i + 1 < len(starts) else vocab) - start
            logits = buffer[: n * width].view(n, width)
            torch.mm(x, head[start : start + width].t(), out=logits)
            if stream(logits.data_ptr(), n, width, start, k, with_norm, m.data_ptr(), total.data_ptr(),
                      ties.data_ptr(), top_values.data_ptr(), top_ids.data_ptr(), size.data_ptr(), bad.data_ptr(),
                      keep_at, words_at, num_words, mask_at) < 0:
                raise ValueError(f"lm_head_topk: the kernel refused k={k}, keep or the masks")
        if bool(bad.any()) or bool((size < required).any()) or not bool(m.isfinite().all()):
            return None
        if k > 1:  # the kernel keeps each row's top as a heap: sort by (value down, token id up)
            by_id = top_ids.argsort(dim=1)
            top_values, top_ids = top_values.gather(1, by_id), top_ids.gather(1, by_id)
            order = torch.sort(top_values, dim=1, descending=True, stable=True).indices
            top_values, top_ids = top_values.gather(1, order), top_ids.gather(1, order)
        log_norm = (m.double() + total.log()).float() if with_norm else torch.full((n,), float("nan"))
        return LogitTopK(top_values, top_ids, log_norm, top_ids[:, 0].clone(), top_values[:, 0].clone(), ties)

    def first_argmax(self, x: torch.Tensor) -> torch.Tensor:
        """[N, V] fp32 (CPU, contiguous) -> [N] int64: each row's first maximum (NaN counts as
        the maximum, the first NaN wins, as ``argmax``)."""
        num_rows, vocab = x.shape
        out = torch.empty(num_rows, dtype=torch.int64)
        if not self.library.first_argmax_rows(x.data_ptr(), num_rows, vocab, out.data_ptr()):
            raise ValueError(f"first_argmax: an empty row ({tuple(x.shape)})")
        return out

    def grammar_mask(self, logits: torch.Tensor, rows: np.ndarray, words: np.ndarray, greedy: np.ndarray) -> np.ndarray:
        """Structured outputs on ``logits`` [N, V] (in place): rows ``rows`` [n] int64 under the
        bitmasks ``words`` [n, ceil(V / 32)] int32. A ``greedy`` [n] row allowing some token is
        not written: its entry in the returned picks [n] int64 is its first maximum over the
        allowed tokens. Every other row gets -inf at its disallowed tokens (pick -1)."""
        _check_fp32_cpu(logits)
        if not logits.is_contiguous() or logits.dim() != 2:
            raise ValueError(f"grammar_mask: contiguous logits [N, V], got {tuple(logits.shape)}")
        num_rows, vocab = logits.shape
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        words = np.ascontiguousarray(words, dtype=np.int32)
        greedy = np.ascontiguousarray(greedy, dtype=np.uint8)
        n = rows.shape[0]
        if words.shape != (n, (vocab + 31) // 32) or greedy.shape != (n,):
            raise ValueError(f"grammar_mask: {n} rows need [{n}, {(vocab + 31) // 32}] words and [{n}] greedy "
                             f"flags, got {words.shape} and {greedy.shape}")
        picks = np.empty(n, dtype=np.int64)
        if not self.library.grammar_mask(logits.data_ptr(), num_rows, vocab, rows.ctypes.data, n, words.ctypes.data,
                                         words.shape[1], greedy.ctypes.data, picks.ctypes.data):
            raise ValueError(f"grammar_mask: a row index in {rows.tolist()} is outside the {num_rows} logits rows")
        return picks


_FP32 = torch.float32
# The narrowest chunk of vocabulary columns ``lm_head_topk`` gives torch's GEMM: MKL computes a
# product of 1-3 columns with another kernel than the whole GEMM's, whose outputs can differ in
# the last bit (seen at hidden sizes 5-256), so a chunk's logits would not be the whole GEMM's.
_MIN_CHUNK = 64


def _stream_masks(masks: tuple[np.ndarray, np.ndarray] | None, n: int,
                  vocab: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(words [r, W] int32 contiguous, mask_of [n] int64: each row's mask row or -1) for
    ``logit_topk_stream``, or (None, None) without masks."""
    if masks is None or len(masks[0]) == 0:
        return None, None
    rows, words = masks
    words = np.ascontiguousarray(words, dtype=np.int32)
    if words.shape != (len(rows), (vocab + 31) // 32):
        raise ValueError(f"lm_head_topk: {len(rows)} masked rows need [{len(rows)}, {(vocab + 31) // 32}] words, "
                         f"got {words.shape}")
    mask_of = np.full(n, -1, dtype=np.int64)
    mask_of[np.asarray(rows, dtype=np.int64)] = np.arange(len(rows))
    return words, mask_of


def _check_fp32_cpu(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"native kernels take fp32 CPU tensors, got {t.dtype} on {t.device}")


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class DecodeLayerKernels:
    """A decoder layer's attention and MoE blocks for a few decoding tokens, one call each
    (``decode_layer.cpp``); the caller (``model/fused_decode.py``) has checked that the layer's
    options are the ones the kernels implement and that every tensor is fp32, CPU and contiguous."""

    def __init__(self, library: ModuleType):
        self.library = library

    def attention_block(self, h: torch.Tensor, norm_w: torch.Tensor, eps: float, w_qkv: torch.Tensor, num_heads: int,
                        num_kv_heads: int, head_dim: int, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                        cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor,
                        w_o: torch.Tensor, scale: float, window: int) -> torch.Tensor:
        tokens, hidden = h.shape
        out = torch.empty_like(h)
        if not self.library.attention_block_decode(
                h.data_ptr(), out.data_ptr(), tokens, hidden, norm_w.data_ptr(), eps, w_qkv.data_ptr(), num_heads,
                num_kv_heads, head_dim, _address(q_norm), _address(k_norm), cos.data_ptr(), sin.data_ptr(),
                slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0], k_cache.shape[1],
                block_table.data_ptr(), context_lens.data_ptr(), block_table.shape[1], w_o.data_ptr(), scale, window):
            raise ValueError("attention_block_decode: a KV slot, page or block out of range")
        return out

    def moe_block(self, h: torch.Tensor, norm_w: torch.Tensor, eps: float, w_router: torch.Tensor, top_k: int,
                  renormalize: bool, experts: ExpertTable) -> tuple[torch.Tensor, torch.Tensor]:
        """h + the MoE block of ``h`` [T, H] and the routed tokens per expert; the experts' weights
        at ``experts``' addresses (``expert_table.py``)."""
        tokens, hidden = h.shape
        num_experts = w_router.shape[0]
        if experts.num_experts != num_experts:
            raise ValueError(f"moe_block: {num_experts} router rows, an expert table of {experts.num_experts}")
        out = torch.empty_like(h)
        counts = torch.empty(num_experts, dtype=torch.int64)
        if not self.library.moe_block_decode(
                h.data_ptr(), out.data_ptr(), tokens, hidden, norm_w.data_ptr(), eps, w_router.data_ptr(),
                num_experts, top_k, renormalize, experts.addresses.data_ptr(), experts.ffn, counts.data_ptr()):
            raise ValueError("moe_block_decode: a routed expert is not held here, or top_k is out of range")
        return out, counts
