"""A step that only starts sequences waits (``GRAMMAR_JOIN_S`` at most) for the grammars still
compiling, so rows that each bring their own grammar start in one prefill."""

from __future__ import annotations

from batchgen_data import Engine, EngineConfig, SamplingParams
from batchgen_data.engine.core import grammar_gate
from batchgen_data.engine.executor.in_process import InProcessExecutor


def _steps(engine: Engine, prompts: list[str], params) -> int:
    steps = []
    real = InProcessExecutor.step

    def spy(self, *args, **kwargs):
        steps.append(1)
        return real(self, *args, **kwargs)

    InProcessExecutor.step = spy
    try:
        outputs = engine.generate(prompts, params)
    finally:
        InProcessExecutor.step = real
    assert all(o.error is None and o.num_generated_tokens == 6 for o in outputs)
    return len(steps)


def test_rows_with_their_own_grammars_start_in_one_prefill(tiny_checkpoint, monkeypatch):
    folder, _ = tiny_checkpoint("qwen3_moe")
    prompts = [f"Row {i}: a code." for i in range(12)]
    with Engine(folder, EngineConfig(block_size=8, max_num_seqs=16)) as engine:
        base = dict(max_tokens=6, temperature=0, ignore_eos=True)
        engine.generate(prompts[:1], SamplingParams(**base, structured_outputs={"regex": "[a-z]{40}"}))  # the tokenizer view
        params = [SamplingParams(**base, structured_outputs={"regex": f"[a-z]{{{50 + i}}}"}) for i in range(len(prompts))]
        assert _steps(engine, prompts, params) == 6  # one prefill (samples the first token), five decode steps
        monkeypatch.setattr(grammar_gate, "GRAMMAR_JOIN_S", 0.0)
        slow = engine.executor.structured.compiler._compile

        def slow_compile(*args):  # compiles that outlast the (zero) wait: late rows start a step later
            import time

            time.sleep(0.01)
            return slow(*args)

        monkeypatch.setattr(engine.executor.structured.compiler, "_compile", slow_compile)
        params = [SamplingParams(**base, structured_outputs={"regex": f"[a-z]{{{80 + i}}}"}) for i in range(len(prompts))]
        assert _steps(engine, prompts, params) > 6
