"""What a modelled actor's engine costs (``ActorModel``): the engine's step model (a decode step
with ``n`` sequences running takes ``base_s + per_seq_s * n``, ``rebalance/core/step_model.py``)
and what it leaves out: the prompt's prefill, start-up, KV memory, moving a sequence, a round trip
to the coordinator. Read from a step-model file (JSON with these fields); ``benchmarks/skew.py``
writes one measured on a real engine."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from batchgen_data.errors import ConfigError
from batchgen_data.rebalance.core.step_model import StepModel


@dataclass(frozen=True, slots=True)
class ActorModel:
    # Defaults: the demo model on one AMD EPYC core (a decode step 9 ms at 2 sequences, 19 ms at
    # 16; the calibration in ``step_model.py``), started in ~4 s.
    base_s: float = 0.0075
    per_seq_s: float = 0.0007
    prefill_s_per_token: float = 0.0002  # prompt (or recomputed) tokens, in the step that admits them
    startup_s: float = 4.0  # actor start to its first step: model load, calibration
    kv_capacity_tokens: int = 1 << 20  # KV tokens its engine holds (a row reserves its full length)
    kv_bytes_per_token: int = 8192
    transfer_bytes_per_s: float = 1e9  # KV shipped between actors (recomputed where that is faster)
    call_s: float = 0.005  # one round trip to the coordinator

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"{f.name} must be a number >= 0, got {value!r}")
        if self.base_s + self.per_seq_s <= 0:
            raise ConfigError("a step must take some time: base_s + per_seq_s > 0")

    @property
    def step_model(self) -> StepModel:
        return StepModel(self.base_s, self.per_seq_s)

    @property
    def kv_s_per_token(self) -> float:
        return self.kv_bytes_per_token / self.transfer_bytes_per_s if self.transfer_bytes_per_s else float("inf")

    @property
    def move_s_per_token(self) -> float:
        """Moving one computed token: shipping its KV or recomputing it, whichever is cheaper."""
        return min(self.kv_s_per_token, self.prefill_s_per_token)

    @classmethod
    def from_file(cls, path: Path) -> ActorModel:
        try:
            values = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError(f"cannot read the step-model file {path}: {err}") from None
        known = {f.name for f in fields(cls)}
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        return cls(**{k: v for k, v in values.items() if k in known})

    def to_dict(self) -> dict:
        return asdict(self)
