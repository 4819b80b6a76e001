"""A MoE transformer as separately callable modules over flat token batches.

embed -> [attention(l) -> router(l) -> experts(l) (+ shared expert)] x L -> norm -> lm_head

The engine calls the modules one by one (attention per micro-batch, router and experts on the
combined batch); ``forward`` runs them in order for a single batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from batchgen_data.model.attention.metadata import AttentionBatch, AttentionMetadata
from batchgen_data.errors import CheckpointError
from batchgen_data.model.attention.spec import KVSpec
from batchgen_data.model.checkpoint import CheckpointReader
from batchgen_data.model.config import ModelConfig
from batchgen_data.model.decoder import DecoderLayer, MoEBlock
from batchgen_data.model.fused_decode import fused_decode_forward, fused_logits
from batchgen_data.model.kv_cache import KVCache
from batchgen_data.model.layers import GatedMLP, SharedExpert, linear, rms_norm
from batchgen_data.model.loader import dense_weight_bytes, load_expert_store, load_layers, mtp_weight_bytes
from batchgen_data.model.moe.store import ExpertShard, ExpertStore
from batchgen_data.model.mtp import MTPLayer, load_mtp
from batchgen_data.model.rope import RotaryEmbedding


class MoEModel:
    """The model's weights as modules; see the module docstring for the call order."""

    def __init__(self, config: ModelConfig, embed_tokens, layers: list[DecoderLayer], norm, lm_head,
                 device, dtype, expert_store: ExpertStore | None = None, dense_weight_bytes: int = 0,
                 score=None, mtp: MTPLayer | None = None):
        self.config = config
        self.embed_tokens = embed_tokens  # [V, H]
        self.layers = layers
        self.norm = norm  # [H]
        self.lm_head = lm_head  # [V, H]
        self.score = score  # [L, H]: a sequence-classification head (``config.num_labels``), or None
        self.device, self.dtype = device, dtype
        self.expert_store = expert_store
        self.dense_weight_bytes = dense_weight_bytes  # every weight but the routed experts
        self.rotary = RotaryEmbedding(config.rope, config.rotary_dim, device)
        # The checkpoint's Multi-Token-Prediction layer, loaded as a draft model (its KV is the
        # cache's last layer), or None.
        self.mtp = mtp
        # (the KV cache, the whole-forward decode kernel's address table over it or None where a
        # layer is not one the kernels implement): ``fused_decode.ForwardPlan``, built on the
        # first decode step.
        self.fused_forward = None

    @classmethod
    def from_pretrained(
        cls,
        folder: str | Path,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        expert_backend: str = "native",
        expert_shard: ExpertShard | None = None,
        weight_memory_bytes: int | None = None,
        with_mtp: bool = False,
    ) -> MoEModel:
        """Load a checkpoint folder; with ``expert_shard`` (an expert-parallel rank, inside its
        initialised process group) only that rank's experts are read; with
        ``weight_memory_bytes``, the routed experts stream from the checkpoint through a pool of
        what the budget leaves beside the other weights (``StreamedExpertStore``); ``with_mtp``
        loads the checkpoint's MTP layer too (``model/mtp.py``)."""
        config = ModelConfig.from_pretrained(folder)
        reader = CheckpointReader(folder, dtype, device, config.fp8_block_size)
        dense_bytes = dense_weight_bytes(reader, config)
        store = load_expert_store(reader, config, expert_shard, weight_memory_bytes, dense_bytes)
        world_size = 1 if expert_shard is None else expert_shard.world_size
        layers = load_layers(reader, config, store, expert_backend, world_size)
        embed = reader.get("model.embed_tokens.weight")
        if config.tie_word_embeddings or not reader.has("lm_head.weight"):
            lm_head = embed
        else:
            lm_head = reader.get("lm_head.weight")
        score = _read_score(reader, config)
        mtp = load_mtp(reader, config, embed, lm_head) if with_mtp else None
        if mtp is not None:
            dense_bytes += mtp_weight_bytes(reader, config)
        return cls(config, embed, layers, reader.get("model.norm.weight"), lm_head, device, dtype, store, dense_bytes,
                   score, mtp)

    @property
    def kv_specs(self) -> list[KVSpec]:
        """What each layer stores per token in the KV cache (the MTP layer's last, if loaded)."""
        specs = [layer.attention.kv_spec for layer in self.layers]
        return specs + [self.mtp.kv_spec] if self.mtp is not None else specs

    def gemm_weights(self, max_batched_tokens: int, max_sampled_rows: int) -> tuple[dict, dict]:
        """The weights ``linear`` multiplies, by (N, K) shape in model order, and the most rows
        each shape sees in one call (for GEMM tuning)."""
        weights: dict[tuple[int, int], list[torch.Tensor]] = {}
        max_rows: dict[tuple[int, int], int] = {}

        def add(w: torch.Tensor, rows: int) -> None:
            shape = (w.shape[0], w.shape[1])
            weights.setdefault(shape, []).append(w)
            max_rows[shape] = max(rows, max_rows.get(shape, 0))

        for layer_id, layer in enumerate(self.layers):
            for w in layer.attention.projection_weights():
                add(w, max_batched_tokens)
            ffn = layer.ffn
            mlps = [ffn] if isinstance(ffn, GatedMLP) else []
            if isinstance(ffn, MoEBlock):
                shared = ffn.shared_expert
                mlps += [shared.mlp if isinstance(shared, SharedExpert) else shared] if shared is not None else []
                if ffn.experts.name == "native" and self.expert_store is not None:
                    # A streamed store's pool rows stand in for the experts it does not hold: the
                    # same shapes and counts as resident, so both tune (and cache) the same plan.
                    experts = self.expert_store.weights(layer_id, [])
                    routed = max_batched_tokens * self.config.num_experts_per_tok
                    for i in range(len(self.expert_store.owned(layer_id))):
                        add(experts.w_gate_up[i % experts.num_rows], routed)
                        add(experts.w_down[i % experts.num_rows], routed)
            for mlp in mlps:
                add(mlp.w_gate_up, max_batched_tokens)
                add(mlp.w_down, max_batched_tokens)
        add(self.lm_head, max_sampled_rows)
        return weights, max_rows

    @property
    def resident_weight_bytes(self) -> int:
        """Bytes the weights hold in memory: the dense ones and the routed experts held (all of
        them, this rank's, or a streamed store's pool)."""
        return self.dense_weight_bytes + (self.expert_store.nbytes if self.expert_store is not None else 0)

    @property
    def is_expert_parallel(self) -> bool:
        """Its MoE layers exchange tokens with other ranks: every rank must run every forward."""
        return self.expert_store is not None and self.expert_store.shard is not None

    def _moe_blocks(self) -> list[MoEBlock]:
        return [layer.ffn for layer in self.layers if isinstance(layer.ffn, MoEBlock)]

    def expert_comm_seconds(self) -> float:
        """Cumulative seconds the MoE layers spent exchanging tokens with other ranks."""
        return sum(getattr(block.experts, "comm_s", 0.0) for block in self._moe_blocks())

    def take_comm_spans(self) -> list[tuple[float, float]]:
        """(arrived, left) of every collective the MoE layers joined since the last call, in the
        order they ran (wall-clock seconds); empty without expert parallelism or host timers."""
        spans = []
        for block in self._moe_blocks():
            if getattr(block.experts, "comm_spans", None):
                spans += block.experts.comm_spans
                block.experts.comm_spans = []
        return sorted(spans)

    def idle_forward(self) -> None:
        """A zero-token forward: the MoE layers join their collectives with nothing to send, so a
        rank without work keeps the other ranks' all-to-alls from waiting (lockstep)."""
        empty = self.embed_tokens.new_zeros((0, self.config.hidden_size))
        for block in self._moe_blocks():
            block.experts(empty, block.router(empty))

    def close(self) -> None:
        """Stop a streamed expert store's fetch thread (nothing to do for resident experts)."""
        close = getattr(self.expert_store, "close", None)
        if close is not None:
            close()

    def new_kv_cache(self, num_blocks: int, block_size: int) -> KVCache:
        return KVCache(self.kv_specs, num_blocks, block_size, self.device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_tokens)  # [T, H]

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] from ``forward`` -> the model's output states [N, H] (its final norm):
        what the LM head and the pooler read."""
        return rms_norm(hidden, self.norm, self.config.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] (usually the last token of each sequence) -> fp32 logits [N, V]."""
        fused = fused_logits(self, hidden)  # a few rows: one native call
        if fused is not None:
            return fused
        logits = linear(self.final_norm(hidden), self.lm_head)  # [N, V]
        return logits.float().contiguous()  # row-major: the sampler reduces along V

    def attention_batch(self, attention: AttentionMetadata | list[AttentionMetadata]) -> AttentionBatch:
        """The micro-batches' metadata combined, with the RoPE tables of their positions."""
        return AttentionBatch.combine(attention if isinstance(attention, list) else [attention], self.rotary,
                                      self.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        attention: AttentionMetadata | list[AttentionMetadata] | AttentionBatch,
        kv_cache: KVCache,
        trace: ForwardTrace | None = None,
    ) -> torch.Tensor:
        """Run all layers on one flat batch; returns the final hidden states [T, H] (pre-norm).

        ``attention`` is the batch's metadata, or one per attention micro-batch (their tokens
        in order in ``input_ids``), or those combined (``attention_batch``): every layer runs
        attention per micro-batch and the router and experts once on the combined batch.
        ``trace`` collects per-module time and expert calls.
        """
        batch = attention if isinstance(attention, AttentionBatch) else self.attention_batch(attention)
        h = self.embed(input_ids)  # [T, H]
        fused = fused_decode_forward(self, h, batch, kv_cache)
        if fused is not None:  # every layer in one native call (a decode step of few tokens)
            h, (attention_s, moe_s), (calls, tokens) = fused
            if trace is not None:
                trace.add(attention_s, moe_s, None)
                trace.calls += calls
                trace.tokens += tokens
            return h
        for layer_id, layer in enumerate(self.layers):
            t0 = time.perf_counter()
            h = layer.attention_block(h, batch, kv_cache.layers[layer_id])
            t1 = time.perf_counter()
            h, counts = layer.ffn_block(h)
            if trace is not None:
                trace.add(t1 - t0, time.perf_counter() - t1, counts)
        return h


