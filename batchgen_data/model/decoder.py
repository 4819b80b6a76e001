"""One decoder layer's sub-blocks: residual attention, and a residual MoE (or dense) FFN."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen_data.model.attention.metadata import AttentionBatch
from batchgen_data.model.attention.spec import AttentionLayer, LayerKV
from batchgen_data.model.fused_decode import fused_attention_block, fused_moe_block
from batchgen_data.model.layers import GatedMLP, SharedExpert, rms_norm
from batchgen_data.model.moe.experts import ExpertBackend
from batchgen_data.model.moe.router import Router


@dataclass(slots=True)
class MoEBlock:
    """Router, experts and optional shared expert of one sparse layer."""

    router: Router
    experts: ExpertBackend
    shared_expert: SharedExpert | GatedMLP | None = None  # gated (Qwen2-MoE) or plain (DeepSeek, GLM)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> ([T, H], tokens per expert [E])."""
        out = self.experts(x, self.router(x))
        hidden = out.hidden
        if self.shared_expert is not None:
            hidden = hidden + self.shared_expert(x)
        return hidden, out.tokens_per_expert


@dataclass(slots=True)
class DecoderLayer:
    input_norm: torch.Tensor  # [H]
    attention: AttentionLayer
    post_attention_norm: torch.Tensor  # [H]
    ffn: MoEBlock | GatedMLP
    eps: float

    def attention_block(self, h: torch.Tensor, batch: AttentionBatch, kv: LayerKV) -> torch.Tensor:
        """Residual attention sub-block: h + attn(norm(h)), attention per micro-batch of ``batch``
        (in one native call for a few decoding tokens, ``model/fused_decode.py``)."""
        fused = fused_attention_block(self, h, batch, kv)
        if fused is not None:
            return fused
        return h + self.attention(rms_norm(h, self.input_norm, self.eps), batch, kv)

    def ffn_block(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Residual FFN sub-block: h + moe(norm(h)); also the tokens per expert (None if dense)."""
        if isinstance(self.ffn, MoEBlock):
            fused = fused_moe_block(self, h)
            if fused is not None:
                return fused
        x = rms_norm(h, self.post_attention_norm, self.eps)
        if isinstance(self.ffn, MoEBlock):
            out, counts = self.ffn(x)
            return h + out, counts
        return h + self.ffn(x), None
