"""Read a Hugging Face checkpoint folder's safetensors into per-module weight tensors.

Accepts one file or an index of shards. safetensors maps each file into memory: a tensor read
here is a view of the mapping (file pages, not anonymous memory) until it is converted or copied.
The routed experts' layouts are read by ``expert_sources.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from batchgen_data.errors import CheckpointError
from batchgen_data.model.fp8 import FP8_DTYPES, dequantize_fp8

_MOE_PREFIXES = ("mlp", "block_sparse_moe")
_ROUTER_NAMES = ("gate", "router")
_CPU_ALIGNMENT = 64  # bytes; torch's CPU allocator aligns to this


class CheckpointReader:
    """Lazy access to the tensors of all safetensors files in a folder, by name."""

    def __init__(self, folder: str | Path, dtype: torch.dtype, device: torch.device | str,
                 fp8_block_size: tuple[int, int] | None = None):
        self.folder = Path(folder)
        self.dtype, self.device = dtype, device
        self.fp8_block_size = fp8_block_size  # (rows, cols) of a block-scaled FP8 weight's scale blocks
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors files in checkpoint folder {str(folder)!r}")
        self._handles = [self._open(f) for f in files]
        self._where = {key: h for h in self._handles for key in h.keys()}

    def _open(self, name: str):
        path = self.folder / name
        try:
            return safe_open(str(path), framework="pt")
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint shard {str(path)!r} is missing (named by the index)") from None
        except Exception as err:  # safetensors raises its own error type for a truncated or corrupt file
            raise CheckpointError(f"checkpoint shard {str(path)!r} cannot be read: {err}") from None

    def has(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        """Every tensor name of the checkpoint."""
        return list(self._where)

    def raw(self, name: str, rows: range | None = None) -> torch.Tensor:
        """The tensor as stored (dtype and all), on the host; ``rows`` reads only that slice of
        its first dimension (an expert shard) without materialising the rest."""
        if name not in self._where:
            raise CheckpointError(f"tensor {name!r} missing from checkpoint {str(self.folder)!r}")
        try:
            if rows is None:
                return self._where[name].get_tensor(name)
            return self._where[name].get_slice(name)[rows.start : rows.stop]
        except Exception as err:  # a truncated file fails only when the tensor is read
            raise CheckpointError(f"tensor {name!r} of checkpoint {str(self.folder)!r} cannot be read: {err}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name].get_slice(name).get_shape())

    def values(self, name: str, rows: range | None = None) -> torch.Tensor:
        """The tensor's values on the host in its stored dtype, except that a block-scaled FP8
        weight (with its ``*_scale_inv`` beside it) comes dequantized to fp32."""
        tensor = self.raw(name, rows)
        scale_name = f"{name}_scale_inv"
        if tensor.dtype in FP8_DTYPES and scale_name in self._where:
            if self.fp8_block_size is None:
                raise CheckpointError(f"{name} is FP8 but config.json's quantization_config gives no weight_block_size")
            scale = self.raw(scale_name, rows if tensor.dim() == 3 else None)
            try:
                tensor = dequantize_fp8(tensor, scale, self.fp8_block_size)
            except ValueError as err:
                raise CheckpointError(f"{name}: {err}") from None
        return tensor

    def get(self, name: str, dtype: torch.dtype | None = None, rows: range | None = None) -> torch.Tensor:
        """The tensor's values (``values``) in the engine's dtype (or ``dtype``) on its device."""
        return self.place(self.values(name, rows), dtype)

    def place(self, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        tensor = tensor.to(device=self.device, dtype=dtype or self.dtype)
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

    def optional(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        return self.get(name, dtype) if name in self._where else None


def read_attention(reader: CheckpointReader, layer_id: int) -> dict[str, torch.Tensor]:
    """GQA: q/k/v/o projections, their biases, q/k norms and sinks, where the checkpoint has them."""
    p = f"model.layers.{layer_id}.self_attn"
    weights = {n: reader.get(f"{p}.{n}_proj.weight") for n in ("q", "k", "v", "o")}
    weights.update(_optional(reader, {f"{n}_bias": f"{p}.{n}_proj.bias" for n in ("q", "k", "v", "o")}))
    weights.update(_optional(reader, {"q_norm": f"{p}.q_norm.weight", "k_norm": f"{p}.k_norm.weight",
                                      "sinks": f"{p}.sinks"}))
    return weights


def read_mla_attention(reader: CheckpointReader, layer_id: int) -> dict[str, torch.Tensor]:
    """MLA: the low-rank query path (or q_proj), kv_a_proj_with_mqa, the latent's norm, kv_b, o."""
    p = f"model.layers.{layer_id}.self_attn"
    names = {"q_a": "q_a_proj.weight", "q_a_norm": "q_a_layernorm.weight", "q_b": "q_b_proj.weight",
             "q": "q_proj.weight", "q_a_bias": "q_a_proj.bias", "kv_a_bias": "kv_a_proj_with_mqa.bias",
             "o_bias": "o_proj.bias"}
    weights = _optional(reader, {k: f"{p}.{v}" for k, v in names.items()})
    if "q" not in weights and not {"q_a", "q_a_norm", "q_b"} <= set(weights):
        raise CheckpointError(f"{p}: neither q_proj nor q_a_proj/q_a_layernorm/q_b_proj")
    weights.update(kv_a=reader.get(f"{p}.kv_a_proj_with_mqa.weight"), kv_a_norm=reader.get(f"{p}.kv_a_layernorm.weight"),
                   kv_b=reader.get(f"{p}.kv_b_proj.weight"), o=reader.get(f"{p}.o_proj.weight"))
    return weights


def _optional(reader: CheckpointReader, names: dict[str, str]) -> dict[str, torch.Tensor]:
    return {key: reader.get(name) for key, name in names.items() if reader.has(name)}


def moe_prefix(reader: CheckpointReader, layer_id: int) -> tuple[str, str]:
    """(MoE block prefix, router name) of a sparse layer."""
    for name in _MOE_PREFIXES:
        for router in _ROUTER_NAMES:
            prefix = f"model.layers.{layer_id}.{name}"
            if reader.has(f"{prefix}.{router}.weight"):
                return prefix, router
    raise CheckpointError(f"layer {layer_id}: no router weight (mlp.gate / mlp.router / block_sparse_moe.gate)")
