"""A checkpoint's Multi-Token-Prediction layer (DeepSeek-V3, GLM-4.5: ``num_nextn_predict_layers``)
as a draft model: it predicts the token after next from the main model's output state.

NOTE: the layer, as DeepSeek-V3 trains it and vLLM serves it (``deepseek_mtp.py``):
  x_i    = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)])   # h_i: the main model's output state
                                                         # (after its final norm) at position i
  y_i    = decoder_block(x_i)                            # attention over the layer's own KV at
                                                         # positions <= i, then its MoE
  logits = head(norm(y_i))                               # predicts t_{i+2}
The embedding of position 0's input is zeroed, as vLLM does. Drafting k tokens after a row's
last known token t_{n+1} (the one just sampled): position n gives d_1; each further draft j
feeds y of the position before in place of h, with embed(d_{j-1}), one position later. The
layer's KV lives in the engine's paged cache as one more layer (same blocks and slots as the
main model's), so swap, recompute and MIGRATE carry it like the rest.
Its weights are ``model.layers.{num_hidden_layers}.*`` (the first MTP layer; the others are
not used): ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and a decoder layer of the
family's own kind. The embedding and output head are the main model's: DeepSeek-V3 shares them
(its checkpoints store copies as ``embed_tokens`` and ``shared_head.head``, not read here).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from batchgen_data.errors import CheckpointError
from batchgen_data.model.attention.metadata import AttentionBatch
from batchgen_data.model.attention.spec import KVSpec, LayerKV
from batchgen_data.model.checkpoint import CheckpointReader, moe_prefix
from batchgen_data.model.config import ModelConfig
from batchgen_data.model.decoder import DecoderLayer
from batchgen_data.model.expert_sources import read_experts
from batchgen_data.model.layers import linear, rms_norm
from batchgen_data.model.loader import load_attention, load_ffn
from batchgen_data.model.moe.store import ResidentExpertStore


@dataclass(slots=True)
class MTPLayer:
    embed_tokens: torch.Tensor  # [V, H]: the main model's
    enorm: torch.Tensor  # [H]
    hnorm: torch.Tensor  # [H]
    eh_proj: torch.Tensor  # [H, 2H]
    block: DecoderLayer
    head_norm: torch.Tensor  # [H]
    head: torch.Tensor  # [V, H]: the main model's lm_head
    eps: float

    @property
    def kv_spec(self) -> KVSpec:
        return self.block.attention.kv_spec

    def forward(self, next_ids: torch.Tensor, states: torch.Tensor, batch: AttentionBatch, kv: LayerKV,
                first: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """next_ids [T]: the token after each position; states [T, H]: the main model's output
        states there (or the layer's own output for a further draft); ``first`` [T] bool: the
        positions 0, whose embedding is zeroed. Every position's K/V is written; returns the
        layer's output y at ``rows`` ([R, H]; all T when None): the FFN runs on those only, as
        nothing else reads it."""
        e = torch.nn.functional.embedding(next_ids, self.embed_tokens)
        if first is not None and bool(first.any()):
            e = e.masked_fill(first[:, None], 0.0)
        x = torch.cat([rms_norm(e, self.enorm, self.eps), rms_norm(states, self.hnorm, self.eps)], dim=-1)
        h = linear(x, self.eh_proj)
        h = self.block.attention_block(h, batch, kv)
        if rows is not None:
            h = h[rows]
        if h.shape[0]:
            h, _ = self.block.ffn_block(h)
        return h

    def logits(self, y: torch.Tensor) -> torch.Tensor:
        """y [N, H] -> fp32 logits [N, V] (the layer's own head)."""
        return linear(rms_norm(y, self.head_norm, self.eps), self.head).float()


def has_mtp(reader: CheckpointReader, config: ModelConfig) -> bool:
    return config.num_nextn_predict_layers > 0 and reader.has(f"model.layers.{config.num_hidden_layers}.eh_proj.weight")


def load_mtp(reader: CheckpointReader, config: ModelConfig, embed: torch.Tensor, lm_head: torch.Tensor) -> MTPLayer:
    """The first MTP layer, its experts resident (every rank of an expert-parallel engine holds
    all of them: the layer drafts for that rank's own rows, with no collective)."""
    if not has_mtp(reader, config):
        raise CheckpointError(
            f"speculative_config method 'mtp' needs a Multi-Token-Prediction layer: config.json has "
            f"num_nextn_predict_layers={config.num_nextn_predict_layers} and the checkpoint "
            f"{'has' if reader.has(f'model.layers.{config.num_hidden_layers}.eh_proj.weight') else 'has no'} "
            f"model.layers.{config.num_hidden_layers}.eh_proj.weight")
    n = config.num_hidden_layers
    prefix = f"model.layers.{n}"
    try:
        moe_prefix(reader, n)
        sparse = (n,)
    except CheckpointError:
        sparse = ()
    layer_config = dataclasses.replace(config, num_hidden_layers=n + 1, sliding_windows=(*config.sliding_windows, None),
                                       sparse_layer_ids=config.sparse_layer_ids + sparse)
    store = ResidentExpertStore({n: read_experts(reader, moe_prefix(reader, n)[0], layer_config)} if sparse else {},
                                config.num_experts)
    block = DecoderLayer(
        input_norm=reader.get(f"{prefix}.input_layernorm.weight"),
        attention=load_attention(reader, layer_config, n),
        post_attention_norm=reader.get(f"{prefix}.post_attention_layernorm.weight"),
        ffn=load_ffn(reader, layer_config, n, store, "native", 1),
        eps=config.rms_norm_eps,
    )
    return MTPLayer(
        embed_tokens=embed,
        enorm=reader.get(f"{prefix}.enorm.weight"),
        hnorm=reader.get(f"{prefix}.hnorm.weight"),
        eh_proj=reader.get(f"{prefix}.eh_proj.weight"),
        block=block,
        head_norm=reader.get(f"{prefix}.shared_head.norm.weight"),
        head=lm_head,
        eps=config.rms_norm_eps,
    )