def _read_score(reader: CheckpointReader, config: ModelConfig) -> torch.Tensor | None:
    """The classification head of a ``*ForSequenceClassification`` checkpoint, in fp32 (vLLM
    runs it in fp32), checked against the label count; None for a causal LM."""
    if not config.num_labels:
        return None
    if not reader.has("score.weight"):
        raise CheckpointError(f"config.json declares a sequence classifier ({config.num_labels} labels) but the "
                              "checkpoint has no score.weight")
    score = reader.get("score.weight", torch.float32)  # [L, H]
    if tuple(score.shape) != (config.num_labels, config.hidden_size):
        raise CheckpointError(f"score.weight has shape {tuple(score.shape)}; config.json implies "
                              f"({config.num_labels}, {config.hidden_size}) (num_labels, hidden_size)")
    return score


@dataclass(slots=True)
class ForwardTrace:
    """What one ``MoEModel.forward`` spent: wall seconds in attention blocks (norms, projections,
    attention cores) and in FFN blocks (routers, experts, dense FFNs), and the (layer, expert)
    calls that ran with the token rows routed to them (``expert_totals``)."""

    attention_s: float = 0.0
    moe_s: float = 0.0
    counts: list[torch.Tensor] = field(default_factory=list)  # [E] routed rows per expert, per MoE layer
    calls: int = 0  # (layer, expert) pairs and token rows counted already (the whole-forward kernel)
    tokens: int = 0

    def add(self, attention_s: float, moe_s: float, counts: torch.Tensor | None) -> None:
        self.attention_s += attention_s
        self.moe_s += moe_s
        if counts is not None:
            self.counts.append(counts)

    def expert_totals(self) -> tuple[int, int]:
        """(layer, expert) pairs that ran on at least one token, and the token rows they ran:
        counted once per forward (per layer, the two reductions cost ~0.07 ms a layer at one
        decoding sequence)."""
        calls, tokens = self.calls, self.tokens
        for c in self.counts:  # numpy on the host: a few us, where torch reductions took ~0.1 ms a step
            values = c.numpy() if c.is_cpu else c.cpu().numpy()
            calls += int(np.count_nonzero(values))
            tokens += int(values.sum())
        return calls, tokens
