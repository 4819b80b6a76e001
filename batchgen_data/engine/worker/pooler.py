"""The pooler: pooling requests' outputs from their pooled states (vLLM's pooler heads).

The pooled state is the model's output state (after its final norm) at the last prompt position
(vLLM's LAST pooling, the default for a generative model converted to embed or classify). Heads
run in fp32, as vLLM's:
  embed     keep the first ``dimensions`` values (matryoshka), then L2-normalize (``normalize``)
  classify  the classification head ``score`` [L, H], then the checkpoint's activation (softmax;
            sigmoid for one label or multi-label; identity for regression) when ``use_activation``
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchgen_data.engine.pooling_params import PoolingParams
from batchgen_data.model import MoEModel

_ACTIVATIONS = {
    "softmax": lambda logits: torch.softmax(logits, dim=-1),
    "sigmoid": torch.sigmoid,
    "identity": lambda logits: logits,
}


def pool(model: MoEModel, states: torch.Tensor, params: list[PoolingParams]) -> list[list[float]]:
    """states: [N, H], row i the pooled state of the request of ``params[i]`` -> each request's
    output values, in order."""
    states = states.float()  # [N, H]
    outputs: list[list[float]] = [[] for _ in params]
    groups: dict[tuple, list[int]] = {}  # rows sharing a head and its options run as one batch
    for i, p in enumerate(params):
        key = (p.task, p.dimensions, p.normalize) if p.task == "embed" else (p.task, p.use_activation)
        groups.setdefault(key, []).append(i)
    for key, rows in groups.items():
        x = states[torch.tensor(rows, device=states.device)]  # [n, H]
        if key[0] == "embed":
            _, dimensions, normalize = key
            values = _embed(x, dimensions, normalize)  # [n, D]
        else:
            values = _classify(model, x, use_activation=key[1])  # [n, L]
        for i, row in zip(rows, values.tolist()):
            outputs[i] = row
    return outputs


def _embed(x: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    if dimensions is not None:
        x = x[:, :dimensions]  # [n, D]
    return F.normalize(x, p=2, dim=-1) if normalize else x


def _classify(model: MoEModel, x: torch.Tensor, use_activation: bool) -> torch.Tensor:
    # PoolingParams.check_model refused classify on a model without a head before it got here.
    logits = x @ model.score.t()  # [n, H] @ [H, L] -> [n, L]
    if not use_activation:
        return logits
    return _ACTIVATIONS[model.config.classifier_activation](logits)
