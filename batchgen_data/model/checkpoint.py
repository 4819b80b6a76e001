"""Read a Hugging Face checkpoint folder's safetensors into per-module weight tensors.

Accepts one file or an index of shards, per-expert expert keys (Mixtral ``w1/w2/w3``, Qwen/OLMoE
``gate_proj/up_proj/down_proj``) and fused 3-D expert tensors (``gate_up_proj`` [E, 2F, H] and
``down_proj`` [E, H, F], or their transposes).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from batchgen_data.errors import CheckpointError
from batchgen_data.model.config import ModelConfig
from batchgen_data.model.moe.experts import ExpertWeights

_MOE_PREFIXES = ("mlp", "block_sparse_moe")
_CPU_ALIGNMENT = 64  # bytes; torch's CPU allocator aligns to this
# (gate, up, down) names of per-expert projections.
_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


class CheckpointReader:
    """Lazy access to the tensors of all safetensors files in a folder, by name."""

    def __init__(self, folder: str | Path, dtype: torch.dtype, device: torch.device | str):
        self.folder = Path(folder)
        self.dtype, self.device = dtype, device
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors files in checkpoint folder {str(folder)!r}")
        self._handles = [safe_open(str(self.folder / f), framework="pt") for f in files]
        self._where = {key: h for h in self._handles for key in h.keys()}

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise CheckpointError(f"tensor {name!r} missing from checkpoint {str(self.folder)!r}")
        tensor = self._where[name].get_tensor(name).to(device=self.device, dtype=self.dtype)
        if tensor.device.type == "cpu" and tensor.data_ptr() % _CPU_ALIGNMENT:
            # MKL's GEMM rounds differently on unaligned operands: an owned (aligned) copy makes
            # results independent of where a tensor sat in its file.
            tensor = tensor.clone()
        return tensor

    def first(self, *names: str) -> torch.Tensor:
        for name in names:
            if name in self._where:
                return self.get(name)
        raise CheckpointError(f"none of {list(names)} in checkpoint {str(self.folder)!r}")

    def optional(self, name: str) -> torch.Tensor | None:
        return self.get(name) if name in self._where else None


def read_attention(reader: CheckpointReader, layer_id: int) -> dict[str, torch.Tensor]:
    p = f"model.layers.{layer_id}.self_attn"
    weights = {n: reader.get(f"{p}.{n}_proj.weight") for n in ("q", "k", "v", "o")}
    for n in ("q", "k", "v", "o"):
        bias = reader.optional(f"{p}.{n}_proj.bias")
        if bias is not None:
            weights[f"{n}_bias"] = bias
    for n in ("q_norm", "k_norm"):
        norm = reader.optional(f"{p}.{n}.weight")
        if norm is not None:
            weights[n] = norm
    return weights


def moe_prefix(reader: CheckpointReader, layer_id: int) -> str:
    for name in _MOE_PREFIXES:
        prefix = f"model.layers.{layer_id}.{name}"
        if reader.has(f"{prefix}.gate.weight"):
            return prefix
    raise CheckpointError(f"layer {layer_id}: no router weight (mlp.gate / block_sparse_moe.gate)")


def read_experts(reader: CheckpointReader, prefix: str, config: ModelConfig) -> ExpertWeights:
    """Stack layer experts into [E, 2F, H] / [E, H, F], whatever the checkpoint's layout."""
    e_count, hidden, ffn = config.num_experts, config.hidden_size, config.moe_intermediate_size
    p = f"{prefix}.experts"
    if reader.has(f"{p}.gate_up_proj") or reader.has(f"{p}.gate_proj"):
        if reader.has(f"{p}.gate_up_proj"):
            gate_up = _orient(reader.get(f"{p}.gate_up_proj"), (e_count, 2 * ffn, hidden), p)
        else:
            gate = _orient(reader.get(f"{p}.gate_proj"), (e_count, ffn, hidden), p)
            up = _orient(reader.get(f"{p}.up_proj"), (e_count, ffn, hidden), p)
            gate_up = torch.cat([gate, up], dim=1)
        down = _orient(reader.get(f"{p}.down_proj"), (e_count, hidden, ffn), p)
        return ExpertWeights(w_gate_up=gate_up.contiguous(), w_down=down.contiguous())
    for gate_name, up_name, down_name in _EXPERT_NAMES:
        if reader.has(f"{p}.0.{gate_name}.weight"):
            gate_up, down = [], []
            for e in range(e_count):
                gate = reader.get(f"{p}.{e}.{gate_name}.weight")  # [F, H]
                up = reader.get(f"{p}.{e}.{up_name}.weight")
                gate_up.append(torch.cat([gate, up], dim=0))
                down.append(reader.get(f"{p}.{e}.{down_name}.weight"))  # [H, F]
            return ExpertWeights(w_gate_up=torch.stack(gate_up), w_down=torch.stack(down))
    raise CheckpointError(f"no expert weights under {p!r} (per-expert or fused)")


def _orient(t: torch.Tensor, shape: tuple[int, int, int], where: str) -> torch.Tensor:
    """Return ``t`` as ``shape``, transposing the last two dims if it is stored the other way."""
    if tuple(t.shape) == shape:
        return t
    if tuple(t.shape) == (shape[0], shape[2], shape[1]):
        return t.transpose(1, 2)
    raise CheckpointError(f"{where}: fused expert tensor of shape {tuple(t.shape)}, expected {shape}")
