"""A decode step's greedy tokens, and what their logprobs need, without the [N, V] logits.

NOTE: with 64 rows and a 152k vocabulary the logits are 39 MB. Written by the LM head's GEMM and
read again for the argmax (or the log sum exp of logprobs), they cost two passes through memory
that the rest of the step does not need. So where every row of a step is greedy and nothing else
reads its logits (no processor, sampled row or draft; grammar masks are read with each chunk,
``engine/sample/grammar_topk.py``), the GEMM runs ``CHUNK`` vocabulary columns at a time into a
buffer that stays in cache and the native kernel (``logit_topk_stream``) takes each chunk's
maximum, ties, top k and, for logprobs, its sum of exponentials while the chunk is in cache. Each output is one dot product over the hidden size
either way, so a chunk's logits are bitwise the whole GEMM's (tested; a last chunk narrower than
64 columns joins the one before, as MKL computes 1-3 columns with another kernel).

It applies where ``compute_logits`` would run a GEMM over more than ``fused_decode.MAX_TOKENS``
rows; fewer rows' logits fit in cache anyway and come from the native skinny GEMM. Whether it
pays depends on the BLAS: on the demo model here the chunks made a 56- or 64-row greedy run
0.76-0.80x and a 40- or 48-row one no faster (``benchmarks/lm_head_ab.py``: MKL's whole GEMM
slows sharply between 48 and 56 rows). So ``HeadChoice`` measures: for each size bucket, the
first steps alternate the two ways, and the chunked head serves from then on only where it was
at least 3% faster. Tokens and logprobs are the same either way; only time differs. The choices
are kept on disk per machine, torch, thread count, LM head shape and native kernel sources
(``<cache>/lm-head-choices/``, ``HeadChoice.for_head``), so only a machine's first engine times
them: on a short job the timed steps are a visible share.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from batchgen_data.model.fused_decode import MAX_TOKENS
from batchgen_data.model.native import active_native, library_name
from batchgen_data.model.native.kernels import LogitTopK
from batchgen_data.paths import cache_dir, write_cache_file

logger = logging.getLogger(__name__)

CHUNK = 8192  # vocabulary columns per GEMM: 64 rows of them are 2 MiB, one core's L2 here


def lm_head_topk(model, hidden: torch.Tensor, k: int, with_norm: bool,
                 masks: tuple[np.ndarray, np.ndarray] | None = None, keep: np.ndarray | None = None) -> LogitTopK | None:
    """``LogitTopK`` of ``model.compute_logits(hidden)`` with each row's first maximum as its
    chosen token (``with_norm`` False: no log sum exp, for plain greedy rows), or None where
    this does not apply (few rows, no native kernels, not fp32 on CPU) or a row needs the full
    logits (a NaN or +inf, or only -inf). ``masks`` (rows, bitmask words): those rows' grammar
    masks, read with each chunk, and ``keep`` how many of the top k each row needs
    (``NativeKernels.lm_head_topk``)."""
    head = model.lm_head
    if (hidden.shape[0] <= MAX_TOKENS or hidden.dtype != torch.float32 or not hidden.is_cpu
            or head.dtype != torch.float32 or not head.is_contiguous() or k > head.shape[0]):
        return None
    native = active_native()
    if native is None:
        return None
    return native.lm_head_topk(model.final_norm(hidden).contiguous(), head, k, with_norm, CHUNK, masks, keep)


@dataclass(frozen=True)
class HeadRows:
    """Logits of a few rows of a step's hidden states (pre-norm, [N, H]), for the rows whose
    token the chunked head's statistics do not settle (``engine/sample/grammar_topk.py``)."""

    model: object
    hidden: torch.Tensor

    @property
    def vocab(self) -> int:
        return self.model.lm_head.shape[0]

    def whole(self, rows: list[int]) -> torch.Tensor:
        """[len(rows), V] fp32: those rows' whole logits (``compute_logits``)."""
        return self.model.compute_logits(self.hidden[rows])

    def at(self, row: int, tokens: torch.Tensor) -> torch.Tensor:
        """[len(tokens)] fp32: row ``row``'s logits at ``tokens`` alone (their LM head rows)."""
        normed = self.model.final_norm(self.hidden[row : row + 1])
        return torch.nn.functional.linear(normed, self.model.lm_head.index_select(0, tokens))[0].float()


