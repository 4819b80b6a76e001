"""Which experts each sparse layer will likely ask a streamed store for next."""

from __future__ import annotations

_HEAT_DECAY = 0.5  # per call of a layer: how fast an expert's request history fades
_PREDICT_HEAT = 1.0  # prefetch the experts asked for in the last call of their layer


class PrefetchPredictor:
    """Per layer and expert a request count that halves at every call of the layer (heat);
    owns each layer's ``likely`` experts, hottest first: those its last call asked for."""

    def __init__(self, layer_ids: tuple[int, ...], num_experts: int):
        self._all = tuple(range(num_experts))
        self._heat = {layer: [0.0] * num_experts for layer in layer_ids}
        self.likely: dict[int, list[int]] = {layer: [] for layer in layer_ids}  # prefetch order

    def note_request(self, layer_id: int, expert_ids: list[int]) -> None:
        heat = self._heat[layer_id]
        for e in self._all:
            heat[e] *= _HEAT_DECAY
        for e in expert_ids:
            heat[e] += 1.0
        likely = (e for e in self._all if heat[e] >= _PREDICT_HEAT)
        self.likely[layer_id] = sorted(likely, key=lambda e: -heat[e])
