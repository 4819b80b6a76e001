"""Rotary position embeddings, with the config's rope scaling (linear, yarn, llama3)."""

from __future__ import annotations

import math

import torch

from batchgen_data.model.config import RopeConfig


class RotaryEmbedding:
    """Computes cos/sin tables for flat token positions and applies them.

    ``rotary_dim`` (Dr) is how many dims of each head rotate: all of them, or the leading part
    (partial rotary, GLM), the rest passing through.
    """

    def __init__(self, rope: RopeConfig, rotary_dim: int, device: torch.device | str = "cpu"):
        inv_freq, self.attention_scaling = _inv_freq(rope, rotary_dim)
        self.inv_freq = inv_freq.to(device)  # [Dr/2]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:  # (x * 1.0 is x: skipped, two ops fewer a step)
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        if dtype != cos.dtype:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos, sin

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
        """x: [T, N, D]; cos/sin: [T, Dr] with Dr <= D: the first Dr dims rotate, the rest pass.

        Rotate-half layout pairs dim i with i + Dr/2; ``interleaved`` pairs 2i with 2i+1
        (DeepSeek) and returns the rotated pairs as [evens, odds] — the same permutation for
        queries and keys, so their dot products are those of the interleaved rotation.
        """
        rotary_dim = cos.shape[-1]
        if rotary_dim < x.shape[-1]:
            rotated = RotaryEmbedding.apply(x[..., :rotary_dim], cos, sin, interleaved)
            return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
        if interleaved:
            half = rotary_dim // 2
            c, s = cos[:, None, :half], sin[:, None, :half]
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        half = rotary_dim // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos[:, None, :] + rotated * sin[:, None, :]


def _inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    base = rope.theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (base**exponents)
    if rope.rope_type == "default":
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3(inv_freq, rope), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, dim)
    raise ValueError(f"unknown rope type {rope.rope_type!r}")


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_context = rope.original_max_position_embeddings
    low_wavelen = old_context / rope.low_freq_factor
    high_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    base, factor = rope.theta, rope.factor
    original = rope.original_max_position_embeddings

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep_extrapolation = 1 - ramp
    inv_freq = interpolation * (1 - keep_extrapolation) + extrapolation * keep_extrapolation
    return inv_freq, float(attention_factor)