PLAIN, LOGPROBS, GRAMMAR = 0, 1, 2  # HeadChoice kinds: what the step's greedy rows need
TRIALS = 3  # steps timed each way per bucket before one is chosen
# The chunked head serves a bucket only where its median step is this much faster: a step's time
# varies by a few percent, and a choice made on noise would stay (it is kept on disk).
MARGIN = 0.97
BUCKET = 8  # rows: sizes within one bucket share a choice
# Grammar steps share the plain steps' choice (and trials). Timed apart, their first steps (the
# ones timed) are not the job's: rows are still in forced and sparse states, and one lazy row's
# miss in a timed chunked step weighs on a median of three; the choice kept on this machine for
# 48-55 grammar rows was the whole logits. Forced both ways, grammar steps follow the plain
# steps' pattern: the chunked head 0.77-0.82x the whole logits' wall time at 56 and 64 rows
# under a counted regex or a bounded string, 1.00-1.015x at 40 and 48 (``benchmarks/
# lm_head_ab.py --constraint``, Xeon; plain steps 0.76-0.80x and 0.99-1.01x).
_TIMED_AS = {PLAIN: PLAIN, LOGPROBS: LOGPROBS, GRAMMAR: PLAIN}


@dataclass
class HeadChoice:
    """Chunked LM head or whole logits, per (row bucket, kind), chosen by timing real steps
    (kind: ``PLAIN`` greedy rows, ``LOGPROBS`` greedy rows with logprobs, ``GRAMMAR`` greedy
    rows some of them constrained): ``chunked`` says which way the next step of that size and
    kind goes, ``record`` takes its time (LM head to sampled tokens). ``enabled`` False: always
    the whole logits (an A/B's baseline, ``benchmarks/lm_head_ab.py``). ``path``: where the
    choices are kept."""

    enabled: bool = True
    path: Path | None = None
    times: dict[tuple[int, int], dict[bool, list[float]]] = field(default_factory=dict)
    chosen: dict[tuple[int, int], bool] = field(default_factory=dict)

    @classmethod
    def for_head(cls, head: torch.Tensor | None) -> HeadChoice:
        """The choices kept for an LM head of this shape on this machine, torch and thread
        count (none yet: an empty choice that keeps what it decides there); a model without
        an LM head (a classifier) never takes the chunked head."""
        from batchgen_data.hardware import cpu_model

        if head is None:
            return cls(enabled=False)
        # the kernels' sources too: a choice timed against other kernels is timed again
        parts = [platform.machine(), cpu_model(), torch.__version__, torch.get_num_threads(), tuple(head.shape),
                 str(head.dtype), CHUNK, BUCKET, TRIALS, MARGIN, library_name()]
        path = cache_dir() / "lm-head-choices" / f"{hashlib.sha1(repr(parts).encode()).hexdigest()[:16]}.json"
        choice = cls(path=path)
        if path.is_file():
            try:
                choice.chosen = {(int(b), int(n)): bool(c) for b, n, c in json.loads(path.read_text())["chosen"]}
            except (ValueError, KeyError, TypeError, OSError) as err:
                logger.warning("ignoring unreadable LM head choices %s: %s", path, err)
        return choice

    def chunked(self, rows: int, kind: int) -> bool:
        if not self.enabled:
            return False
        key = (rows // BUCKET, _TIMED_AS[kind])
        if key in self.chosen:
            return self.chosen[key]
        timed = self.times.setdefault(key, {True: [], False: []})
        return len(timed[True]) <= len(timed[False])  # alternate, chunked first

    def record(self, rows: int, kind: int, chunked: bool, seconds: float) -> None:
        key = (rows // BUCKET, _TIMED_AS[kind])
        if key in self.chosen or not self.enabled:
            return
        timed = self.times.setdefault(key, {True: [], False: []})
        timed[chunked].append(seconds)
        if len(timed[True]) >= TRIALS and len(timed[False]) >= TRIALS:
            self.chosen[key] = statistics.median(timed[True]) <= MARGIN * statistics.median(timed[False])
            self._keep()

    def _keep(self) -> None:
        if self.path is None:
            return
        try:  # other engines on the machine may add theirs: keep the union
            kept = json.loads(self.path.read_text())["chosen"] if self.path.is_file() else []
            merged = {(int(b), int(n)): bool(c) for b, n, c in kept} | self.chosen
            write_cache_file(self.path, json.dumps({"chosen": [[b, n, c] for (b, n), c in sorted(merged.items())]}))
        except (ValueError, KeyError, TypeError, OSError) as err:
            logger.warning("could not keep the LM head choices at %s: %s", self.path, err)
