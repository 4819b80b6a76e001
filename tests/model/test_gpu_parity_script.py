"""``scripts/gpu_parity.py`` (the per-family, per-layer check against ``transformers`` meant for GPU
machines) runs on CPU too, and locates a divergence at its layer."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_parity.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_parity", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_parity_script_passes_on_cpu_and_names_the_layer_that_differs(tmp_path, monkeypatch):
    script = _load()
    clean = script.check("mixtral", "cpu", 4, 1e-4, tmp_path / "a")
    assert clean["tokens_identical"] and clean["first_differing_layer"] is None
    assert clean["max_logit_diff"] < 1e-4

    from batchgen_data.model import MoEModel

    load = MoEModel.from_pretrained.__func__

    def perturbed(cls, *args, **kwargs):  # layer 1's post-attention norm off a little: a planted bug
        model = load(cls, *args, **kwargs)
        model.layers[1].post_attention_norm.mul_(1.01)
        return model

    monkeypatch.setattr(MoEModel, "from_pretrained", classmethod(perturbed))
    broken = script.check("mixtral", "cpu", 4, 1e-4, tmp_path / "b")
    layer_id, kind, diff = broken["first_differing_layer"]
    assert layer_id == 1 and diff > 1e-3 and "attention" in kind
    assert torch.isfinite(torch.tensor(broken["max_logit_diff"]))
