"""Where a MoE layer's expert weights sit, as the address table the decode kernels read.

``moe_block_decode`` and ``decode_forward`` (``decode_layer.cpp``) find expert e's gate [F, H],
up [F, H] and down [H, F] projections at the addresses in row e of an [E, 3] int64 table (0: the
expert is not held). The table describes stacked experts (row r of ``w_gate_up`` [n, 2F, H] holds
gate then up) and separate tensors alike, so the same kernels run over resident experts and over
a memory-mapped checkpoint's per-expert tensors read in place (a streamed store on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen_data.model.native.kernels import _check_fp32_cpu


@dataclass(slots=True)
class ExpertTable:
    """One layer's [E, 3] address table and the tensors it points into (held, so that the
    addresses stay valid as long as the table is used)."""

    addresses: torch.Tensor  # [E, 3] int64: gate, up, down of expert e; 0 where not held
    ffn: int  # F
    keep: tuple[torch.Tensor, ...]

    @property
    def num_experts(self) -> int:
        return self.addresses.shape[0]


def stacked_table(w_gate_up: torch.Tensor, w_down: torch.Tensor, row_of: torch.Tensor | None = None) -> ExpertTable:
    """The table of stacked experts: expert e in row ``row_of[e]`` (-1: not held; None: row e)
    of w_gate_up [n, 2F, H] and w_down [n, H, F]."""
    rows, two_f, hidden = w_gate_up.shape
    ffn = two_f // 2
    if (two_f % 2 or w_down.dim() != 3 or tuple(w_down.shape) != (rows, hidden, ffn)
            or not (w_gate_up.is_contiguous() and w_down.is_contiguous())):
        raise ValueError(f"stacked experts need contiguous w_gate_up [n, 2F, H] and w_down [n, H, F], got "
                         f"{tuple(w_gate_up.shape)} and {tuple(w_down.shape)}")
    _check_fp32_cpu(w_gate_up, w_down)
    row_of = torch.arange(rows) if row_of is None else row_of.to(torch.int64)
    if bool(((row_of < -1) | (row_of >= rows)).any()):
        raise ValueError(f"expert rows {row_of.tolist()} out of range for {rows} stacked experts")
    item = w_gate_up.element_size()
    gate = w_gate_up.data_ptr() + row_of * (two_f * hidden * item)
    down = w_down.data_ptr() + row_of * (hidden * ffn * item)
    addresses = torch.stack([gate, gate + ffn * hidden * item, down], dim=1)
    addresses[row_of < 0] = 0
    return ExpertTable(addresses.contiguous(), ffn, (w_gate_up, w_down))


def views_table(experts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> ExpertTable:
    """The table of separate tensors: ``experts[e]`` = (gate [F, H], up [F, H], down [H, F]),
    each contiguous fp32 on the CPU (a memory-mapped checkpoint's views, for one)."""
    if not experts:
        raise ValueError("an expert table needs at least one expert")
    ffn, hidden = experts[0][0].shape
    for gate, up, down in experts:
        if (tuple(gate.shape) != (ffn, hidden) or tuple(up.shape) != (ffn, hidden) or tuple(down.shape) != (hidden, ffn)
                or not (gate.is_contiguous() and up.is_contiguous() and down.is_contiguous())):
            raise ValueError(f"expert views need contiguous gate and up [{ffn}, {hidden}] and down [{hidden}, {ffn}], "
                             f"got {tuple(gate.shape)}, {tuple(up.shape)}, {tuple(down.shape)}")
        _check_fp32_cpu(gate, up, down)
    addresses = torch.tensor([[t.data_ptr() for t in expert] for expert in experts], dtype=torch.int64)
    return ExpertTable(addresses, ffn, tuple(t for expert in experts for t in expert))
