"""Where a sparse layer's routed experts sit in the checkpoint, and how one expert fills one row.

Every checkpoint layout becomes a ``LayerExperts``: per-expert keys (Mixtral ``w1/w2/w3``, Qwen /
OLMoE / DeepSeek / GLM ``gate_proj/up_proj/down_proj``), fused 3-D tensors (``gate_up_proj``
[E, 2F, H] and ``down_proj`` [E, H, F], or their transposes, or separate 3-D ``gate_proj`` /
``up_proj``), gpt-oss's [E, in, out] experts with interleaved gate/up columns and biases, and
gpt-oss's MXFP4 experts (``*_blocks`` / ``*_scales``, dequantized one expert at a time).

``fill(expert, dest, row)`` copies one expert into row ``row`` of stacked ``ExpertWeights``. The
stored tensors are views of the memory-mapped safetensors files (``CheckpointReader.raw`` slices
read nothing until copied), so a fill is one copy per tensor from the page cache into the row:
resident loading fills [E, ...] tensors (``read_experts``), the streamed store fills pool slots.
Building a ``LayerExperts`` checks that every expert's tensors exist with the expected shapes, so
a checkpoint missing an expert fails at load, not in the middle of a job.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchgen_data.errors import CheckpointError
from batchgen_data.model.checkpoint import CheckpointReader
from batchgen_data.model.config import ModelConfig
from batchgen_data.model.moe.experts import ExpertWeights
from batchgen_data.model.mxfp4 import dequantize_mxfp4

# (gate, up, down) names of per-expert projections.
_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
_ALL = slice(None)


@dataclass(frozen=True, slots=True)
class _Stored:
    """One stored tensor of an expert and the destination rows it fills."""

    read: Callable[[int], torch.Tensor]  # expert id -> the expert's tensor as [out, in] (or [out])
    # (ExpertWeights field, rows of that field's expert row, rows of the read tensor)
    into: tuple[tuple[str, slice, slice], ...]


@dataclass(frozen=True, slots=True)
class LayerExperts:
    """One sparse layer's E experts as the checkpoint stores them."""

    num_experts: int
    hidden: int
    ffn: int
    has_bias: bool
    parts: tuple[_Stored, ...]

    def fill(self, expert_id: int, dest: ExpertWeights, row: int) -> None:
        """Copy expert ``expert_id`` into row ``row`` of ``dest`` (converting the dtype)."""
        for part in self.parts:
            source = part.read(expert_id)
            for field, dest_rows, source_rows in part.into:
                getattr(dest, field)[row, dest_rows].copy_(source[source_rows])

    def in_place(self, expert_id: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Expert ``expert_id``'s (gate [F, H], up [F, H], down [H, F]) as the stored tensors
        themselves (views of the memory map, nothing copied), or None where a projection is not
        stored so: another dtype (FP8, MXFP4, bf16 for an fp32 engine), transposed, interleaved
        or with biases."""
        if self.has_bias:
            return None
        found: dict[str, torch.Tensor] = {}
        for part in self.parts:
            source = part.read(expert_id)
            if source.dtype != dtype or not source.is_contiguous() or source.device.type != "cpu":
                return None
            for field, dest_rows, source_rows in part.into:
                if source_rows != _ALL:
                    return None
                if field == "w_down" and dest_rows == _ALL:
                    found["down"] = source
                elif field == "w_gate_up" and dest_rows == _ALL:
                    found["gate"], found["up"] = source[: self.ffn], source[self.ffn :]
                elif field == "w_gate_up" and dest_rows == slice(0, self.ffn):
                    found["gate"] = source
                elif field == "w_gate_up" and dest_rows == slice(self.ffn, 2 * self.ffn):
                    found["up"] = source
                else:
                    return None
        if found.keys() != {"gate", "up", "down"}:
            return None
        return found["gate"], found["up"], found["down"]

    def bytes_per_expert(self, element_size: int) -> int:
        return ExpertWeights.bytes_per_expert(self.hidden, self.ffn, self.has_bias, element_size)


def layer_experts(reader: CheckpointReader, prefix: str, config: ModelConfig) -> LayerExperts:
    """The experts under ``{prefix}.experts``, whatever the layout; raises ``CheckpointError``
    if any expert's tensor is missing or has the wrong shape."""
    p = f"{prefix}.experts"
    full, hidden, ffn = config.num_experts, config.hidden_size, config.moe_intermediate_size
    gate_rows, up_rows = slice(0, ffn), slice(ffn, 2 * ffn)
    if config.expert_layout == "in_out":
        return _in_out_experts(reader, p, config)
    if reader.has(f"{p}.gate_up_proj") or reader.has(f"{p}.gate_proj"):
        down = _Stored(_fused(reader, f"{p}.down_proj", (full, hidden, ffn)), (("w_down", _ALL, _ALL),))
        if reader.has(f"{p}.gate_up_proj"):
            gate_up = (_Stored(_fused(reader, f"{p}.gate_up_proj", (full, 2 * ffn, hidden)), (("w_gate_up", _ALL, _ALL),)),)
        else:
            gate_up = (_Stored(_fused(reader, f"{p}.gate_proj", (full, ffn, hidden)), (("w_gate_up", gate_rows, _ALL),)),
                       _Stored(_fused(reader, f"{p}.up_proj", (full, ffn, hidden)), (("w_gate_up", up_rows, _ALL),)))
        return LayerExperts(full, hidden, ffn, False, (*gate_up, down))
    for gate_name, up_name, down_name in _EXPERT_NAMES:
        if reader.has(f"{p}.0.{gate_name}.weight"):
            parts = (
                _Stored(_per_expert(reader, p, gate_name, full, (ffn, hidden)), (("w_gate_up", gate_rows, _ALL),)),
                _Stored(_per_expert(reader, p, up_name, full, (ffn, hidden)), (("w_gate_up", up_rows, _ALL),)),
                _Stored(_per_expert(reader, p, down_name, full, (hidden, ffn)), (("w_down", _ALL, _ALL),)),
            )
            return LayerExperts(full, hidden, ffn, False, parts)
    raise CheckpointError(f"no expert weights under {p!r} (per-expert or fused)")


def read_experts(reader: CheckpointReader, prefix: str, config: ModelConfig, experts: range | None = None) -> ExpertWeights:
    """Stack a layer's experts into [n, 2F, H] / [n, H, F], whatever the checkpoint's layout.

    ``experts`` (default: all) is the contiguous block of expert ids to load; the others are
    never read, not even transiently (an expert-parallel rank's shard).
    """
    layer = layer_experts(reader, prefix, config)
    experts = range(config.num_experts) if experts is None else experts
    weights = ExpertWeights.empty(len(experts), layer.hidden, layer.ffn, layer.has_bias, reader.dtype, reader.device)
    for row, expert_id in enumerate(experts):
        layer.fill(expert_id, weights, row)
    return weights


def _per_expert(reader: CheckpointReader, p: str, name: str, count: int, shape: tuple[int, int]):
    names = [f"{p}.{e}.{name}.weight" for e in range(count)]
    for n in names:
        _check(reader, n, shape, f"an expert of {p!r}")
    return lambda e: reader.values(names[e])


def _fused(reader: CheckpointReader, name: str, shape: tuple[int, int, int]):
    """Expert e of a fused [E, a, b] tensor as ``shape[1:]``, transposing the last two dims if the
    checkpoint stores them the other way."""
    _require(reader, name, "fused experts")
    stored = reader.shape(name)
    if stored == shape:
        return lambda e: reader.values(name, range(e, e + 1))[0]
    if stored == (shape[0], shape[2], shape[1]):
        return lambda e: reader.values(name, range(e, e + 1))[0].t()
    raise CheckpointError(f"{name}: fused expert tensor of shape {stored}, expected {shape}")


def _in_out_experts(reader: CheckpointReader, p: str, config: ModelConfig) -> LayerExperts:
    """gpt-oss: ``gate_up_proj`` [E, H, 2F] with gate and up in alternate columns, ``down_proj``
    [E, F, H], biases ``*_bias``; or MXFP4 ``*_blocks`` [E, out, in/32, 16] and ``*_scales``,
    which dequantize to [E, out, in]. Gate and up are de-interleaved to gate rows, then up rows."""
    full, hidden, ffn = config.num_experts, config.hidden_size, config.moe_intermediate_size
    if reader.has(f"{p}.gate_up_proj_blocks"):
        def stored(name: str, out: int, inner: int):
            for suffix, shape in (("blocks", (full, out, inner // 32, 16)), ("scales", (full, out, inner // 32))):
                _check(reader, f"{name}_{suffix}", shape, "MXFP4 experts as [E, out, in/32, 16] / [E, out, in/32]")
            return lambda e: dequantize_mxfp4(reader.raw(f"{name}_blocks", range(e, e + 1)),
                                              reader.raw(f"{name}_scales", range(e, e + 1)))[0]
    else:
        def stored(name: str, out: int, inner: int):
            _check(reader, name, (full, inner, out), "experts as [E, in, out]")
            return lambda e: reader.values(name, range(e, e + 1))[0].t()
    _check(reader, f"{p}.gate_up_proj_bias", (full, 2 * ffn), "biases as [E, 2F]")
    _check(reader, f"{p}.down_proj_bias", (full, hidden), "biases as [E, H]")
    interleaved = (slice(0, ffn), slice(0, None, 2)), (slice(ffn, 2 * ffn), slice(1, None, 2))
    parts = (
        _Stored(stored(f"{p}.gate_up_proj", 2 * ffn, hidden), tuple(("w_gate_up", d, s) for d, s in interleaved)),
        _Stored(stored(f"{p}.down_proj", hidden, ffn), (("w_down", _ALL, _ALL),)),
        _Stored(lambda e: reader.values(f"{p}.gate_up_proj_bias", range(e, e + 1))[0],
                tuple(("b_gate_up", d, s) for d, s in interleaved)),
        _Stored(lambda e: reader.values(f"{p}.down_proj_bias", range(e, e + 1))[0], (("b_down", _ALL, _ALL),)),
    )
    return LayerExperts(full, hidden, ffn, True, parts)


def _require(reader: CheckpointReader, name: str, what: str) -> None:
    if not reader.has(name):
        raise CheckpointError(f"tensor {name!r} missing from checkpoint {str(reader.folder)!r} ({what})")


def _check(reader: CheckpointReader, name: str, shape: tuple[int, ...], what: str) -> None:
    _require(reader, name, what)
    if reader.shape(name) != shape:
        raise CheckpointError(f"{name}: shape {reader.shape(name)}, expected {shape} ({what})")
