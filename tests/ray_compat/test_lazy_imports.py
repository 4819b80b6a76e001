"""Importing the processor API stays light, as Ray's ``test_lazy_imports.py`` checks for
``ray.data.llm``: no torch, transformers or tokenizers until an engine runs."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "transformers", "tokenizers", "huggingface_hub", "batchgen_data.engine.engine",
         "batchgen_data.operators.ray_operator")


def test_the_processor_api_imports_without_an_engine(tmp_path):
    code = ("import sys; from batchgen_data import build_processor, vLLMEngineProcessorConfig, "
            "ChatTemplateStageConfig, Processor;"
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
