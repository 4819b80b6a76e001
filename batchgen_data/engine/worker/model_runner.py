"""Executes one ``SchedulerOutput`` on the model: module-based batching (paper Algorithm 1).

NOTE: the forward of one step, for the combined batch of B_moe sequences:
  h = embed(all tokens)
  for each layer:
      q, k, v = qkv(norm(h)); write k, v to the KV pages       # one GEMM over all tokens
      for each attention micro-batch of B_attn sequences:   # YIELD at the attention boundary
          a[mb] = attend(q[mb])                              # over its own paged-KV metadata
      h = h + o_proj(a)                                      # COMBINE again for the projection
      h = ffn_block(h)                                       # COMBINE: router + experts on all tokens
  logits = lm_head(norm(h[last token of each sampling sequence])); tokens = sample(logits)
  pooled = pooler(norm(h[last prompt token of each pooling sequence whose prompt is complete]))
Metadata for each micro-batch is built once per step and reused by every layer, so per-sequence
Python work is per step, not per layer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from batchgen_data.engine.sample.grammar_topk import filled_masks, kept_candidates
from batchgen_data.engine.sample.logprob_capture import token_logprobs
from batchgen_data.engine.sample.processors import ProcessorRows
from batchgen_data.engine.spec.drafter import num_accepted
from batchgen_data.engine.worker.mtp_drafts import DraftRow, catch_up_and_draft
from batchgen_data.engine.worker.pooler import pool
from batchgen_data.engine.core.runner_output import ModelRunnerOutput
from batchgen_data.engine.sample.sampler import Sampler, SamplingBatch
from batchgen_data.engine.core.scheduler import SchedulerOutput
from batchgen_data.engine.core.sequence import Sequence
from batchgen_data.model import MoEModel
from batchgen_data.model.attention.metadata import AttentionMetadata, build_attention_metadata
from batchgen_data.model.kv_cache import KVCache
from batchgen_data.model.fused_decode import MAX_TOKENS
from batchgen_data.model.lm_head_topk import GRAMMAR, LOGPROBS, HeadChoice, HeadRows, lm_head_topk
from batchgen_data.model.model import ForwardTrace

# Largest padded/real attention area accepted when grouping prefill chunks into a micro-batch.
_MAX_PADDING = 1.5
# Prompt positions whose logits are computed at once for prompt_logprobs (bounds the [rows, V]
# logits: 256 rows of a 152k vocabulary are 156 MB in fp32).
_PROMPT_LOGPROB_ROWS = 256


@dataclass(slots=True)
class StepWork:
    """What one forward computed, for roofline accounting (``benchmarks/roofline.py``)."""

    expert_calls: int = 0  # (layer, expert) pairs that ran on at least one token
    context_tokens: int = 0  # KV entries each layer's attention reads (every sequence's context)
    attended_keys: int = 0  # (query, key) pairs each layer scores: full causal, windows not subtracted


@dataclass(slots=True)
class RunnerStats:
    """Cumulative counters; ``kernel_s`` is time inside model modules and the sampler."""

    num_forwards: int = 0
    num_idle_forwards: int = 0  # zero-token forwards an expert-parallel rank ran to keep lockstep
    num_tokens: int = 0
    kernel_s: float = 0.0
    expert_calls: int = 0  # (layer, expert) GEMM pairs run
    expert_tokens: int = 0  # routed token rows over those calls
    last_tokens_per_expert_call: float = 0.0
    # The last step's wall seconds per module group ("attention": norms, projections and
    # attention cores; "moe": routers, experts and dense FFNs; "logits": final norm, lm_head,
    # sampling and the pooler). On CUDA, asynchronous kernels blur the split: each group's host
    # syncs absorb the device time queued before them.
    last_module_s: dict[str, float] = field(default_factory=dict)
    last_work: StepWork = field(default_factory=StepWork)

    @property
    def mean_tokens_per_expert_call(self) -> float:
        return self.expert_tokens / self.expert_calls if self.expert_calls else 0.0


class ModelRunner:
    """Runs the forward the scheduler asked for and returns what it produced; it reads
    sequences but never writes them (the scheduler applies the ``ModelRunnerOutput``)."""

    def __init__(self, model: MoEModel, kv_cache: KVCache, attention_batch_size: int,
                 sampler: Sampler | None = None):
        self.model = model
        self.kv = kv_cache
        self.attention_batch_size = attention_batch_size
        self.block_size = kv_cache.block_size
        self.sampler = sampler or Sampler()
        self.head_choice = HeadChoice.for_head(model.lm_head)
        self.stats = RunnerStats()

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run the forward; one sampled token per sampling sequence, in batch order, and the
        pooled output of each pooling sequence whose prompt it completes."""
        self.stats.last_module_s.update(attention=0.0, moe=0.0, logits=0.0)
        self.stats.last_work = work = StepWork()
        result = ModelRunnerOutput(host_kv=self._swap(out))
        if not out.seqs:
            if self.model.is_expert_parallel:
                self.model.idle_forward()  # lockstep: the other ranks' all-to-alls wait for this one
                self.stats.num_idle_forwards += 1
            return result
        device = self.model.device
        input_ids, metas, sample_rows, pool_rows, prompt_rows, spans = [], [], [], [], [], []
        for group in self._micro_batches(out):
            seqs = [out.seqs[i] for i in group]
            qlens = [out.query_lens[i] for i in group]
            for i, seq, qlen in zip(group, seqs, qlens):
                spans.append((i, len(input_ids), qlen))
                if seq.wants_prompt_logprobs:
                    prompt_rows += _prompt_logprob_rows(seq, qlen, len(input_ids))
                input_ids += seq.token_ids_range(seq.num_computed_tokens, seq.num_computed_tokens + qlen)
                if out.samples[i]:  # its last pending token: sampled from, or pooled
                    (pool_rows if seq.is_pooling else sample_rows).append((i, len(input_ids) - 1))
                    for j in range(len(seq.draft_token_ids)):  # and a draft's earlier positions
                        sample_rows.append((i, len(input_ids) - 2 - j))
            qlens, ctx, tables = _attention_rows(seqs, qlens)
            work.context_tokens += sum(ctx)
            work.attended_keys += sum(q * (c - q) + q * (q + 1) // 2 for q, c in zip(qlens, ctx))
            metas.append(build_attention_metadata(qlens, ctx, tables, self.block_size, device))
        self._attach_gather_buffers(metas)
        last_rows = [row for _, row in sorted(sample_rows)]  # back in batch order
        ids = torch.tensor(input_ids, dtype=torch.long, device=device)
        t0 = time.perf_counter()
        trace = ForwardTrace()
        attention = self.model.attention_batch(metas)
        hidden = self.model.forward(ids, attention, self.kv, trace)
        self._record(trace)
        t_logits = time.perf_counter()
        if last_rows:
            in_order = len(last_rows) == hidden.shape[0] and last_rows == list(range(len(last_rows)))
            states = hidden if in_order else hidden[torch.tensor(last_rows, device=device)]
            sampling, offsets, grammar_rows = _sampling_rows(out.sampling_seqs, out.grammar_rows)
            result.req_ids = [s.request_id for s in sampling]
            batch = _sampling_batch(sampling, device, grammar_rows, out.grammar_bitmask, offsets, out.grammar_lazy)
            sampled = self._sample(states, batch, len(last_rows))
            result.sampled_token_ids = sampled.token_ids.tolist()
            result.logprobs = sampled.logprobs
        if pool_rows:
            pool_rows.sort()  # batch order
            pooling = [out.seqs[i] for i, _ in pool_rows]
            rows = torch.tensor([row for _, row in pool_rows], device=device)
            states = self.model.final_norm(hidden[rows])  # [P, H]: the last prompt positions' states
            pooled = pool(self.model, states, [s.params for s in pooling])
            result.pooled_data = {s.request_id: data for s, data in zip(pooling, pooled)}
        if prompt_rows:
            result.prompt_logprobs = self._prompt_logprobs(hidden, prompt_rows)
        if self.model.mtp is not None:
            result.draft_token_ids = self._mtp_step(out, attention, hidden, input_ids, spans, last_rows,
                                                    result.sampled_token_ids)
        t_end = time.perf_counter()
        self.stats.last_module_s["logits"] = t_end - t_logits
        self.stats.kernel_s += t_end - t0
        self.stats.num_forwards += 1
        self.stats.num_tokens += len(input_ids)
        return result

    def _sample(self, states: torch.Tensor, batch: SamplingBatch, num_rows: int):
        """The LM head and the sampler on the sampling rows' states: a greedy batch of more than
        32 rows may take the chunked head (``lm_head_topk.py``; constrained rows' masks applied
        with each chunk, ``grammar_topk.py``), where ``head_choice`` measured it faster for that
        size and kind (or is still timing both ways)."""
        wanted = self.sampler.greedy_topk(batch) if num_rows == len(batch) > MAX_TOKENS else None
        if wanted is None:
            return self.sampler(self.model.compute_logits(states), batch)
        start = time.perf_counter()
        k, kind = wanted
        chunked = self.head_choice.chunked(num_rows, kind)
        masks, keep = (filled_masks(batch), kept_candidates(batch, num_rows)) if kind == GRAMMAR else (None, None)
        top = lm_head_topk(self.model, states, k, kind == LOGPROBS, masks, keep) if chunked else None
        if top is not None:
            sampled = self.sampler.from_topk(top, batch, HeadRows(self.model, states))
        else:
            sampled = self.sampler(self.model.compute_logits(states), batch)
        self.head_choice.record(num_rows, kind, top is not None, time.perf_counter() - start)
        return sampled

    def _mtp_step(self, out: SchedulerOutput, attention, hidden: torch.Tensor, input_ids: list[int],
                  spans: list[tuple[int, int, int]], sampled_rows: list[int], sampled: list[int]) -> dict[int, list[int]]:
        """The MTP layer's catch-up over this step's positions and the next step's drafts
        (``mtp_drafts.py``): the token after each position is the next one given, or the one
        sampled there. ``spans`` (sequence index, first row, query length) are in row order."""
        next_ids = input_ids[1:] + [0]
        token_at = dict(zip(sampled_rows, sampled))
        first_rows, rows = [], []
        for i, base, qlen in spans:
            seq, end = out.seqs[i], base + qlen - 1
            start = seq.num_computed_tokens
            if start == 0:
                first_rows.append(base)
            if end in token_at:  # it sampled: each sampled position's next token is its sample
                drafted = len(seq.draft_token_ids)
                for row in range(end - drafted, end + 1):
                    next_ids[row] = token_at[row]
                kept = num_accepted(seq.draft_token_ids, next_ids[end - drafted : end + 1])
                if not seq.params.adjusts_logits:
                    rows.append(DraftRow(seq.request_id, end - drafted + kept, start + qlen - 1 - drafted + kept,
                                         seq.block_ids))
            else:  # a prompt chunk that does not finish the prompt, or a pooled prompt
                after = seq.token_ids_range(start + qlen, start + qlen + 1)
                next_ids[end] = after[0] if after else 0
        return catch_up_and_draft(self.model, self.kv, attention, hidden, next_ids, first_rows, rows,
                                  out.num_mtp_drafts)

    def _prompt_logprobs(self, hidden: torch.Tensor, rows: list[tuple[int, int, int, int, int]]) -> dict:
        """``{request_id: (first prompt index, [TokenLogprobs...])}`` for the prompt positions of
        this forward (rows: request id, prompt index of the predicted token, hidden row, that
        token, k)."""
        found: dict[int, tuple[int, list]] = {}
        for start in range(0, len(rows), _PROMPT_LOGPROB_ROWS):
            chunk = rows[start : start + _PROMPT_LOGPROB_ROWS]
            index = torch.tensor([r[2] for r in chunk], device=hidden.device)
            logits = self.model.compute_logits(hidden[index])  # [m, V]
            values = token_logprobs(logits, torch.tensor([r[3] for r in chunk]), [r[4] for r in chunk], overwrite=True)
            for (request_id, position, *_), value in zip(chunk, values):
                _, entries = found.setdefault(request_id, (position, []))
                entries.append(value)
        return found

    def read_kv(self, seq: Sequence) -> torch.Tensor:
        """A running sequence's computed KV, out of its pages (MIGRATE with KV)."""
        return self.kv.read_tokens(seq.block_ids, seq.num_computed_tokens)

    def _swap(self, out: SchedulerOutput) -> dict[int, torch.Tensor]:
        """Read the KV of sequences swapped out (before their pages are reused in this forward),
        restore the KV of sequences swapped in; returns the KV read that stays on host."""
        saved = {seq.request_id: self.kv.read_tokens(block_ids, seq.num_computed_tokens)
                 for seq, block_ids in out.swap_out}
        for seq, kv in out.swap_in:
            self.kv.write_tokens(seq.block_ids, saved.pop(seq.request_id) if kv is None else kv)
        return saved

    def _record(self, trace: ForwardTrace) -> None:
        self.stats.last_module_s.update(attention=trace.attention_s, moe=trace.moe_s)
        calls, tokens = trace.expert_totals()
        self.stats.last_work.expert_calls = calls
        self.stats.expert_calls += calls
        self.stats.expert_tokens += tokens
        self.stats.last_tokens_per_expert_call = tokens / calls if calls else 0.0

    def _attach_gather_buffers(self, metas: list[AttentionMetadata]) -> None:
        """Point every micro-batch at the reused page-gather buffers (micro-batches run in turn)."""
        workspace = self.kv.gather_buffers(max(meta.num_gathered_blocks for meta in metas))
        for meta in metas:
            n = meta.num_gathered_blocks
            meta.gather_buffers = {layout: tuple(b[:n] for b in bufs) for layout, bufs in workspace.items()}

    def _micro_batches(self, out: SchedulerOutput) -> list[list[int]]:
        """Group the batch's sequences into attention micro-batches of at most B_attn.

        Attention pads every micro-batch to its longest query and context, so sequences are
        grouped by size: decoders by context length, prefill chunks longest first while the
        padded area stays under ``_MAX_PADDING`` times the real one.
        """
        size = self.attention_batch_size
        decoding = out.decoding
        decode = sorted((i for i, d in enumerate(decoding) if d), key=lambda i: out.seqs[i].num_computed_tokens)
        groups = [decode[k : k + size] for k in range(0, len(decode), size)]
        prefill = sorted((i for i, d in enumerate(decoding) if not d), key=lambda i: out.query_lens[i], reverse=True)
        group: list[int] = []
        real = 0
        for i in prefill:
            q, ctx = out.query_lens[i], out.seqs[i].num_computed_tokens + out.query_lens[i]
            if group:
                q0, ctx0 = out.query_lens[group[0]], out.seqs[group[0]].num_computed_tokens + out.query_lens[group[0]]
                padded = (len(group) + 1) * q0 * max(ctx0, ctx)
                if len(group) == size or padded > _MAX_PADDING * (real + q * ctx):
                    groups.append(group)
                    group, real = [], 0
            group.append(i)
            real += q * ctx
        if group:
            groups.append(group)
        return groups


def _attention_rows(seqs: list[Sequence], qlens: list[int]) -> tuple[list[int], list[int], list[list[int]]]:
    """Query lengths, context lengths and block tables of a micro-batch's attention. A decoder
    with a draft (speculative decoding) enters as one single-token query per position, the j-th
    over the first ``num_computed_tokens + j + 1`` tokens: causal attention within the draft, as
    decode attention (every position's K/V is written before any is attended), so a drafted
    step keeps the decode kernels."""
    if not any(seq.draft_token_ids for seq in seqs):
        return qlens, [s.num_computed_tokens + q for s, q in zip(seqs, qlens)], [s.block_ids for s in seqs]
    out_q, out_ctx, out_tables = [], [], []
    for seq, q in zip(seqs, qlens):
        if seq.draft_token_ids:
            out_q += [1] * q
            out_ctx += [seq.num_computed_tokens + j + 1 for j in range(q)]
            out_tables += [seq.block_ids] * q
        else:
            out_q.append(q)
            out_ctx.append(seq.num_computed_tokens + q)
            out_tables.append(seq.block_ids)
    return out_q, out_ctx, out_tables


def _prompt_logprob_rows(seq: Sequence, qlen: int, base: int) -> list[tuple[int, int, int, int, int]]:
    """The rows of this chunk whose hidden state predicts a prompt token not yet given a logprob:
    position p predicts prompt token p + 1 (entry 0 is None, so ``len(seq.prompt_logprobs)`` is
    the next token due)."""
    start = seq.num_computed_tokens
    due = len(seq.prompt_logprobs) if seq.prompt_logprobs else 1
    prompt, k = seq.prompt_token_ids, seq.params.prompt_logprobs
    end = min(start + qlen, len(prompt) - 1)
    return [(seq.request_id, p + 1, base + p - start, prompt[p + 1], k) for p in range(max(start, due - 1), end)]


def _sampling_rows(seqs: list[Sequence], grammar_rows: list[int]) -> tuple[list[Sequence], list[int] | None, list[int]]:
    """One sampling row per sequence, or, for a sequence with a draft of k tokens, k + 1 rows
    (its positions in order, the j-th sampling the row's token number ``num_generated + j``):
    the rows, each row's position offset (None when no sequence drafted), and the grammar rows
    renumbered (a drafted constrained sequence has a mask row per position)."""
    if not any(seq.draft_token_ids for seq in seqs):
        return seqs, None, grammar_rows
    rows, offsets, first = [], [], []
    for seq in seqs:
        first.append(len(rows))
        for j in range(1 + len(seq.draft_token_ids)):
            rows.append(seq)
            offsets.append(j)
    return rows, offsets, [first[r] + j for r in grammar_rows for j in range(1 + len(seqs[r].draft_token_ids))]


def _sampling_batch(seqs: list[Sequence], device: torch.device, grammar_rows: list[int],
                    grammar_bitmask, offsets: list[int] | None = None, grammar_lazy=None) -> SamplingBatch:
    return SamplingBatch.build(
        temperatures=[s.params.temperature for s in seqs],
        top_ps=[s.params.top_p for s in seqs],
        top_ks=[s.params.top_k for s in seqs],
        seeds=[s.seed for s in seqs],
        steps=([s.num_generated for s in seqs] if offsets is None
               else [s.num_generated + j for s, j in zip(seqs, offsets)]),
        device=device,
        bitmask_rows=grammar_rows,
        token_bitmask=grammar_bitmask,
        bitmask_lazy=grammar_lazy,
        logprobs=[s.params.logprobs for s in seqs] if any(s.params.logprobs is not None for s in seqs) else None,
        processors=ProcessorRows.of(seqs),  # None unless a row asks for a logits processor or penalty
    )
