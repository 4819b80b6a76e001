"""Block-scaled FP8 weights (DeepSeek-V3 / R1, Kimi-K2 checkpoints), dequantized at load.

Such a checkpoint stores a projection's weight as ``float8_e4m3fn`` [N, K] with
``weight_scale_inv`` [ceil(N / bn), ceil(K / bk)] in fp32: the weight is ``w * scale`` block by
block, ``(bn, bk) = quantization_config.weight_block_size`` (128 x 128 in DeepSeek's releases).
The engine dequantizes each tensor as it is read and computes in its own dtype.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight [..., N, K] (FP8), scale_inv [..., ceil(N/bn), ceil(K/bk)] -> ``dtype`` [..., N, K]."""
    rows, cols = weight.shape[-2:]
    bn, bk = block
    want = (-(-rows // bn), -(-cols // bk))
    if tuple(scale_inv.shape[-2:]) != want or scale_inv.shape[:-2] != weight.shape[:-2]:
        raise ValueError(f"FP8 scales of shape {tuple(scale_inv.shape)} do not tile a {tuple(weight.shape)} weight "
                         f"in {bn} x {bk} blocks (want [..., {want[0]}, {want[1]}])")
    scale = scale_inv.float().repeat_interleave(bn, dim=-2)[..., :rows, :].repeat_interleave(bk, dim=-1)[..., :cols]
    return (weight.float() * scale).to(dtype)
