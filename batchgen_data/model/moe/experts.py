"""The expert contract: stacked expert weights, the expert activation, and the backend interface.

Shape legend: T = tokens, H = hidden, E = experts, K = experts per token, F = expert FFN size,
R = T * K routed token copies, n = experts held in one ``ExpertWeights``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from batchgen_data.model.moe.router import Routing


@dataclass(slots=True)
class ExpertWeights:
    """Some experts of one layer, stacked so an expert is an index (a row).

    ``row_of`` maps a global expert id to its row ([E] int64, -1 where this set does not hold the
    expert); None means row e holds expert e, for every expert of the layer. ``wait_row`` (a
    streamed store's answer) blocks until a row's copy has landed; ``row`` calls it, so a backend
    computes expert e while later experts are still arriving.
    """

    w_gate_up: torch.Tensor  # [n, 2F, H] gate rows first, then up rows
    w_down: torch.Tensor  # [n, H, F]
    b_gate_up: torch.Tensor | None = None  # [n, 2F]
    b_down: torch.Tensor | None = None  # [n, H]
    row_of: torch.Tensor | None = None  # [E] global expert id -> row
    wait_row: Callable[[int], None] | None = None

    @classmethod
    def empty(cls, num_rows: int, hidden: int, ffn: int, has_bias: bool, dtype: torch.dtype,
              device: torch.device | str, pin_memory: bool = False) -> ExpertWeights:
        """Uninitialised rows for ``num_rows`` experts of hidden size H and FFN size F
        (``pin_memory``: page-locked host memory, for asynchronous copies to a GPU)."""
        def new(*shape: int) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, device=device, pin_memory=pin_memory)

        return cls(new(num_rows, 2 * ffn, hidden), new(num_rows, hidden, ffn),
                   new(num_rows, 2 * ffn) if has_bias else None, new(num_rows, hidden) if has_bias else None)

    @staticmethod
    def bytes_per_expert(hidden: int, ffn: int, has_bias: bool, element_size: int) -> int:
        """One expert's weights (gate, up, down and their biases) in bytes."""
        return (3 * ffn * hidden + (2 * ffn + hidden if has_bias else 0)) * element_size

    @property
    def num_rows(self) -> int:
        return self.w_gate_up.shape[0]

    @property
    def nbytes(self) -> int:
        tensors = (self.w_gate_up, self.w_down, self.b_gate_up, self.b_down)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def copy_row(self, row: int, dest: ExpertWeights, dest_row: int, non_blocking: bool = False) -> None:
        """Copy one expert's row into ``dest``'s row ``dest_row``."""
        for name in ("w_gate_up", "w_down", "b_gate_up", "b_down"):
            source = getattr(self, name)
            if source is not None:
                getattr(dest, name)[dest_row].copy_(source[row], non_blocking=non_blocking)

    def row(self, expert_id: int) -> int:
        """The row holding ``expert_id`` (-1: not held), once its weights are there to read."""
        row = expert_id if self.row_of is None else int(self.row_of[expert_id])
        if self.wait_row is not None and row >= 0:
            self.wait_row(row)
        return row


@dataclass(frozen=True, slots=True)
class SwiGLU:
    """``silu(gate) * up``: Mixtral, Qwen, OLMoE, DeepSeek and GLM experts."""

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up


@dataclass(frozen=True, slots=True)
class ClampedSwiGLU:
    """gpt-oss: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, g = ``min(gate, limit)``."""

    alpha: float
    limit: float

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


ExpertActivation = SwiGLU | ClampedSwiGLU
SWIGLU = SwiGLU()


def expert_ffn(x: torch.Tensor, weights: ExpertWeights, row: int, activation: ExpertActivation, linear) -> torch.Tensor:
    """One expert on its tokens: x [n, H] -> [n, H] (``linear`` is the GEMM to run)."""
    b_gate_up = None if weights.b_gate_up is None else weights.b_gate_up[row]
    b_down = None if weights.b_down is None else weights.b_down[row]
    gate, up = linear(x, weights.w_gate_up[row], b_gate_up).chunk(2, dim=-1)  # [n, F] each
    return linear(activation(gate, up), weights.w_down[row], b_down)


@dataclass(slots=True)
class ExpertOutput:
    hidden: torch.Tensor  # [T, H] weighted sum over each token's experts
    tokens_per_expert: torch.Tensor  # [E] routed tokens each expert processed (int64, CPU)


class ExpertBackend(Protocol):
    """Runs one layer's experts: tokens in, tokens out, counts per expert.

    A backend reads expert weights only through its layer's ``ExpertStore`` (``store.py``), so
    it runs the same whether the experts are resident, owned by other ranks or streamed. An
    expert-parallel backend exchanges tokens inside ``__call__``; callers see the same contract.
    """

    name: str

    def __call__(self, x: torch.Tensor, routing: Routing) -> ExpertOutput: ...
