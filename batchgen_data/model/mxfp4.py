"""MXFP4 (OCP microscaling FP4) dequantization, as gpt-oss checkpoints store their experts.

A block of 32 values shares one 8-bit power-of-two scale (E8M0, bias 127); each value is a 4-bit
E2M1 float, two per byte, the low nibble first. ``*_blocks`` holds [..., G, 16] bytes and
``*_scales`` [..., G] exponents for rows of G * 32 values.
"""

from __future__ import annotations

import torch

# E2M1 code -> value: sign bit, 2 exponent bits, 1 mantissa bit.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_SCALE_BIAS = 127
_ROWS_PER_CHUNK = 1 << 16  # bounds the int64 index temporaries to a few MB per chunk


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks: uint8 [..., G, 16]; scales: uint8 [..., G] -> ``dtype`` [..., G * 32]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} (want [..., G, 16] / [..., G])")
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)
    *prefix, groups, _ = blocks.shape
    flat_blocks = blocks.reshape(-1, 16)
    exponents = scales.reshape(-1, 1).to(torch.int32) - _SCALE_BIAS
    out = torch.empty(flat_blocks.shape[0], 32, dtype=torch.float32)
    for start in range(0, flat_blocks.shape[0], _ROWS_PER_CHUNK):
        chunk = flat_blocks[start : start + _ROWS_PER_CHUNK]
        view = out[start : start + _ROWS_PER_CHUNK]
        view[:, 0::2] = lut[(chunk & 0x0F).long()]
        view[:, 1::2] = lut[(chunk >> 4).long()]
        torch.ldexp(view, exponents[start : start + _ROWS_PER_CHUNK], out=view)
    return out.view(*prefix, groups * 32).to(dtype)
